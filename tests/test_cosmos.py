"""COSMOS: clustering, aggregation/temperature, client weights, r_B, encodings, U's fingerprint, and the privacy
property end to end (in-process and through Flower's wire format): clients send pseudo-labels and
metrics only, never model parameters."""

from __future__ import annotations

import csv
import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import server_app
from conftest import run_in_process
from deployed_toy import evaluate
from fedapps.client import ops
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server import clustering
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.validation import parse_reply
from strategies import resolve
from strategies.cosmos import (
    RB_LAMBDA,
    RB_SIGMA,
    Cosmos,
    CosmosParams,
    adjusted_rand,
    centre_by_architecture,
    client_architecture,
    cluster_on,
    frequency_weights,
    inherited_clusters,
    rb_term,
    recluster_due,
    robustness_penalty,
    server_target,
    soft_predictions,
)

torch.set_num_threads(1)

N_CLIENTS = 4


# --------------------------------------------------------------------------- clustering


def block_matrix(sizes: list[int], within: float, between: float) -> np.ndarray:
    """Clients in consecutive blocks: `within` inside a block, `between` across blocks, 0 on the diagonal."""
    labels = np.repeat(np.arange(len(sizes)), sizes)
    d = np.where(labels[:, None] == labels[None, :], within, between).astype(float)
    np.fill_diagonal(d, 0.0)
    return d


def test_blocks_give_the_expected_clusters() -> None:
    d = block_matrix([3, 2, 4], within=0.2, between=1.0)
    assert clustering.greedy_threshold_clustering(d, 0.3) == [[5, 6, 7, 8], [0, 1, 2], [3, 4]]


def test_founder_is_the_client_with_most_neighbours_and_ties_go_to_the_lowest_id() -> None:
    # 0-1-2 a chain (1 has two neighbours); 3-4 a pair; 5 alone
    d = np.full((6, 6), 5.0)
    np.fill_diagonal(d, 0.0)
    for i, j in ((0, 1), (1, 2), (3, 4)):
        d[i, j] = d[j, i] = 1.0
    assert clustering.greedy_threshold_clustering(d, 1.0) == [[0, 1, 2], [3, 4], [5]]
    # a 4-cycle 0-1-2-3: all have two neighbours; 0 founds {0, 1, 3}, then 2 is alone
    d = np.full((4, 4), 5.0)
    np.fill_diagonal(d, 0.0)
    for i, j in ((0, 1), (1, 2), (2, 3), (3, 0)):
        d[i, j] = d[j, i] = 1.0
    assert clustering.greedy_threshold_clustering(d, 1.0) == [[0, 1, 3], [2]]
    # all tied at zero neighbours: singletons in id order
    assert clustering.greedy_threshold_clustering(d, 0.5) == [[0], [1], [2], [3]]


def test_removed_clients_no_longer_count_as_neighbours() -> None:
    # 2 has neighbours {0,1,3,4}? no: star 0-{1,2,3}, and 3-4, 4-5. Founder 0 takes 1,2,3; then 4 and 5 pair up.
    d = np.full((6, 6), 9.0)
    np.fill_diagonal(d, 0.0)
    for i, j in ((0, 1), (0, 2), (0, 3), (3, 4), (4, 5)):
        d[i, j] = d[j, i] = 1.0
    assert clustering.greedy_threshold_clustering(d, 1.0) == [[0, 1, 2, 3], [4, 5]]


def test_threshold_extremes() -> None:
    d = block_matrix([2, 3], 0.4, 1.2)
    assert clustering.greedy_threshold_clustering(d, 0.1) == [[i] for i in range(5)]  # singletons
    assert clustering.greedy_threshold_clustering(d, 2.0) == [[0, 1, 2, 3, 4]]
    assert clustering.assignment([[2, 3, 4], [0, 1]], 5).tolist() == [1, 1, 0, 0, 0]


def test_automatic_b0_is_the_first_step_reaching_the_target() -> None:
    d = block_matrix([5, 5, 5], within=0.22, between=1.1)
    b0, clusters, tried = clustering.auto_threshold(d, max_clusters=3, start=0.05, step=0.05)
    assert b0 == pytest.approx(0.25) and len(clusters) == 3
    assert [k for _, k in tried] == [15, 15, 15, 15, 3]
    res = clustering.cluster_clients(d, "auto", max_clusters=1, start=0.1, step=0.5)
    assert res.k == 1 and res.b0 == pytest.approx(1.1) and res.mode == "auto"
    fixed = clustering.cluster_clients(d, "fixed", b0=0.3)
    assert fixed.k == 3 and fixed.sizes == [5, 5, 5] and fixed.b0 == 0.3


def test_distances_match_brute_force_and_are_per_sample() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=(6, 50)).astype(np.float32)  # clients × samples × classes
    d1 = clustering.pairwise_distances(p, "l1")
    d2 = clustering.pairwise_distances(p, "l2")
    for i in range(6):
        for j in range(6):
            assert d1[i, j] == pytest.approx(np.abs(p[i] - p[j]).sum() / 50, abs=1e-5)
            assert d2[i, j] == pytest.approx(np.sqrt(((p[i] - p[j]) ** 2).sum() / 50), abs=1e-4)
    # disjoint one-hot predictions on every sample: ℓ1 = 2 per sample, whatever |U|
    a = np.tile(np.eye(3)[0], (1000, 1))[None]
    b = np.tile(np.eye(3)[1], (1000, 1))[None]
    assert clustering.pairwise_distances(np.concatenate([a, b]), "l1")[0, 1] == pytest.approx(2.0)
    assert clustering.pairwise_distances(np.concatenate([a, b]), "l2")[0, 1] == pytest.approx(np.sqrt(2))
    centres = np.concatenate([a, b])
    assert clustering.distance_to_centres(a[0], centres, "l1").tolist() == pytest.approx([0.0, 2.0])
    with pytest.raises(ValueError, match="allowed: l1, l2"):
        clustering.pairwise_distances(p, "cosine")


