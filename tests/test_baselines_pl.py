"""Model-agnostic baselines FedMD, FedCT and COMET: their maths on hand-built inputs, the wire size of hard
labels, message building, and one short end-to-end run of each through the in-process grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

import server_app
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.evaluation import EvaluationProtocol
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import parse_reply
from strategies import resolve
from strategies.comet import COMET, cluster_means, kmeans, kmeans_plus_plus
from strategies.fedct import FedCT, majority_vote, qualified, vote_counts
from strategies.fedmd import TRAIN_PUBLIC, FedMD, alignment_subset, fedmd_consensus
from strategies.pseudolabel_base import collect_predictions

torch.set_num_threads(1)

SMALL = (
    "data.source=digits data.partition=cosmos-groups data.alpha=5 data.groups=2 data.num_clients=4 "
    "data.public_fraction=0.2 rounds=2 model.per_client=[cnn,mlp] client.optimizer=adam client.lr=0.001 "
    "client.batch_size=32 client.epochs=1 "
    "strategy.params.fedmd.distill_epochs=1 strategy.params.fedct.distill_epochs=1 "
    "strategy.params.comet.distill_epochs=1"
)


# --------------------------------------------------------------------------- FedCT votes


def test_majority_vote_counts_and_ties_go_to_lowest_class():
    votes = np.array([[0, 2, 1, 3], [0, 1, 2, 3], [1, 1, 0, 2]])
    labels, agreement = majority_vote(votes, 4)
    # sample 2 is a three-way tie (1, 2, 0): the lowest class id, 0, wins
    assert labels.tolist() == [0, 1, 0, 3]
    np.testing.assert_allclose(agreement, [2 / 3, 2 / 3, 1 / 3, 2 / 3])
    assert vote_counts(votes, 4)[2].tolist() == [1, 1, 1, 0]


def test_majority_vote_ignores_abstentions_and_all_abstain_abstains():
    m = 3
    votes = np.array([[2, m, m], [1, m, 0], [1, m, m]])
    labels, agreement = majority_vote(votes, m)
    assert labels.tolist() == [1, m, 0]
    np.testing.assert_allclose(agreement, [2 / 3, 0.0, 1.0])


def test_qualified_vote_abstains_below_threshold():
    votes = np.array([[0, 1, 2, 2], [0, 1, 0, 2], [0, 2, 1, 2], [1, 2, 1, 2]])
    # agreements: 3/4, 2/4 (tie 1 vs 2 -> 1), 2/4 (1 wins over 0, 2), 4/4
    vote = majority_vote(votes, 3)
    assert qualified(*vote, 3, 0.0).tolist() == [0, 1, 1, 2]
    assert qualified(*vote, 3, 0.75).tolist() == [0, 3, 3, 2]
    assert qualified(*vote, 3, 1.0).tolist() == [3, 3, 3, 2]


def test_vote_rejects_out_of_range_labels():
    with pytest.raises(ValueError):
        majority_vote(np.array([[0, 5]]), 4)


# --------------------------------------------------------------------------- hard labels on the wire


def test_hard_label_encoding_is_one_byte_per_sample():
    n, m = 1000, 10
    probs = np.random.default_rng(0).dirichlet(np.ones(m), size=n).astype(np.float32)
    wire = pseudolabels.encode(probs, "hard", m)
    assert wire.dtype == np.uint8 and wire.shape == (n,)
    assert np.array_equal(wire, probs.argmax(axis=1))
    nbytes = protocol.record_nbytes(RecordDict({"p": protocol.arrays_record({protocol.PREDICTION_ARRAY: wire})}))
    assert n <= nbytes <= n + 256  # |U| bytes plus the array header
    soft = protocol.record_nbytes(RecordDict({"p": protocol.arrays_record({protocol.PREDICTION_ARRAY: probs})}))
    assert soft >= 4 * n * m
    assert pseudolabels.label_dtype(255) == np.uint8  # classes 0..254 plus the abstain marker 255
    assert pseudolabels.label_dtype(256) == np.uint16


@pytest.fixture(autouse=True)
def _flower_identity() -> None:
    """Message() needs a task identity outside Flower's runtime; the in-process grid sets one."""
    InProcessGrid(1)


