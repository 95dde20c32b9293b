"""The robust options of the personalising strategies, their maths by hand (a wrong sign, reduction or reference
fails), their wiring into each strategy, the capture fault kinds, and the deployment's caps on what a node may
claim (the node registry and the default weight cap). The attacks end to end: tests/test_hostile_clients.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message

from fedapps.config import ConfigError, load_config
from fedapps.data import DataError
from fedapps.data.nodes import NodeRegistry, parse_registry, read_registry, record_node
from fedapps.flower import faults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.clustering import ClusteringResult, isolated
from fedapps.server.robust import AggregationRule, clip_to_median, median_bound, nodes_weight_cap, scale_update
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import ReplyValidator
from strategies import resolve
from strategies.fedmd import consensus_logits, robust_consensus, softmax
from strategies.ifca import CHOICE, clip_choosers
from strategies.pfedhn import HyperNetwork, accumulate_delta_gradient, client_gradient_norms, median_clip_scales

InProcessGrid(1)  # sets Flower's task identity, which Message() needs outside Flower's runtime

TINY = [
    "data.source=digits",
    "model.name=mlp",
    "data.num_clients=3",
    "data.public_fraction=0.2",
    "rounds=1",
    "client.epochs=1",
]


def build(strategy: str, *params: str, extra: tuple[str, ...] = ()):
    cfg = load_config(
        None, [f"strategy.name={strategy}", *TINY, *extra, *(f"strategy.params.{strategy}.{p}" for p in params)]
    )
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    return resolved.build(cfg)


def reply(node: int, client: int, arrays=None, predictions=None, metrics=None, n: int = 10) -> ClientReply:
    return ClientReply(
        node_id=node,
        client_id=client,
        num_examples=n,
        metrics=dict(metrics or {}),
        arrays=arrays,
        predictions=None if predictions is None else {protocol.PREDICTION_ARRAY: predictions},
        info={},
    )


# ----------------------------------------------------------------------- fedapps.server.robust: clipping to the median


def test_median_bound_is_factor_times_the_median():
    assert median_bound([1.0, 2.0, 3.0, 100.0], 2.0) == 5.0  # median 2.5 (a mean would give 53)
    assert median_bound([4.0], 0.5) == 2.0
    for bad in ([], [1.0, -1.0], [1.0, math.inf]):
        with pytest.raises(ValueError):
            median_bound(bad, 1.0)
    with pytest.raises(ValueError):
        median_bound([1.0], 0.0)


def test_clip_to_median_by_hand():
    ref = [{"w": np.array([1.0, 1.0], np.float32), "n": np.array(7)} for _ in range(3)]
    ups = [
        {"w": np.array([4.0, 5.0], np.float32), "n": np.array(9)},  # update (3, 4): norm 5
        {"w": np.array([1.0, 2.0], np.float32), "n": np.array(9)},  # (0, 1): norm 1
        {"w": np.array([1.0, 3.0], np.float32), "n": np.array(9)},
    ]  # (0, 2): norm 2
    out, bound, norms = clip_to_median(ups, ref, 1.0)
    assert norms == [5.0, 1.0, 2.0] and bound == 2.0
    # reference + (bound / norm)·update: (1, 1) + 0.4·(3, 4); a sign error (reference − ...) would give (-0.2, -0.6)
    np.testing.assert_allclose(out[0]["w"], [2.2, 2.6], rtol=1e-6)
    assert out[0]["w"].dtype == np.float32 and int(out[0]["n"]) == 9  # integer arrays are not scaled
    np.testing.assert_array_equal(out[1]["w"], ups[1]["w"])
    np.testing.assert_array_equal(out[2]["w"], ups[2]["w"])  # exactly at the bound: unchanged
    assert scale_update(ups[1], ref[1], 0.0)["w"].tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------- cwFedAvg's median_clip


def test_cwfedavg_median_clip_clips_against_the_model_each_client_was_sent_before_anything_reads_it():
    s = build("cwfedavg", "median_clip=2")
    key = s.head_w
    replies, deltas, sent = [], [1.0, 1.5, 30.0], []
    for i, d in enumerate(deltas):
        # each client was sent its own model (here: the initial one shifted by 0.1·(i+1) everywhere)
        sent.append({k: (v + 0.1 * (i + 1)).astype(v.dtype) for k, v in s.personalised(None).items()})
        arrays = {k: np.array(v, copy=True) for k, v in sent[i].items()}
        arrays[key][0, 0] += d  # an update of norm d, on one coordinate of the classifier, against what it was sent
        replies.append(reply(100 + i, i, arrays))
        s.sent_models[100 + i] = sent[i]
    extra = s.aggregate(1, replies)
    assert extra["clip_bound"] == pytest.approx(3.0) and extra["clipped"] == 1  # 2 × median(1, 1.5, 30)
    stored = s.stack.get(2, key)
    np.testing.assert_allclose(stored[0, 0], sent[2][key][0, 0] + 3.0, rtol=1e-5)  # 30 scaled to the bound
    np.testing.assert_allclose(stored[1:], sent[2][key][1:], rtol=1e-6)  # the rest is what it was sent
    assert s.stack.get(0, key)[0, 0] == pytest.approx(sent[0][key][0, 0] + 1.0, rel=1e-5)
    from strategies.cwfedavg import row_norm_distribution

    # the class estimate is read off the clipped upload, not the one sent
    np.testing.assert_allclose(s.p_hat[s.stack.row_of[2]], row_norm_distribution(stored))


def test_cwfedavg_median_clip_off_keeps_the_upload():
    s = build("cwfedavg")
    sent = s.personalised(None)
    arrays = {k: np.array(v, copy=True) for k, v in sent.items()}
    arrays[s.head_w][0, 0] += 30.0
    s.aggregate(1, [reply(100, 0, arrays)])
    assert s.sent_models == {} and s.stack.get(0, s.head_w)[0, 0] == pytest.approx(sent[s.head_w][0, 0] + 30.0)


# --------------------------------------------------------------------------- IFCA's median_clip


def test_ifca_clips_each_update_against_the_cluster_model_it_chose():
    models = [{"w": np.zeros(2, np.float32)}, {"w": np.full(2, 10.0, np.float32)}]
    replies = [
        reply(100, 0, {"w": np.array([1.0, 0.0], np.float32)}, metrics={CHOICE: 0}),  # norm 1 against model 0
        reply(101, 1, {"w": np.array([12.0, 10.0], np.float32)}, metrics={CHOICE: 1}),  # norm 2 against model 1
        reply(102, 2, {"w": np.array([0.0, 20.0], np.float32)}, metrics={CHOICE: 0}),
    ]  # norm 20 against model 0
    out, extra = clip_choosers(models, replies, 2.0)
    assert extra == {"clip_bound": 4.0, "clipped": 1}
    np.testing.assert_allclose(out[2].arrays["w"], [0.0, 4.0])  # 0 + (4/20)·(0, 20); against model 1 it would differ
    np.testing.assert_array_equal(out[1].arrays["w"], replies[1].arrays["w"])
    assert out[2].metrics[CHOICE] == 0 and out[2].client_id == 2


# --------------------------------------------------------------------------- pFedHN's median_clip

TOY = {"w": (2, 3), "b": (2,)}


def toy_hn() -> HyperNetwork:
    torch.manual_seed(0)
    return HyperNetwork(3, TOY, embed_dim=2, hidden_dim=3, hidden_layers=1).double()


def grad_vector(hn: HyperNetwork) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in hn.parameters()])


def test_median_clip_scales_by_hand():
    assert median_clip_scales([1.0, 2.0, 10.0], 2.0) == [1.0, 1.0, 0.4]  # bound 2 × 2 = 4


def test_scaled_delta_gradient_is_the_scaled_gradient_and_norms_are_each_clients_own():
    hn = toy_hn()
    trained = [{k: torch.randn(*shape, dtype=torch.float64) for k, shape in TOY.items()} for _ in range(2)]
    norms = client_gradient_norms(hn, [0, 1], trained)
    assert all(p.grad is None for p in hn.parameters())  # measuring leaves no gradient behind
    singles = []
    for i in range(2):
        hn.zero_grad(set_to_none=True)
        accumulate_delta_gradient(hn, [i], [trained[i]])
        singles.append(grad_vector(hn).clone())
    assert norms == pytest.approx([float(g.norm()) for g in singles])
    hn.zero_grad(set_to_none=True)
    accumulate_delta_gradient(hn, [0, 1], trained, scales=[0.25, 1.0])
    torch.testing.assert_close(grad_vector(hn), 0.25 * singles[0] + singles[1])


def test_pfedhn_median_clip_steps_as_if_the_long_update_had_been_scaled_by_hand():
    def run(median_clip: float, scale_last: float):
        s = build("pfedhn", f"median_clip={median_clip}", "hidden_dim=8", "hidden_layers=1")
        s.sent_from = {100: 0, 101: 1, 102: 2}
        replies = []
        for i in range(3):
            theta = s.generated(i)
            torch.manual_seed(10 + i)
            trained = {k: (v + 0.01 * torch.randn(v.shape).numpy()).astype(np.float32) for k, v in theta.items()}
            if i == 2:  # the hostile one: its whole model scaled up
                trained = {k: (v * 100.0).astype(np.float32) for k, v in trained.items()}
                trained = {k: theta[k] + scale_last * (trained[k] - theta[k]) for k in theta}
            replies.append(reply(100 + i, i, trained))
        return s, replies

    clipped, replies = run(2.0, 1.0)
    sent = [clipped.generated(i) for i in range(3)]
    norms = client_gradient_norms(clipped.hn, [0, 1, 2], [clipped.trained(r) for r in replies])
    by_hand = median_clip_scales(norms, 2.0)
    assert by_hand[:2] == [1.0, 1.0] and by_hand[2] < 0.1
    extra = clipped.aggregate(1, replies)
    assert extra["clipped"] == 1
    plain, replies_by_hand = run(0.0, by_hand[2])  # Δθ of the last reply scaled by hand, no option
    for a, b in zip(sent, [plain.generated(i) for i in range(3)]):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6)  # the same h before the step
    plain.aggregate(1, replies_by_hand)
    for (name, p), q in zip(clipped.hn.named_parameters(), plain.hn.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- COSMOS's member_clip


def test_clip_to_centre_by_hand():
    centre = np.array([[0.5, 0.5], [0.9, 0.1]])
    stack = np.array(
        [
            [[1.0, 0.0], [0.9, 0.1]],  # row 0: L1 1.0 from the centre -> 0.5 of the way
            [[0.6, 0.4], [0.0, 1.0]],
        ]
    )  # row 1: L1 1.8 -> scaled by 0.5/1.8
    out = pseudolabels.clip_to_centre(stack, centre, 0.5)
    np.testing.assert_allclose(out[0, 0], [0.75, 0.25])
    np.testing.assert_allclose(out[0, 1], [0.9, 0.1])  # on the centre: unchanged
    np.testing.assert_allclose(out[1, 0], [0.6, 0.4])  # L1 0.2 <= 0.5: unchanged
    np.testing.assert_allclose(out[1, 1], [0.9 - 0.25, 0.1 + 0.25], rtol=1e-6)
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)  # still probability rows
    assert np.abs(out - centre[None]).sum(-1).max() <= 0.5 + 1e-6


@pytest.mark.parametrize("with_previous", [True, False])
def test_cosmos_member_clip_centres_on_the_cluster_models_last_targets(monkeypatch, with_previous):
    import strategies.cosmos as cosmos

    s = build("cosmos", "member_clip=0.5", "server_model=mlp", "server_epochs=1", extra=("data.num_clients=3",))
    n, m = s.n_public, s.num_classes
    rng = np.random.default_rng(0)
    preds = {c: rng.dirichlet(np.ones(m), size=n).astype(np.float32) for c in (0, 1, 2)}
    s.clustering = ClusteringResult([[0, 1, 2]], 0.1, "fixed", "l1")
    previous = rng.dirichlet(np.ones(m), size=n).astype(np.float32)
    if with_previous:
        s.server_targets[0] = previous
    seen = []
    monkeypatch.setattr(cosmos, "server_target", lambda stack, agg, t: seen.append(stack) or stack.mean(axis=0))
    s.train_cluster_models(2, preds)
    members = np.stack([preds[c] for c in (0, 1, 2)])
    centre = previous if with_previous else pseudolabels.aggregate(members, "median")
    np.testing.assert_allclose(seen[0], pseudolabels.clip_to_centre(members, centre, 0.5), rtol=1e-6)
    assert np.abs(seen[0] - centre[None]).sum(-1).max() <= 0.5 + 1e-5


# --------------------------------------------------------------------------- FedMD's consensus on probabilities


def test_robust_consensus_by_hand():
    honest = np.log(np.array([0.25, 0.75]))  # logits whose softmax is (0.25, 0.75)
    scores = np.array([[[1e4, -1e4]], [honest], [honest], [honest]], dtype=np.float32)  # clients × 1 row × 2 classes
    assert scores.astype(np.float64).mean(axis=0).argmax() == 0  # the raw mean: the hostile client's class
    probs = robust_consensus(scores, "logits", "probs")
    np.testing.assert_allclose(probs, [[(1 + 3 * 0.25) / 4, 3 * 0.75 / 4]], rtol=1e-6)  # (0.4375, 0.5625)
    median = robust_consensus(scores, "logits", "median")
    np.testing.assert_allclose(median, [[0.25, 0.75]], rtol=1e-6)
    as_sent = robust_consensus(softmax(scores), "probs", "probs")  # probabilities are averaged as they come
    np.testing.assert_allclose(as_sent, probs, rtol=1e-6)


def test_consensus_logits_softmax_back_to_the_consensus():
    p = np.array([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]], dtype=np.float32)
    logits = consensus_logits(p)
    assert logits[0, 2] == pytest.approx(math.log(1e-6), rel=1e-5)  # the floor
    np.testing.assert_allclose(softmax(logits), p, atol=1e-5)


def test_fedmd_robust_consensus_is_what_the_next_messages_carry():
    s = build("fedmd", "consensus=probs", extra=("strategy.params.fedmd.distill_epochs=1",))
    n, m = s.public_size, s.num_classes
    rng = np.random.default_rng(1)
    logits = [rng.normal(size=(n, m)).astype(np.float32) for _ in range(2)]
    hostile = np.full((n, m), -1e4, np.float32)
    hostile[:, 0] = 1e4
    s.aggregate(
        1,
        [
            reply(100, 0, predictions=logits[0]),
            reply(101, 1, predictions=logits[1]),
            reply(102, 2, predictions=hostile),
        ],
    )
    want = (softmax(logits[0]) + softmax(logits[1]) + softmax(hostile)) / 3
    np.testing.assert_allclose(s.consensus, want, rtol=1e-5)
    assert (s.consensus.argmax(1) != 0).any()
    msg = protocol.build_messages(s.round_messages(2, [100]))[0]  # digest mae (the default): the log of the consensus
    np.testing.assert_allclose(
        protocol.Targets.decode(msg.content[protocol.TARGETS]).values, consensus_logits(want), rtol=1e-5
    )


# --------------------------------------------------------------------------- COMET's outlier guard


def test_isolated_by_hand():
    points = np.array([0.0, 1.0, 2.0, 10.0])
    dist = np.abs(points[:, None] - points[None, :])  # nearest: 1, 1, 1, 8; median 1
    assert isolated(dist, 3.0).tolist() == [False, False, False, True]
    assert isolated(dist, 8.0).tolist() == [False] * 4  # 8 is not above 8 × 1
    assert isolated(dist[:2, :2], 0.1).tolist() == [False, False]  # two clients: nobody


def test_comet_sets_an_outlier_aside_and_records_it():
    s = build("comet", "outlier_factor=3", "clusters=2", extra=("data.num_clients=4",))
    n, m = s.public_size, s.num_classes
    rng = np.random.default_rng(2)
    base = rng.dirichlet(np.ones(m), size=n)
    honest = [((base + 0.05 * rng.dirichlet(np.ones(m), size=n)) / 1.05).astype(np.float32) for _ in range(3)]
    hostile = np.zeros((n, m), np.float32)
    hostile[:, 0] = 1.0
    extra = s.aggregate(
        1, [reply(100 + i, i, predictions=p) for i, p in enumerate(honest)] + [reply(103, 3, predictions=hostile)]
    )
    assert extra["set_aside"] == 1 and sorted(s.assignment) == [0, 1, 2]
    assert [x.client_id for x in s.replies.tally.skips] == [3] and "outlier_factor" in s.replies.tally.skips[0].reason
    assert (
        protocol.build_messages(s.round_messages(2, [103]))[0].content.get(protocol.TARGETS) is None
    )  # no targets for it next round


# --------------------------------------------------------------------------- the capture fault kinds


def test_scaled_and_one_hot_rows_by_hand():
    arrays = {
        "a.weight": np.ones((2, 3), np.float32),
        "a.bias": np.ones(2, np.float32),
        "out.weight": np.arange(6, dtype=np.float32).reshape(3, 2),
        "steps": np.array(4),
    }
    scaled = faults.scaled(arrays, 10.0)
    assert scaled["a.weight"].dtype == np.float32 and scaled["a.weight"].max() == 10.0 and int(scaled["steps"]) == 4
    rows = faults.one_hot_rows(arrays, 1)
    np.testing.assert_array_equal(rows["out.weight"], [[0, 0], [200, 300], [0, 0]])  # the last 2-D array, row 1 ×100
    assert rows["a.weight"] is arrays["a.weight"]


def test_votes_in_every_wire_type():
    labels = np.array([2, 0])
    logits = faults.votes(labels, np.zeros((2, 3), np.float32), "logits", 3)
    np.testing.assert_array_equal(logits, [[-1e4, -1e4, 1e4], [1e4, -1e4, -1e4]])
    probs = faults.votes(labels, np.zeros((2, 3), np.float16), "probs", 3)
    assert probs.dtype == np.float16 and probs.tolist() == [[0, 0, 1], [1, 0, 0]]
    hard = faults.votes(labels, np.zeros(2, np.uint8), "probs", 3)
    assert hard.dtype == np.uint8 and hard.tolist() == [2, 0]


def _message(targets: np.ndarray | None = None) -> Message:
    request = protocol.Request(ops=("predict",), round=2, public=protocol.PublicSet(output="probs"))
    return protocol.Draft(100, request, targets=protocol.Targets(targets).encode()).message()


def _reply_to(msg: Message, predictions: np.ndarray) -> Message:
    return Message(protocol.Reply(4, 5, predictions=predictions).encode(), reply_to=msg)


def test_pred_flip_votes_one_class_after_the_targets_the_message_brought():
    own = np.array([[0.9, 0.1, 0.0], [0.1, 0.8, 0.1]], np.float32)
    msg = _message(np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], np.float32))  # targets: classes 2, 1
    r = _reply_to(msg, own)
    faults.capture(r, faults.Fault("pred-flip", None, None, None), 4, msg)
    assert r.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy().argmax(1).tolist() == [0, 2]
    r = _reply_to(_message(), own)  # no targets: one after its own argmax (0, 1)
    faults.capture(r, faults.Fault("pred-flip", None, None, None), 4, _message())
    assert r.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy().argmax(1).tolist() == [1, 2]


def test_pred_copy_takes_the_leaked_predictions_of_the_same_round(monkeypatch):
    faults.clear_board()
    victim = np.array([[0.2, 0.8]], np.float32)
    msg = _message()
    faults.capture(_reply_to(msg, victim), faults.Fault("leak", None, None, None), 0, msg)
    r = _reply_to(msg, np.array([[1.0, 0.0]], np.float32))
    faults.capture(r, faults.Fault("pred-copy", "0", None, None), 4, msg)
    np.testing.assert_array_equal(r.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy(), victim)
    monkeypatch.setattr(faults, "COPY_WAIT", 0.05)  # consumed: a second copy finds nothing and leaves the reply
    r = _reply_to(msg, np.array([[1.0, 0.0]], np.float32))
    faults.capture(r, faults.Fault("pred-copy", "0", None, None), 4, msg)
    np.testing.assert_array_equal(r.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy(), [[1.0, 0.0]])


def test_capture_kinds_parse():
    parsed = faults.parse_faults("leak@0/1;pred-copy=0@4/1;pred-flip@4/2,3;scale=50@4;one-hot-rows=3@4")
    assert [f.kind for f in parsed] == ["leak", "pred-copy", "pred-flip", "scale", "one-hot-rows"]
    assert parsed[2].rounds == frozenset({2, 3}) and parsed[3].arg == "50"


# --------------------------------------------------------------------------- the node registry and the weight cap


def test_registry_parses_caps_and_names_the_line_of_a_bad_row():
    reg = parse_registry("client_id,max_num_examples,node\n0,100,site0\n2,5,\n*,7,\n", "nodes.csv", 3)
    assert reg.caps == {0: 100, 2: 5} and reg.default == 7
    assert reg.problem(0, 100) is None and "exceeds the 100" in reg.problem(0, 101)
    assert reg.problem(1, 7) is None and reg.problem(1, 8)  # the '*' row
    strict = parse_registry("client_id,max_num_examples\n0,100\n", "nodes.csv", 3)
    assert "not in the node registry" in strict.problem(1, 1)
    for text, fragment in [
        ("client,max\n0,1\n", "header must name"),
        ("client_id,max_num_examples\n0,0\n", "line 2"),
        ("client_id,max_num_examples\n3,10\n", "[0, 3)"),
        ("client_id,max_num_examples\n1,10\n1,20\n", "listed twice"),
        ("client_id,max_num_examples\n1,ten\n", "positive integer"),
    ]:
        with pytest.raises(DataError, match=re.escape(fragment)):
            parse_registry(text, "nodes.csv", 3)


def test_registry_rows_are_recorded_and_replaced(tmp_path: Path):
    path = tmp_path / "keys" / "nodes.csv"
    record_node(path, 2, 500, "site2")
    record_node(path, 0, 50)
    record_node(path, 2, 600, "site2")
    assert path.read_text() == "client_id,max_num_examples,node\n0,50,\n2,600,site2\n"
    assert read_registry(str(path), 3).caps == {0: 50, 2: 600}
    from fedapps_tools.deploy import DeployError, record_cap

    with pytest.raises(DeployError, match="both"):
        record_cap(tmp_path, 1, None, "")
    assert record_cap(tmp_path, None, None, "") is None


def test_registry_caps_are_enforced_by_the_validator():
    reg = NodeRegistry("nodes.csv", {0: 100})
    v = ReplyValidator(2, registry=reg)
    msgs = [protocol.Draft(100 + i, protocol.Request(ops=(), round=1)) for i in range(2)]
    v.expect(msgs)

    def answer(draft: protocol.Draft, cid: int, n: int) -> Message:
        return Message(protocol.Reply(cid, n).encode(), reply_to=draft.message())

    out = v.validate_batch(1, [answer(msgs[0], 0, 10**15), answer(msgs[1], 1, 5)])
    assert not out.accepted and len(out.rejections) == 2
    assert "exceeds the 100" in out.rejections[0].reason and "not in the node registry" in out.rejections[1].reason
    assert v.bound_examples == {}  # nothing bound from a rejected claim
    v.expect(msgs)
    assert [r.client_id for r in v.validate_batch(2, [answer(msgs[0], 0, 100)]).accepted] == [0]


def test_registry_is_read_for_data_source_nodes_only(tmp_path: Path):
    path = tmp_path / "nodes.csv"
    path.write_text("client_id,max_num_examples\n0,10\n")
    from fedapps.wire.validation import registry_of

    nodes = load_config(None, ["data.source=nodes", "data.num_clients=2", f"data.node_registry={path}"])
    assert registry_of(nodes.data).caps == {0: 10}
    assert registry_of(load_config(None, ["data.source=nodes"]).data) is None
    with pytest.raises(DataError, match="applies to data.source 'nodes' only"):
        resolve(load_config(None, ["data.source=digits", f"data.node_registry={path}"]))
    missing = load_config(None, ["data.source=nodes", "data.node_registry=nowhere.csv"])
    with pytest.raises(DataError, match="no such file on the server"):
        registry_of(missing.data)


def test_node_registry_never_travels_to_clients():
    spec = {"source": "nodes", "node_registry": "/srv/keys/nodes.csv", "public_path": "U.npz", "num_clients": 2}
    assert protocol.data_spec_for_clients(spec) == {"source": "nodes", "num_clients": 2}


def test_nodes_weight_cap_by_hand():
    assert [nodes_weight_cap(k) for k in (1, 2, 4, 5, 20)] == [0.5, 0.5, 0.5, 0.4, 0.1]


@pytest.mark.parametrize(
    "overrides,cap",
    [
        (["data.source=nodes", "data.num_clients=5"], 0.4),  # default on under nodes: min(0.5, 2/5)
        (["data.source=nodes", "data.num_clients=5", "strategy.max_weight_share=0.3"], 0.3),  # a lower one wins
        (["data.source=nodes", "data.num_clients=20", "strategy.fraction=0.5"], 0.2),  # cohort of 10: 2/10
        (["data.source=digits", "data.num_clients=5"], 1.0),  # simulation: unchanged
        (["data.source=nodes", "data.num_clients=5", "data.node_registry=x.csv"], 1.0),  # the registry vouches
    ],
)
def test_nodes_weight_cap_is_the_default_where_sizes_are_claims(overrides, cap):
    rule = AggregationRule.for_run(load_config(None, ["strategy.name=fedavg", *overrides]))
    assert rule.max_weight_share == pytest.approx(cap)


def test_nodes_weight_cap_leaves_median_alone():
    cfg = load_config(
        None, ["strategy.name=fedavg", "data.source=nodes", "data.num_clients=5", "strategy.aggregation=median"]
    )
    assert AggregationRule.for_run(cfg) == AggregationRule.from_config(cfg.strategy)


def test_robust_options_are_off_by_default_and_checked():
    for name, key, off in [
        ("cwfedavg", "median_clip", 0.0),
        ("ifca", "median_clip", 0.0),
        ("pfedhn", "median_clip", 0.0),
        ("cosmos", "member_clip", 0.0),
        ("fedmd", "consensus", "mean"),
        ("comet", "outlier_factor", 0.0),
    ]:
        params = resolve(load_config(None, [f"strategy.name={name}", "data.public_fraction=0.2"])).params
        assert getattr(params, key) == off, name
    with pytest.raises(ConfigError):
        resolve(
            load_config(
                None, ["strategy.name=cosmos", "data.public_fraction=0.2", "strategy.params.cosmos.member_clip=3"]
            )
        )
    with pytest.raises(ConfigError):
        resolve(
            load_config(
                None, ["strategy.name=fedmd", "data.public_fraction=0.2", "strategy.params.fedmd.consensus=max"]
            )
        )