# --------------------------------------------------------------------------- clustering: edges (found by `make mutate`)


def graph(n: int, edges: list[tuple[int, int]], asymmetric: tuple[int, int] | None = None) -> np.ndarray:
    """A distance matrix: 0.1 on the given edges, 1 elsewhere (0 on the diagonal)."""
    d = np.ones((n, n))
    np.fill_diagonal(d, 0.0)
    for i, j in edges:
        d[i, j] = d[j, i] = 0.1
    if asymmetric is not None:
        d[asymmetric] = 0.1  # one direction only
    return d


def test_greedy_clustering_counts_only_the_remaining_neighbours() -> None:
    """After the first cluster, 7 has lost its neighbours 1 and 2: with one remaining neighbour each, 5 (lowest id)
    founds the second cluster, not 7 (which would if taken neighbours were still counted)."""
    d = graph(9, [(0, 1), (0, 2), (0, 3), (0, 4), (7, 1), (7, 2), (7, 8), (5, 6)])
    assert clustering.greedy_threshold_clustering(d, 0.5) == [[0, 1, 2, 3, 4], [5, 6], [7, 8]]
    # closeness in one direction is enough: the relation is made symmetric
    assert clustering.greedy_threshold_clustering(graph(3, [], asymmetric=(0, 2)), 0.5) == [[0, 2], [1]]
    for bad in (np.zeros(4), np.zeros((2, 3))):
        with pytest.raises(ValueError, match="square"):
            clustering.greedy_threshold_clustering(bad, 0.5)


def test_auto_threshold_defaults_and_refusals() -> None:
    d = graph(4, [(0, 1), (2, 3)])
    b0, clusters, tried = clustering.auto_threshold(d, 2)  # defaults: start 0.05, step 0.05
    assert (b0, clusters, tried) == (0.1, [[0, 1], [2, 3]], [(0.05, 4), (0.1, 2)])
    assert clustering.auto_threshold(d, 2, start=0.0, step=0.1)[0] == 0.1  # start 0 is allowed
    assert clustering.auto_threshold(np.zeros((0, 0)), 1)[1] == []  # no clients: nothing to cluster
    for bad in ({"max_clusters": 0}, {"max_clusters": 2, "step": 0.0}, {"max_clusters": 2, "start": -0.1}):
        with pytest.raises(ValueError):
            clustering.auto_threshold(d, **bad)