def _reply(cid: int, preds: np.ndarray) -> ClientReply:
    return ClientReply(
        node_id=100 + cid, client_id=cid, num_examples=10, metrics={}, predictions={protocol.PREDICTION_ARRAY: preds}
    )


def targets_of(msg) -> protocol.Targets:
    """The targets record of a message, decoded (empty without one)."""
    return (
        protocol.Targets.decode(msg.content[protocol.TARGETS])
        if protocol.TARGETS in msg.content
        else protocol.Targets()
    )


def test_collect_predictions_stacks_validated_replies_in_client_order():
    """The replies were checked once, by the reply validator: collect_predictions decodes and orders them, and a
    reply without predictions (one that bypassed the validator) is an error, not a silent drop."""
    p = [np.full((3, 2), v, np.float32) for v in (0.1, 0.2, 0.3)]
    used, stack = collect_predictions([_reply(2, p[2]), _reply(0, p[0]), _reply(1, p[1])], 3, 2, "probs")
    assert [r.client_id for r in used] == [0, 1, 2]
    assert stack.shape == (3, 3, 2) and np.array_equal(stack, np.stack(p))
    used, votes = collect_predictions(
        [_reply(1, np.array([2, 0], np.uint8)), _reply(0, np.array([1, 1], np.uint8))], 2, 3, "hard"
    )
    assert votes.dtype == np.int64 and votes.tolist() == [[1, 1], [2, 0]]
    assert collect_predictions([], 3, 2, "probs")[1].shape == (0, 3, 2)
    with pytest.raises(ValueError, match="client 4's reply carries no predictions"):
        collect_predictions([ClientReply(node_id=104, client_id=4, num_examples=10, metrics={})], 3, 2, "probs")


def test_fedct_broadcasts_one_uint8_vote_and_skips_u_when_all_abstain():
    cfg = load_config(None, f"strategy.name=fedct strategy.params.fedct.qualified_threshold=0.75 {SMALL}")
    s = FedCT(cfg)
    n, m = s.public_size, s.num_classes
    base = np.arange(n) % m
    votes = [base, base, base, (base + 1) % m]  # agreement 3/4 everywhere
    s.aggregate(1, [_reply(i, v.astype(np.uint8)) for i, v in enumerate(votes)])
    msgs = protocol.build_messages(s.round_messages(2, [100, 101, 102, 103]))
    for msg in msgs:
        wire = targets_of(msg).values
        assert wire.dtype == np.uint8 and np.array_equal(wire, base)
        request = protocol.request_of(msg)
        assert request.training.section(protocol.DISTILL).loss == "ce"
        assert request.public.encoding == "hard"
    split = [base, base, (base + 1) % m, (base + 2) % m]  # agreement 1/2 < 3/4: every sample abstains
    s.aggregate(2, [_reply(i, v.astype(np.uint8)) for i, v in enumerate(split)])
    assert np.all(s.consensus == m)
    msgs = protocol.build_messages(s.round_messages(3, [100]))
    assert "distill" not in protocol.request_of(msgs[0]).ops and protocol.TARGETS not in msgs[0].content


# --------------------------------------------------------------------------- FedMD


def test_fedmd_consensus_is_mean_of_logits():
    scores = np.array(
        [[[1.0, -1.0], [0.0, 2.0]], [[3.0, 1.0], [2.0, 0.0]], [[-1.0, 3.0], [1.0, 1.0]]], dtype=np.float32
    )
    np.testing.assert_allclose(fedmd_consensus(scores), [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError):
        fedmd_consensus(np.zeros((0, 2, 2)))


def test_alignment_subset_is_sorted_unique_and_seeded():
    a = alignment_subset(np.random.default_rng(3), 100, 20)
    b = alignment_subset(np.random.default_rng(3), 100, 20)
    assert a is not None and len(a) == 20 and len(set(a.tolist())) == 20 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, b)
    assert alignment_subset(np.random.default_rng(3), 100, 0) is None
    assert alignment_subset(np.random.default_rng(3), 100, 100) is None