def test_distance_to_centres_both_metrics_by_hand() -> None:
    pred = np.array([[1.0, 0.0], [0.0, 1.0]])  # n = 2 samples × 2 classes
    centres = np.array([pred, [[0.0, 1.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])
    # Σ|·| / n (l1, the default); ‖·‖₂ / √n (l2)
    np.testing.assert_allclose(clustering.distance_to_centres(pred, centres), [0.0, 1.0, 1.0])
    np.testing.assert_allclose(clustering.distance_to_centres(pred, centres, "l2"), [0.0, 1.0, math.sqrt(0.5)])


# --------------------------------------------------------------------------- aggregation, temperature


def test_aggregation_and_temperature() -> None:
    stack = np.array([[[0.7, 0.2, 0.1]], [[0.1, 0.8, 0.1]], [[0.4, 0.4, 0.2]]], dtype=np.float32)
    assert pseudolabels.aggregate(stack, "mean")[0] == pytest.approx([0.4, 1.4 / 3, 0.4 / 3])
    med = pseudolabels.aggregate(stack, "median")[0]
    assert med == pytest.approx(np.array([0.4, 0.4, 0.1]) / 0.9)
    assert pseudolabels.aggregate(stack, "max")[0] == pytest.approx([0.1, 0.8, 0.1])  # most confident member
    p = np.array([[0.6, 0.3, 0.1]], dtype=np.float32)
    assert pseudolabels.apply_temperature(p, 0)[0].tolist() == [1.0, 0.0, 0.0]
    assert pseudolabels.apply_temperature(p, 1)[0] == pytest.approx(p[0])
    sharp = pseudolabels.apply_temperature(p, 0.5)[0]
    assert sharp == pytest.approx(np.array([0.36, 0.09, 0.01]) / 0.46)
    hard = server_target(stack, "mean", 0.0)
    assert hard.tolist() == [[1.0, 0.0, 0.0]] or hard.tolist() == [[0.0, 1.0, 0.0]]
    assert server_target(stack, "mean", 0.0)[0].sum() == 1.0


# found by `make mutate`
def test_temperature_row_by_row() -> None:
    p = np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    sharp = pseudolabels.apply_temperature(p, 0.5)  # p² renormalised, per row
    np.testing.assert_allclose(sharp, (p**2) / (p**2).sum(axis=1, keepdims=True), rtol=1e-6)
    assert sharp.dtype == np.float32
    np.testing.assert_array_equal(pseudolabels.apply_temperature(p, 0), [[0, 0, 1], [1, 0, 0]])
    assert pseudolabels.apply_temperature(p, 1) is p  # T = 1 leaves p as it is
    # tiny T on a row of tiny probabilities: stable (the row's own max is subtracted before exp), no warnings
    tiny = np.array([[1e-5, 2e-5, 0.0], [0.5, 0.5, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pseudolabels.apply_temperature(tiny, 0.01)
    np.testing.assert_allclose(out, [[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]], atol=1e-6)


# found by `make mutate`
def test_aggregations_per_sample() -> None:
    stack = np.array(
        [  # 3 members × 3 samples × 3 classes
            [[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.2, 0.8, 0.0]],
            [[0.0, 1.0, 0.0], [0.1, 0.1, 0.8], [0.3, 0.7, 0.0]],
            [[0.0, 0.0, 1.0], [0.5, 0.5, 0.0], [0.4, 0.6, 0.0]],
        ]
    )
    np.testing.assert_allclose(pseudolabels.aggregate(stack), stack.mean(axis=0))  # the default is the mean
    # median per class, renormalised per sample; sample 0: every median is 0 (no division by zero)
    np.testing.assert_allclose(
        pseudolabels.aggregate(stack, "median"), [[0, 0, 0], [5 / 9, 4 / 9, 0], [0.3, 0.7, 0]], atol=1e-12
    )
    # max: sample 0 — all members equally confident, the first wins; sample 1 — member 1 (0.8); 2 — member 0
    np.testing.assert_allclose(pseudolabels.aggregate(stack, "max"), [[1, 0, 0], [0.1, 0.1, 0.8], [0.2, 0.8, 0]])


# --------------------------------------------------------------------------- client weights and r_B


def test_label_free_weights_are_local_frequencies_of_the_server_label() -> None:
    counts = np.array([30, 10, 0, 60])
    w = frequency_weights(counts, np.array([0, 1, 2, 3, 3]))
    assert w.tolist() == pytest.approx([0.3, 0.1, 0.0, 0.6, 0.6])
    assert frequency_weights(counts, np.array([4])).tolist() == [0.0]  # abstain marker
    # weights are normalised per batch: scaling them changes nothing
    logits, t = torch.randn(5, 4), torch.softmax(torch.randn(5, 4), 1)
    assert ops.kl_to_targets(logits, t, w) == pytest.approx(float(ops.kl_to_targets(logits, t, 7 * w)))


def test_distill_weighting_on_the_client(tmp_path: Path) -> None:
    """The worker's label-free weight uses the argmax of the targets; the oracle uses U's true labels."""
    from fedapps.client.worker import Worker, distill_weights

    cfg_path = write_config(tmp_path, rounds=1)
    cfg = load_config(cfg_path)
    strategy = Cosmos(cfg)
    InProcessGrid(1)  # sets the task identity Message() needs outside Flower
    msg = protocol.Draft(100, dataclasses.replace(strategy.round_request(2), ops=("distill",))).message()
    ctx = Context(run_id=1, node_id=100, node_config={"partition-id": 1}, state=RecordDict(), run_config={})
    worker = Worker(msg, ctx)
    fed = worker.fed
    targets = pseudolabels.one_hot(fed.public_y.numpy()[::-1].copy(), fed.num_classes)
    lf = distill_weights(worker, "label-free", targets, None)
    counts = fed.train_counts[1] / fed.train_counts[1].sum()
    assert lf.numpy() == pytest.approx(counts[fed.public_y.numpy()[::-1]])
    oracle = distill_weights(worker, "oracle", targets, None)
    assert oracle.numpy() == pytest.approx(counts[fed.public_y.numpy()])
    assert distill_weights(worker, "none", targets, None) is None


def test_rb_has_a_gradient_through_the_clean_branch_and_is_weighted() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 5))
    x = torch.rand(8, 1, 4, 4) * 2 - 1
    logits = model(x)
    penalty = robustness_penalty(model, x, logits, sigma=0.5)
    assert penalty.requires_grad and penalty.item() > 0
    penalty.backward()
    assert model[1].weight.grad is not None and model[1].weight.grad.abs().sum() > 0
    # unweighted equals the plain MSE; zero weights silence it
    torch.manual_seed(1)
    a = robustness_penalty(model, x, model(x), 0.5)
    torch.manual_seed(1)
    with torch.no_grad():
        noisy = (x + 0.5 * torch.randn_like(x)).clamp(-1, 1)
        ref = torch.nn.functional.mse_loss(torch.softmax(model(x), -1), torch.softmax(model(noisy), -1))
    assert a.item() == pytest.approx(ref.item(), rel=1e-5)
    zero = robustness_penalty(model, x, model(x), 0.5, sample_weights=torch.zeros(8))
    assert zero.item() == 0.0

    # λ·r_B moves the parameters beyond what KL alone does (same seed, same data)
    def fit(lam: float) -> torch.Tensor:
        torch.manual_seed(2)
        m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 5))
        gen = torch.Generator().manual_seed(0)
        ops.distill(
            m,
            x,
            torch.softmax(torch.randn(8, 5), 1),
            ops.OptimSettings(epochs=2, batch_size=4, lr=0.1),
            ops.DistillSettings(),
            generator=gen,
            term=rb_term(lam, 0.3, gen),
        )
        return m[1].weight.detach().clone()

    assert rb_term(0.0, 0.3) is None  # λ = 0: no term at all
    assert not torch.allclose(fit(0.0), fit(50.0))


def test_rb_term_is_lambda_times_the_penalty_and_added_to_the_distillation_loss() -> None:
    """rb_term(λ, σ) = λ·r_B with the noise of its generator; ops.distill adds it to the KL of every minibatch: one
    full-batch SGD step equals the step on KL + λ·r_B computed by hand."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    x, targets = torch.rand(6, 4) * 2 - 1, torch.softmax(torch.randn(6, 3), 1)
    term = rb_term(2.5, 0.4, torch.Generator().manual_seed(9))
    by_hand = 2.5 * robustness_penalty(model, x, model(x), 0.4, generator=torch.Generator().manual_seed(9))
    assert term(model, x, model(x), None).item() == pytest.approx(by_hand.item(), rel=1e-6)
    # one SGD step of lr 0.1 on the whole batch, in the order distill shuffles it (the noise follows that order)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    logits = ref(x[perm])
    loss = ops.kl_to_targets(logits, targets[perm]) + 2.5 * robustness_penalty(
        ref, x[perm], logits, 0.4, generator=torch.Generator().manual_seed(9)
    )
    loss.backward()
    want = ref.weight.detach() - 0.1 * ref.weight.grad
    ops.distill(
        model,
        x,
        targets,
        ops.OptimSettings(epochs=1, batch_size=6, lr=0.1, optimizer="sgd"),
        ops.DistillSettings(),
        generator=torch.Generator().manual_seed(1),
        term=rb_term(2.5, 0.4, torch.Generator().manual_seed(9)),
    )
    assert torch.allclose(model.weight.detach(), want, atol=1e-6)
    kl_only = torch.nn.Linear(4, 3)
    kl_only.load_state_dict(ref.state_dict())
    ops.distill(
        kl_only,
        x,
        targets,
        ops.OptimSettings(epochs=1, batch_size=6, lr=0.1, optimizer="sgd"),
        ops.DistillSettings(),
        generator=torch.Generator().manual_seed(1),
    )
    assert not torch.allclose(kl_only.weight.detach(), want, atol=1e-4)  # without the term: another step


def test_rb_is_the_clients_registered_distillation_term() -> None:
    """The client switches r_B on through the message's distill.rb_lambda / rb_sigma (registered by this module,
    not the core): λ = 0 or no setting gives no term; otherwise λ·r_B with the worker's generator."""
    from types import SimpleNamespace

    from fedapps.client.registry import DISTILL_TERMS

    build = DISTILL_TERMS["rb"]
    assert build.__module__ == Cosmos.__module__  # registered by strategies/cosmos.py, not by the core
    w = SimpleNamespace(generator=torch.Generator().manual_seed(5))
    assert build(w, protocol.Section()) is None and build(w, protocol.Section(extra={RB_LAMBDA: 0.0})) is None
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.rand(5, 4) * 2 - 1
    got = build(w, protocol.Section(extra={RB_LAMBDA: 3.0, RB_SIGMA: 0.2}))(model, x, model(x), None)
    want = 3.0 * robustness_penalty(model, x, model(x), 0.2, generator=torch.Generator().manual_seed(5))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_the_client_distils_with_r_b_when_the_message_asks(tmp_path: Path) -> None:
    """End to end on the worker: the same distill message sent with distill.rb_lambda 0, then 5, then 0 again. Both
    λ = 0 runs report the same distillation loss, the λ = 5 run another: r_B, registered by this module, reaches the
    client's loss (it is not silently lost)."""
    from fedapps.client.worker import Worker

    cfg = load_config(write_config(tmp_path, rounds=1))
    strategy = Cosmos(cfg)
    InProcessGrid(1)  # sets the task identity Message() needs outside Flower
    n, m = int(strategy.fed.public_x.shape[0]), strategy.fed.num_classes
    targets = protocol.Targets(np.full((n, m), 1.0 / m, np.float32)).encode()
    base = strategy.round_request(2)
    distill = base.training.section(protocol.DISTILL)
    losses = []
    for lam in (0.0, 5.0, 0.0):
        sections = {
            **base.training.sections,
            protocol.DISTILL: dataclasses.replace(distill, extra={**distill.extra, RB_LAMBDA: lam}),
        }
        request = dataclasses.replace(
            base,
            ops=("distill",),
            training=protocol.Training(sections=sections),
            setup=dataclasses.replace(base.setup, model=dataclasses.replace(base.setup.model, seed=0)),
        )
        msg = protocol.Draft(100, request, targets=targets).message()
        ctx = Context(run_id=1, node_id=100, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        reply = Worker(msg, ctx).run()
        assert not reply.has_error(), reply.error.reason
        losses.append(float(reply.content[protocol.METRICS]["distill-loss"]))
    assert losses[0] == losses[2]  # the same message twice: the same loss (nothing else differs between the runs)
    assert losses[1] != losses[0]


def test_robustness_penalty_is_seeded_and_weighted_per_sample() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.rand(5, 4) * 2 - 1
    logits = model(x)
    values = []
    for global_seed in (1, 2):  # the global RNG differs, the generator does not
        torch.manual_seed(global_seed)
        values.append(robustness_penalty(model, x, logits, 0.5, generator=torch.Generator().manual_seed(7)).item())
    assert values[0] == values[1]
    assert robustness_penalty(model, x, logits, 0.5, generator=torch.Generator().manual_seed(8)).item() != values[0]
    # weights [1, 0, 0, 0, 0]: exactly sample 0's mean squared difference
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    weighted = robustness_penalty(model, x, logits, 0.5, sample_weights=torch.tensor([1.0, 0, 0, 0, 0]), generator=g())
    noisy = (x + 0.5 * torch.randn(x.shape, generator=g())).clamp(-1, 1)
    first = ((torch.softmax(logits[0], -1) - torch.softmax(model(noisy[:1]), -1)[0]) ** 2).mean()
    assert weighted.item() == pytest.approx(first.item(), rel=1e-5)


# --------------------------------------------------------------------------- encodings


@pytest.mark.parametrize("classes,dtype", [(10, np.uint8), (255, np.uint8), (256, np.uint16)])
def test_hard_labels_use_the_smallest_integer_type(classes: int, dtype: type) -> None:
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(classes), size=40).astype(np.float32)
    wire = pseudolabels.encode(probs, "hard", classes)
    assert wire.dtype == dtype and wire.shape == (40,)
    assert pseudolabels.decode(wire, classes).tolist() == probs.argmax(1).tolist()
    soft = soft_predictions(wire, classes)
    assert soft.shape == (40, classes) and soft.argmax(1).tolist() == probs.argmax(1).tolist()
    assert np.array_equal(soft.sum(1), np.ones(40, np.float32))  # one-hot rows


def test_soft_encodings_round_trip() -> None:
    probs = np.random.default_rng(2).dirichlet(np.ones(10), size=30).astype(np.float32)
    f32 = pseudolabels.encode(probs, "float32", 10)
    f16 = pseudolabels.encode(probs, "float16", 10)
    assert f32.nbytes == 30 * 10 * 4 and f16.nbytes == 30 * 10 * 2
    assert np.array_equal(pseudolabels.decode(f32, 10), probs)
    assert np.abs(pseudolabels.decode(f16, 10) - probs).max() < 1e-3
    soft = soft_predictions(f16, 10)
    assert soft.dtype == np.float32 and np.array_equal(soft, f16.astype(np.float32))
    slightly_negative = f32.copy()
    slightly_negative[0, 0] = -5e-4  # within the validator's tolerance; COSMOS clips it to 0
    assert soft_predictions(slightly_negative, 10)[0, 0] == 0.0


def test_bad_params_are_config_errors(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match="aggregation"):
        resolve(load_config(path, "strategy.params.cosmos.aggregation=vote"))
    with pytest.raises(ConfigError, match="uplink_encoding"):
        resolve(load_config(path, "strategy.params.cosmos.uplink_encoding=int4"))
    with pytest.raises(ConfigError, match="unknown key"):
        resolve(load_config(path, "strategy.params.cosmos.kmeans=3"))