def test_fedmd_messages_carry_the_same_consensus_and_the_subset_indices():
    cfg = load_config(None, f"strategy.name=fedmd strategy.params.fedmd.alignment_size=30 {SMALL}")
    s = FedMD(cfg)
    m = s.num_classes
    nodes = [100, 101, 102, 103]
    msgs = protocol.build_messages(s.round_messages(1, nodes))
    assert protocol.request_of(msgs[0]).ops == ("train", "predict")  # nothing to digest yet
    rows1 = targets_of(msgs[0]).predict_rows
    assert len(rows1) == 30 and targets_of(msgs[0]).values is None
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(30, m)).astype(np.float32) for _ in nodes]
    s.aggregate(1, [_reply(i, x) for i, x in enumerate(logits)])
    msgs = protocol.build_messages(s.round_messages(2, nodes))
    assert protocol.request_of(msgs[0]).ops == ("distill", "train", "predict")
    # the base class adds the protocol's evaluations: the own (deployed) model before the digest, after training
    assert protocol.request_of(protocol.build_messages(EvaluationProtocol(s).round_drafts(2, nodes))[0]).ops == (
        "evaluate:deployed",
        "distill",
        "train",
        "predict",
        "evaluate:after",
    )
    expected = np.mean(logits, axis=0)
    for msg in msgs:  # the same consensus for everyone, on the previous round's subset
        rec = targets_of(msg)
        np.testing.assert_allclose(rec.values, expected, rtol=1e-5, atol=1e-6)
        assert np.array_equal(rec.distill_rows, rows1)
        assert len(rec.predict_rows) == 30
    assert not np.array_equal(targets_of(msgs[0]).predict_rows, rows1)
    assert protocol.request_of(msgs[0]).training.section(protocol.DISTILL).loss == "mae"


def test_fedmd_kl_option_sends_float16_softmax_of_the_mean_logits():
    cfg = load_config(
        None, f"strategy.name=fedmd strategy.params.fedmd.digest_loss=kl strategy.params.fedmd.encoding=float16 {SMALL}"
    )
    s = FedMD(cfg)
    n, m = s.public_size, s.num_classes
    logits = np.random.default_rng(1).normal(size=(2, n, m)).astype(np.float32)
    s.aggregate(1, [_reply(0, logits[0]), _reply(1, logits[1])])
    msg = protocol.build_messages(s.round_messages(2, [100]))[0]
    wire = targets_of(msg).values
    assert wire.dtype == np.float16 and targets_of(msg).distill_rows is None
    mean = logits.mean(axis=0)
    expected = np.exp(mean) / np.exp(mean).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(wire.astype(np.float32), expected, atol=2e-3)
    request = protocol.request_of(msg)
    assert request.training.section(protocol.DISTILL).loss == "kl" and request.public.encoding == "float16"


def test_fedmd_rejects_mae_on_probabilities():
    with pytest.raises(ConfigError, match="mae"):
        resolve(load_config(None, f"strategy.name=fedmd strategy.params.fedmd.scores=probs {SMALL}"))


# --------------------------------------------------------------------------- COMET clustering