# found by `make mutate`
def test_pseudo_label_encodings_edges() -> None:
    assert pseudolabels.label_dtype(2**32) == np.uint64  # beyond uint32 (the marker M itself must fit)
    # hard labels as they are; 3 = abstain
    np.testing.assert_array_equal(pseudolabels.encode(np.array([2, 0, 3]), "hard", 3), [2, 0, 3])
    for bad in (np.array([-1, 0]), np.array([4, 0])):
        with pytest.raises(ValueError):
            pseudolabels.encode(bad, "hard", 3)
    for bad in (np.zeros(3, np.float32), np.zeros((2, 4), np.float32)):
        with pytest.raises(ValueError):
            pseudolabels.encode(bad, "float32", 3)
    assert pseudolabels.decode(np.zeros((2, 3), np.float16), 3).dtype == np.float32
    labels = pseudolabels.one_hot(np.array([1, 3, 0]), 3)
    assert labels.dtype == np.float32
    np.testing.assert_array_equal(labels, [[0, 1, 0], [0, 0, 0], [1, 0, 0]])


# --------------------------------------------------------------------------- end to end (in-process)


def write_config(tmp_path: Path, rounds: int = 2, **params) -> str:
    """A tiny COSMOS run: scikit-learn digits, 4 clients in 2 groups, mlp/cnn clients, mlp server."""
    cfg = {
        "seed": 0,
        "rounds": rounds,
        "output_dir": str(tmp_path / "results"),
        "strategy": {
            "name": "cosmos",
            "min_clients": N_CLIENTS,
            "params": {
                "cosmos": {
                    "server_model": "mlp",
                    "pretrain_epochs": 2,
                    "server_epochs": 1,
                    "distill_epochs": 1,
                    "server_lr": 1e-3,
                    "distill_lr": 1e-3,
                    "max_clusters": 2,
                    **params,
                }
            },
        },
        "data": {
            "source": "digits",
            "partition": "cosmos-groups",
            "num_clients": N_CLIENTS,
            "groups": 2,
            "alpha": 5.0,
            "public_fraction": 0.2,
            "seed": 1,
        },
        "model": {"name": "mlp", "per_client": ["mlp", "cnn"]},
        "client": {"epochs": 1, "batch_size": 32, "lr": 1e-3, "optimizer": "adam", "drop_last": False, "device": "cpu"},
    }
    path = tmp_path / "cosmos-tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# the profile record: the reply's time per phase (timings only, no data)
ALLOWED_REPLY_RECORDS = {protocol.METRICS, protocol.INFO, protocol.PREDICTIONS, protocol.PROFILE}


def assert_pseudo_labels_and_metrics_only(replies: list[Message], n_public: int, num_classes: int) -> int:
    """Every client→server message holds metrics, a two-string info record and (round replies) predictions on U."""
    seen_predictions = 0
    for msg in replies:
        assert not msg.has_error(), msg.error.reason
        content = msg.content
        assert set(content.keys()) <= ALLOWED_REPLY_RECORDS, set(content.keys())
        assert protocol.ARRAYS not in content
        for name, record in content.items():
            if name == protocol.PREDICTIONS:
                assert isinstance(record, ArrayRecord) and list(record.keys()) == [protocol.PREDICTION_ARRAY]
                arr = record[protocol.PREDICTION_ARRAY].numpy()
                assert arr.shape in ((n_public, num_classes), (n_public,)), arr.shape  # one row per sample of U
                seen_predictions += 1
            elif name in (protocol.METRICS, protocol.PROFILE):  # the profile: seconds per phase, numbers only
                assert isinstance(record, MetricRecord)
                if name == protocol.PROFILE:
                    assert all(k.endswith("-seconds") for k in record.keys())
            else:
                assert isinstance(record, ConfigRecord)
                assert set(record.keys()) == {protocol.INFO_ARCH, protocol.INFO_FINGERPRINT}
    return seen_predictions


@pytest.mark.parametrize("up,down", [("float32", "float32"), ("hard", "float16")])
@pytest.mark.heavy
def test_end_to_end_in_process_sends_pseudo_labels_only(tmp_path: Path, up: str, down: str) -> None:
    path = write_config(tmp_path, rounds=2, uplink_encoding=up, downlink_encoding=down)
    grid = InProcessGrid(N_CLIENTS, record=True)
    summary = server_app.run_experiment(grid, path, "", str(tmp_path / "results"))
    cfg = load_config(path)
    strategy_fed = Cosmos(cfg).fed
    n, m = int(strategy_fed.public_x.shape[0]), strategy_fed.num_classes
    # exactly one round message per client per round, plus the evaluation-only message after the last round;
    # h_π(i) goes down for evaluation only (round 2's messages carry round 1's, the final message round 2's)
    train_msgs = [s for s in grid.sent if s.metadata.message_type == protocol.MESSAGE_TYPE]
    eval_msgs = [s for s in grid.sent if s.metadata.message_type == protocol.EVAL_MESSAGE_TYPE]
    assert len(train_msgs) == 2 * N_CLIENTS and len(eval_msgs) == N_CLIENTS
    assert all(protocol.ARRAYS not in s.content for s in grid.sent)  # nothing but pseudo-labels goes down either
    assert [protocol.EVAL_ARRAYS in s.content for s in train_msgs] == [False] * N_CLIENTS + [True] * N_CLIENTS
    assert all(protocol.EVAL_ARRAYS in s.content and protocol.TARGETS not in s.content for s in eval_msgs)
    assert all(protocol.request_of(s).ops == ("evaluate-received:deployed",) for s in eval_msgs)
    assert sum(protocol.TARGETS in s.content for s in train_msgs) == N_CLIENTS  # round 2 only
    wire_down = [
        protocol.Targets.decode(s.content[protocol.TARGETS]).values for s in train_msgs if protocol.TARGETS in s.content
    ]
    assert all(w.dtype == np.dtype(down) and w.shape == (n, m) for w in wire_down)
    assert assert_pseudo_labels_and_metrics_only(grid.replies, n, m) == 2 * N_CLIENTS
    ups = [
        r.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy()
        for r in grid.replies
        if protocol.PREDICTIONS in r.content
    ]
    assert all(u.dtype == (np.uint8 if up == "hard" else np.float32) for u in ups)
    # summary and per-round bytes
    assert summary["clusters"] >= 1 and sum(summary["cluster_sizes"]) == N_CLIENTS
    assert 0.0 <= summary["cluster_model_accuracy"] <= 1.0 and 0.0 <= summary["client_model_accuracy"] <= 1.0
    run_dir = tmp_path / "results" / cfg.resolved_run_name()
    rows = list(csv.DictReader((run_dir / "rounds.csv").open()))
    round_replies = [r for r in grid.replies if protocol.PREDICTIONS in r.content]
    for rnd, row in enumerate(rows, start=1):
        sent = [s for s in train_msgs if s.metadata.group_id == str(rnd)]
        got = round_replies[(rnd - 1) * N_CLIENTS : rnd * N_CLIENTS]
        evaluation = sum(protocol.eval_nbytes(s.content) for s in sent)  # h_π(i) riding along, counted apart
        assert int(row["bytes_down"]) == sum(protocol.record_nbytes(s.content) for s in sent) - evaluation
        assert int(row["bytes_up"]) == sum(protocol.record_nbytes(r.content) for r in got)
        assert int(row["pseudo_bytes_up"]) == N_CLIENTS * n * (1 if up == "hard" else 4 * m)
        final = sum(protocol.record_nbytes(s.content) for s in eval_msgs) if rnd == 2 else 0
        assert int(row["eval_bytes_down"]) == evaluation + final and (evaluation > 0) == (rnd == 2)
    assert int(rows[1]["pseudo_bytes_down"]) == N_CLIENTS * n * m * (2 if down == "float16" else 4)
    assert (run_dir / "clusters.png").is_file() and (run_dir / "clusters.json").is_file()


def test_public_set_mismatch_is_refused_on_both_ends(tmp_path: Path) -> None:
    path = write_config(tmp_path, rounds=1)
    cfg = load_config(path)
    strategy = Cosmos(cfg)
    # client end: a message naming another U is answered with an error that says so
    grid = InProcessGrid(1)
    base = strategy.round_request(1)
    request = dataclasses.replace(
        base, ops=("train", "predict"), public=dataclasses.replace(base.public, fingerprint="0123456789abcdef")
    )
    [reply] = grid.send_and_receive([protocol.Draft(100, request).message()])
    assert reply.has_error() and "public set mismatch" in reply.error.reason
    with pytest.raises(protocol.ReplyError, match="public set mismatch"):
        parse_reply(reply, expect_predictions=True)
    # server end: predictions computed on another U are rejected by the reply validator (the one check of a reply)
    n, m = int(strategy.fed.public_x.shape[0]), strategy.fed.num_classes
    [a, b] = strategy.round_messages(1, [100, 101])
    strategy.replies.validator.expect([a, b])
    preds = np.full((n, m), 1.0 / m, dtype=np.float32)
    tags = strategy.replies.validator.expected[protocol.MESSAGE_TYPE][100].eval_tags  # evaluations the message asks for
    metrics = {f"{t}-{f}": v for t in tags for f, v in (("acc", 0.5), ("loss", 1.0), ("n", 2), ("correct", 1))}

    def reply(to: Message, cid: int, fingerprint: str) -> Message:
        content = protocol.Reply(
            cid, 10, dict(metrics), predictions=preds, info=protocol.ReplyInfo(fingerprint=fingerprint)
        ).encode()
        return Message(content, reply_to=to)

    a, b = protocol.build_messages([a, b])
    out = strategy.replies.validator.validate_batch(
        1, [reply(a, 0, strategy.fed.fingerprint), reply(b, 1, "ffffffffffffffff")]
    )
    assert [r.client_id for r in out.accepted] == [0]
    assert [r.node_id for r in out.rejections] == [101] and "public set mismatch" in out.rejections[0].reason
    assert list(strategy.accept(out.accepted)) == [0]