def _planted(seed: int = 0, per: int = 6, k: int = 3, n: int = 20, m: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Clients' prediction matrices around k distinct centres (clients×n×m) and the planted labels."""
    rng = np.random.default_rng(seed)
    centres = rng.dirichlet(np.ones(m) * 0.3, size=(k, n))
    truth = np.repeat(np.arange(k), per)
    noisy = centres[truth] + rng.normal(scale=0.01, size=(len(truth), n, m))
    noisy = np.clip(noisy, 1e-6, None)
    return noisy / noisy.sum(axis=-1, keepdims=True), truth


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return all(len(set(b[a == j].tolist())) == 1 for j in np.unique(a)) and len(np.unique(a)) == len(np.unique(b))


def test_kmeans_recovers_planted_clusters():
    stack, truth = _planted()
    x = stack.reshape(len(stack), -1)
    labels, centroids = kmeans(x, kmeans_plus_plus(x, 3, np.random.default_rng(0)))
    assert _same_partition(labels, truth)
    means = cluster_means(stack, labels, 3)
    for j in range(3):
        np.testing.assert_allclose(means[j].reshape(-1), centroids[j], atol=1e-5)


def test_kmeans_plus_plus_is_deterministic_for_a_seed():
    x = _planted()[0].reshape(18, -1)
    a = kmeans_plus_plus(x, 3, np.random.default_rng(7))
    b = kmeans_plus_plus(x, 3, np.random.default_rng(7))
    assert np.array_equal(a, b)


def test_kmeans_warm_start_keeps_cluster_ids():
    stack, truth = _planted()
    x = stack.reshape(len(stack), -1)
    labels, centroids = kmeans(x, kmeans_plus_plus(x, 3, np.random.default_rng(1)))
    drift = x + np.random.default_rng(2).normal(scale=0.005, size=x.shape)
    again, _ = kmeans(drift, centroids)
    assert np.array_equal(again, labels)  # same ids, not merely the same partition
    order = np.random.default_rng(3).permutation(len(x))  # clients arriving in another order
    permuted, _ = kmeans(drift[order], centroids)
    assert np.array_equal(permuted, labels[order])


def test_kmeans_refills_an_empty_cluster():
    x = np.array([[0.0], [0.1], [10.0], [10.1]])
    labels, _ = kmeans(x, np.array([[0.0], [10.0], [100.0]]))
    assert sorted(np.bincount(labels, minlength=3).tolist()) == [1, 1, 2]


def test_kmeans_with_fewer_distinct_points_than_k():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [5.0, 5.0]])  # two distinct points, K = 3
    init = kmeans_plus_plus(x, 3, np.random.default_rng(0))
    assert init.shape == (3, 2)
    labels, centroids = kmeans(x, init)
    assert labels.shape == (4,) and set(labels.tolist()) <= {0, 1, 2}
    assert len(set(labels[:3].tolist())) == 1 and labels[3] != labels[0]  # equal points share a cluster
    np.testing.assert_allclose(centroids[labels], x)
    same, _ = kmeans(np.ones((4, 3)), kmeans_plus_plus(np.ones((4, 3)), 3, np.random.default_rng(0)))
    assert len(set(same.tolist())) == 1  # one distinct point: one non-empty cluster, no error


def test_kmeans_separates_coinciding_initial_centres():
    x = np.array([[0.0], [0.0], [1.0], [2.0]])  # three distinct points, all three centres start at 0
    labels, centroids = kmeans(x, np.zeros((3, 1)))
    assert sorted(np.bincount(labels, minlength=3).tolist()) == [1, 1, 2]
    np.testing.assert_allclose(centroids[labels], [[0.0], [0.0], [1.0], [2.0]])