# regression: exit 0 with wrong or empty results
@pytest.mark.heavy
def test_cosmos_vgg16_cluster_model_is_evaluated(tiny_config, tmp_path):
    """The paper's VGG16 (BatchNorm) server model travels to the clients for evaluation: its accuracy is a number."""
    data = {
        "source": "synthetic",
        "partition": "iid",
        "num_clients": 2,
        "synthetic_samples": 100,
        "synthetic_classes": 4,
        "synthetic_shape": [3, 8, 8],
        "public_fraction": 0.2,
    }  # 8×8: see test_transport.py
    params = {"server_model": "vgg16", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}
    cfg = tiny_config(
        rounds=1,
        strategy={"name": "cosmos", "params": {"cosmos": params}},
        data=data,
        model={"name": "cnn"},
        client={"epochs": 1, "batch_size": 16, "lr": 0.001, "optimizer": "adam"},
    )
    grid = InProcessGrid(2, record=True)
    summary, _ = run_in_process(cfg, tmp_path / "out", grid)
    assert all(not m.has_error() for m in grid.replies)
    assert isinstance(summary["cluster_model_accuracy"], float)
    assert isinstance(summary["accuracy_mean"], float)


# --------------------------------------------------------------------------- through Flower's wire format


def test_privacy_through_flowers_wire_format(tmp_path: Path) -> None:
    """The same property for what reaches the server through Flower's protobuf encoding, as under `flwr run`: every
    message, reply and node Context makes the trip (``InProcessGrid(wire=True)``, Flower-sized node ids), and what
    the replies hold after it is checked. (A reply's content is the ClientApp's alone: the engine moves it.)"""
    path = write_config(tmp_path, rounds=2)
    grid = InProcessGrid(N_CLIENTS, record=True, wire=True, first_node_id=2**63 + 7)
    summary = server_app.run_experiment(grid, path, "", str(tmp_path / "results"))
    fed = Cosmos(load_config(path)).fed
    n, m = int(fed.public_x.shape[0]), fed.num_classes
    assert assert_pseudo_labels_and_metrics_only(grid.replies, n, m) == 2 * N_CLIENTS
    assert len(grid.replies) == 4 * N_CLIENTS  # identify, 2 rounds' replies, the evaluation-only replies after the last
    assert summary["clusters"] >= 1


# --------------------------------------------------------------------------- our options: re-clustering, architectures


def test_recluster_due_every_k_rounds_after_round_one_and_never_when_off() -> None:
    rounds = range(1, 11)
    assert [r for r in rounds if recluster_due(r, 0)] == []  # off: the paper's fixed clusters
    assert [r for r in rounds if recluster_due(r, 1)] == list(range(2, 11))  # every round after round 1
    assert [r for r in rounds if recluster_due(r, 3)] == [4, 7, 10]  # rounds 1+k, 1+2k, ...


def test_centring_removes_each_architectures_mean_over_its_clients() -> None:
    # 4 clients × 2 public samples × 2 classes; architectures a, b, a, b
    stack = np.array(
        [
            [[0.9, 0.1], [0.8, 0.2]],  # a
            [[0.7, 0.3], [0.6, 0.4]],  # b
            [[0.7, 0.3], [0.4, 0.6]],  # a
            [[0.5, 0.5], [0.2, 0.8]],  # b
        ]
    )
    # by hand: mean of a = [[0.8, 0.2], [0.6, 0.4]], mean of b = [[0.6, 0.4], [0.4, 0.6]]
    expected = np.array(
        [
            [[0.1, -0.1], [0.2, -0.2]],
            [[0.1, -0.1], [0.2, -0.2]],
            [[-0.1, 0.1], [-0.2, 0.2]],
            [[-0.1, 0.1], [-0.2, 0.2]],
        ]
    )
    out = centre_by_architecture(stack, ["a", "b", "a", "b"])
    np.testing.assert_allclose(out, expected, atol=1e-6)
    # one architecture for all: the overall mean (the distances between clients then do not change)
    np.testing.assert_allclose(centre_by_architecture(stack, ["a"] * 4), stack - stack.mean(axis=0), atol=1e-6)
    with pytest.raises(ValueError, match="3 architectures for 4 clients"):
        centre_by_architecture(stack, ["a", "b", "a"])


# architecture a predicts class 0 at 0.9, b at 0.3; data group X adds +0.05 to class 0, group Y -0.05
ARCH_DATA_PREDS = {
    0: np.full((2, 2), [0.95, 0.05]),  # a, X
    1: np.full((2, 2), [0.35, 0.65]),  # b, X
    2: np.full((2, 2), [0.85, 0.15]),  # a, Y
    3: np.full((2, 2), [0.25, 0.75]),  # b, Y
}
ARCH_OF = {0: "a", 1: "b", 2: "a", 3: "b"}