def test_kmeans_k_equals_n_and_k_one():
    x = np.random.default_rng(0).normal(size=(5, 4))
    labels, centroids = kmeans(x, kmeans_plus_plus(x, 5, np.random.default_rng(0)))
    assert sorted(labels.tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(centroids[labels], x)
    labels, centroids = kmeans(x, kmeans_plus_plus(x, 1, np.random.default_rng(0)))
    assert labels.tolist() == [0] * 5
    np.testing.assert_allclose(centroids[0], x.mean(axis=0))
    with pytest.raises(ValueError):
        kmeans_plus_plus(x, 6, np.random.default_rng(0))


def test_comet_sends_each_client_its_cluster_mean():
    cfg = load_config(None, f"strategy.name=comet strategy.params.comet.clusters=2 {SMALL}")
    s = COMET(cfg)
    n, m = s.public_size, s.num_classes
    rng = np.random.default_rng(0)
    a, b = rng.dirichlet(np.ones(m), size=n), rng.dirichlet(np.ones(m), size=n)
    preds = [a, a, b, b]
    replies = [_reply(i, p.astype(np.float32)) for i, p in enumerate(preds)]
    for r in replies:
        s.nodes.node_to_client[r.node_id] = r.client_id
    s.aggregate(1, replies)
    assert s.assignment[0] == s.assignment[1] != s.assignment[2] == s.assignment[3]
    msgs = protocol.build_messages(s.round_messages(2, [100, 101, 102, 103]))
    np.testing.assert_allclose(targets_of(msgs[0]).values, a, atol=1e-6)
    np.testing.assert_allclose(targets_of(msgs[3]).values, b, atol=1e-6)
    assert protocol.request_of(msgs[0]).training.section(protocol.DISTILL).loss == "kl"


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    "name, extra",
    [
        ("fedmd", "strategy.params.fedmd.alignment_size=100"),
        ("fedct", "strategy.params.fedct.qualified_threshold=0.5"),
        ("comet", "strategy.params.comet.clusters=2"),
    ],
)
@pytest.mark.heavy
def test_end_to_end_in_process(tmp_path, name, extra):
    overrides = f"strategy.name={name} {SMALL} {extra}"
    cfg = load_config(None, overrides)
    grid = InProcessGrid(cfg.data.num_clients, record=True)
    summary = server_app.run_experiment(grid, None, overrides, str(tmp_path))
    assert isinstance(summary["accuracy_mean"], float) and 0.0 <= summary["accuracy_mean"] <= 1.0
    assert summary["rounds"] == 2
    replies = [parse_reply(r) for r in grid.replies if r.metadata.message_type == protocol.MESSAGE_TYPE]
    assert len(replies) == 2 * cfg.data.num_clients
    final = [parse_reply(r) for r in grid.replies if r.metadata.message_type == protocol.EVAL_MESSAGE_TYPE]
    assert len(final) == cfg.data.num_clients and all(r.arrays is None and r.predictions is None for r in final)
    for r in replies:
        assert r.arrays is None  # no model parameters ever travel
        assert r.predictions is not None and protocol.PREDICTION_ARRAY in r.predictions
        assert "after-acc" in r.metrics
    archs = {protocol.ReplyInfo.decode(r.info).arch for r in replies}
    assert archs == {"cnn", "mlp"}
    if name == "fedct":
        assert all(r.predictions[protocol.PREDICTION_ARRAY].dtype == np.uint8 for r in replies)
    for msg in grid.sent:
        assert protocol.ARRAYS not in msg.content
    round2 = [protocol.request_of(m) for m in grid.sent if protocol.request_of(m).round == 2]
    assert all("distill" in r.ops for r in round2)


def test_fedmd_labelled_pretraining_runs_train_public_in_round_one(tmp_path):
    overrides = f"strategy.name=fedmd strategy.params.fedmd.pretrain_public_epochs=1 {SMALL} rounds=1"
    grid = InProcessGrid(4, record=True)
    server_app.run_experiment(grid, None, overrides, str(tmp_path))
    first = next(m for m in grid.sent if m.metadata.message_type == protocol.MESSAGE_TYPE)  # after the identify ones
    assert protocol.request_of(first).ops[0] == TRAIN_PUBLIC
    assert all(
        "train-public-loss" in parse_reply(r).metrics
        for r in grid.replies
        if r.metadata.message_type == protocol.MESSAGE_TYPE
    )


@pytest.mark.parametrize("path", ["configs/{}.yaml", "configs/paper/{}-cifar10.yaml"])
@pytest.mark.parametrize("name", ["fedmd", "fedct", "comet"])
def test_shipped_configs_load(name, path):
    cfg = load_config(path.format(name))
    assert cfg.strategy.name == name and dataclasses.is_dataclass(resolve(cfg).params)
    assert len(set(cfg.model.per_client)) == 2  # heterogeneous clients