def test_centring_lets_the_clustering_group_clients_by_data_across_architectures() -> None:
    preds, arch = ARCH_DATA_PREDS, ARCH_OF.__getitem__
    plain = CosmosParams(server_model="mlp", b0_mode="fixed", b0=0.3)
    raw, d_raw, _ = cluster_on(preds, plain)
    assert raw.clusters == [[0, 2], [1, 3]]  # raw distances (a-a 0.2, a-b ≥ 1.0): clusters by architecture
    assert d_raw[0, 2] == pytest.approx(0.2) and d_raw[0, 1] == pytest.approx(1.2)
    centred, d, _ = cluster_on(preds, dataclasses.replace(plain, architectures="centre", b0=0.1), arch)
    # residuals ±[0.05, -0.05]: same data -> distance 0, other data -> 0.2 per sample
    assert d[0, 1] == pytest.approx(0.0, abs=1e-6) and d[0, 2] == pytest.approx(0.2, abs=1e-6)
    assert centred.clusters == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="needs each client's architecture"):
        cluster_on(preds, dataclasses.replace(plain, architectures="centre"))


def test_clustering_within_architectures_first_then_matching_on_centred_means() -> None:
    preds, arch = ARCH_DATA_PREDS, ARCH_OF.__getitem__  # a near class 0, b near class 1; X +0.05, Y -0.05
    p = CosmosParams(server_model="mlp", b0_mode="fixed", b0=0.1, architectures="cluster-within")
    # within a: d(0, 2) = 0.2 > B0 -> {0}, {2}; within b: {1}, {3}; a anchors (2 clusters each, first name).
    # Matching on raw means would send b's {1} (0.35) to a's {2} (0.85: 1.0 away, {0} 1.2): the architecture's
    # offset. On centred means ({0}: +0.05, {2}: -0.05, {1}: +0.05, {3}: -0.05) {1} joins {0} and {3} joins {2}.
    result, d, ids = cluster_on(preds, p, arch)
    assert result.clusters == [[0, 1], [2, 3]]
    assert ids == [0, 1, 2, 3] and d[0, 1] == pytest.approx(1.2)  # the recorded distances are the raw ones
    # a's two clients alike (one cluster), b's two apart: b anchors; a's cluster (centred mean 0) is as near to both
    # b clusters (0.1 each) and joins the first formed, {1}
    alike = {**preds, 2: preds[0].copy()}  # a copy: the module's predictions stay as they are for other tests
    assert cluster_on(alike, p, arch)[0].clusters == [[0, 1, 2], [3]]


def test_client_architecture_cycles_per_client_by_id() -> None:
    assert [client_architecture("cnn", ["mlp", "cnn"], c) for c in range(4)] == ["mlp", "cnn", "mlp", "cnn"]
    assert client_architecture("cnn", [], 7) == "cnn"


def test_a_new_cluster_continues_the_old_cluster_most_of_its_members_were_in() -> None:
    old = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    # [0, 1, 2]: two from 0, one from 1 -> 0; [3, 4]: one each from 1 and 2 -> the lower, 1; [5]: nobody known
    assert inherited_clusters(old, [[0, 1, 2], [3, 4], [5]]) == [0, 1, None]
    assert inherited_clusters(old, [[2, 3, 4]]) == [1]


def test_the_architecture_options_need_two_architectures(tmp_path: Path) -> None:
    path = write_config(tmp_path, architectures="cluster-within")
    cfg = load_config(path, "model.per_client=[]")
    with pytest.raises(ConfigError, match="architectures: cluster-within' needs clients of at least two"):
        resolve(cfg)
    resolve(load_config(path))  # mlp and cnn clients: accepted


def test_reclustering_runs_in_the_rounds_due_and_records_the_ari_every_round(tmp_path: Path) -> None:
    path = write_config(tmp_path, rounds=3, recluster_every=2, architectures="cluster-within")
    summary, run_dir = run_in_process(Path(path), tmp_path / "results", InProcessGrid(N_CLIENTS))
    rows = list(csv.DictReader((run_dir / "rounds.csv").open()))
    assert [int(r["reclustered"]) for r in rows] == [0, 0, 1]  # round 1 clusters; 1 + 2 = 3 clusters again
    cfg = load_config(path)
    groups, members = Cosmos(cfg).fed.groups, summary["cluster_members"]
    cluster_of = {c: k for k, m in enumerate(members) for c in m}
    assert float(rows[-1]["cluster_group_ari"]) == pytest.approx(adjusted_rand(groups, cluster_of))
    assert all(-1.0 <= float(r["cluster_group_ari"]) <= 1.0 for r in rows)
    assert sum(len(m) for m in members) == N_CLIENTS


def test_the_drop_in_refuses_our_options_it_does_not_run() -> None:
    from strategies.cosmos import FlowerCosmos

    public_x = torch.zeros(4, 1, 8, 8)
    for option in ({"recluster_every": 2}, {"architectures": "centre"}):
        with pytest.raises(ConfigError, match="run in our app's cosmos strategy only"):
            FlowerCosmos(lambda: torch.nn.Linear(64, 3), public_x, 3, **option)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """COSMOS's deployed model after round rnd: the client's cluster model after that round's server training."""
    return evaluate(s.models[s.cluster_of[cid]].state_dict(), data)


DEPLOYED_BY_HAND = {"cosmos": deployed_by_hand}
