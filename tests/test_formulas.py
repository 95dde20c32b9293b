"""Formulas pinned against hand computations or a reference implementation, each written so that the mutation
named in its docstring makes it fail (checked by applying the mutation; see docs/mutation.md):

- WDR (cwFedAvg's client term) through the registered term: value (λ/2)·‖p − p̃‖₂ and its gradient;
- the distillation KL of ``fedapps.client.ops`` (COSMOS, FedMD, COMET use it) against ``torch.nn.functional.kl_div``:
  direction KL(target ‖ model) and reduction ``batchmean``, in the loss value and in the SGD step ``distill`` takes;
- FedAMP's client coefficient λ/(2α_K), from the server's message to the client's gradient;
- cwFedAvg's defaults: the paper's estimator and λ.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedapps.client import ops

from fedapps.wire import protocol
from fedapps.client.clientops import TRAINING_TERMS
from fedapps.config import ConfigError, OptimSettings, load_config
from fedapps.flower.inprocess import InProcessGrid
from strategies import resolve
from strategies.cwfedavg import WDR_LAMBDA, CwFedAvgParams

torch.set_num_threads(1)

# --------------------------------------------------------------------------- WDR

# classifier rows with norms 5, 10, 5 -> p̃ = [0.25, 0.5, 0.25]
ROWS = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 5.0]])
COUNTS = np.array([30, 30, 0])  # the client's training class counts -> p = [0.5, 0.5, 0]


def wdr_worker(counts: np.ndarray = COUNTS) -> SimpleNamespace:
    """What the `wdr` term reads from the worker: its model, its training class counts, its id, the device."""
    model = nn.Sequential(nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight.copy_(ROWS)
        model[0].bias.zero_()
    fed = SimpleNamespace(train_counts={7: counts})
    return SimpleNamespace(model=model, fed=fed, client_id=7, device=torch.device("cpu"))


def wdr_by_hand(rows: np.ndarray, p: np.ndarray, lam: float) -> tuple[float, np.ndarray]:
    """(λ/2)·‖p̃ − p‖₂ and its gradient in the rows, with p̃_k = n_k / S, n_k = ‖w_k‖, S = Σ n:
    ∂/∂w_k = (λ/2)/(‖d‖·S) · (d_k − Σ_j d_j p̃_j) · w_k / n_k,   d = p̃ − p."""
    n = np.linalg.norm(rows, axis=1)
    s = n.sum()
    d = n / s - p
    value = 0.5 * lam * np.linalg.norm(d)
    grad = (0.5 * lam / (np.linalg.norm(d) * s)) * (d - d @ (n / s))[:, None] * rows / n[:, None]
    return value, grad


def wdr(lam: float) -> protocol.Section:
    """The train section of a message asking for WDR with λ = ``lam``."""
    return protocol.Section(extra={WDR_LAMBDA: lam})


def test_wdr_value_and_gradient_by_hand() -> None:
    """Fails when the norm is squared, or when the target is not the client's class distribution (e.g. uniform)."""
    w = wdr_worker()
    term = TRAINING_TERMS["wdr"](w, wdr(4.0))
    value = term(w.model)
    # p̃ − p = [−0.25, 0, 0.25], ‖·‖₂ = 0.25·√2; (4/2)·0.25·√2 = √2/2 (squared: 0.25; uniform target: 0.408)
    assert value.item() == pytest.approx(math.sqrt(2) / 2, rel=1e-6)
    value.backward()
    expected_value, expected_grad = wdr_by_hand(ROWS.numpy().astype(np.float64), COUNTS / COUNTS.sum(), 4.0)
    assert value.item() == pytest.approx(expected_value, rel=1e-6)
    np.testing.assert_allclose(w.model[0].weight.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-7)
    assert w.model[0].bias.grad is None  # WDR reaches the classifier weight only
    # the gradient points p̃ towards the client's p: a small step against it lowers ‖p̃ − p‖
    with torch.no_grad():
        stepped = ROWS - 0.5 * w.model[0].weight.grad
    p_step = stepped.norm(dim=1) / stepped.norm(dim=1).sum()
    assert torch.linalg.vector_norm(p_step - torch.tensor([0.5, 0.5, 0.0])) < math.sqrt(2) / 4


def test_wdr_target_is_each_clients_own_distribution() -> None:
    """Another client's counts give another value: the target is read from the client's counts, not fixed."""
    w = wdr_worker(np.array([10, 10, 20]))  # p = [0.25, 0.25, 0.5]: p̃ − p = [0, 0.25, −0.25]
    assert TRAINING_TERMS["wdr"](w, wdr(4.0))(w.model).item() == pytest.approx(math.sqrt(2) / 2, rel=1e-6)
    w = wdr_worker(np.array([1, 2, 1]))  # p = p̃: no penalty
    assert TRAINING_TERMS["wdr"](w, wdr(4.0))(w.model).item() == pytest.approx(0.0, abs=1e-7)
    assert TRAINING_TERMS["wdr"](w, wdr(0.0)) is None


# --------------------------------------------------------------------------- the distillation KL


def kl_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ softmax(logits)) averaged over the batch, as torch defines it."""
    return F.kl_div(F.log_softmax(logits, dim=-1), targets, reduction="batchmean")


def skewed_batch(seed: int = 0, rows: int = 6, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets far enough apart that KL(t‖q) and KL(q‖t) differ clearly."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, classes, generator=g)
    targets = torch.softmax(3.0 * torch.randn(rows, classes, generator=g), dim=-1)
    return logits, targets


def test_kl_to_targets_is_torch_kl_div_batchmean() -> None:
    """Fails when the direction is reversed (KL(model ‖ target)) or the reduction is a sum over the batch."""
    logits, targets = skewed_batch()
    ours, ref = ops.kl_to_targets(logits, targets), kl_reference(logits, targets)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    reverse = F.kl_div(torch.log(targets), F.log_softmax(logits, -1), reduction="batchmean", log_target=True)
    assert abs(ref.item() - reverse.item()) > 0.1  # the two directions are far apart on this batch
    # per-sample weights: Σ w_i KL_i / Σ w_i (COSMOS's weighted objective); a zero weight drops the sample
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 3.0])
    per_sample = F.kl_div(F.log_softmax(logits, -1), targets, reduction="none").sum(-1)
    assert ops.kl_to_targets(logits, targets, w).item() == pytest.approx(((w * per_sample).sum() / w.sum()).item(), rel=1e-5)


def test_distill_takes_the_sgd_step_of_torch_kl_div() -> None:
    """``distill`` with loss 'kl' on one full batch moves the model by −lr·∇ kl_div(batchmean) and reports that loss:
    fails on a reversed direction, a sum reduction or any other loss in the loop."""
    torch.manual_seed(3)
    x = torch.randn(8, 5)
    model = nn.Linear(5, 4)
    reference = nn.Linear(5, 4)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        targets = torch.softmax(3.0 * torch.randn(8, 4), dim=-1)
    lr = 0.1
    loss = kl_reference(reference(x), targets)
    loss.backward()
    result = ops.distill(model, x, targets, OptimSettings(epochs=1, batch_size=8, lr=lr, drop_last=False),
                         ops.DistillSettings(loss="kl"))
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), (q - lr * q.grad).detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


# --------------------------------------------------------------------------- FedAMP's coefficient


def test_fedamp_client_term_is_lambda_over_two_alpha_k_with_gradient(tiny_config) -> None:
    """From the server's message to the client's loss: (λ/(2α_K))‖w − u_i‖², gradient (λ/α_K)(w − u_i).
    Fails with the coefficient λ/2 (Ditto's) or a term computed on detached parameters."""
    from strategies.fedamp import FedAMP
    from fedapps.models import build_model

    lam, alpha_k = 0.3, 0.05
    cfg = load_config(tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {
        "alpha_k": alpha_k, "sigma": 1.0, "lam": lam}}}), "")
    InProcessGrid(cfg.data.num_clients)  # gives Message() the run identity it needs outside Flower's runtime
    message = FedAMP(cfg).round_messages(1, [11])[0]
    anchor = message.content[protocol.ARRAYS].to_torch_state_dict()  # u_i (here the initial model)
    section = protocol.request_of(message).training.section(protocol.TRAIN)
    model = build_model("mlp", 10, (1, 8, 8), seed=5)  # a model away from the anchor
    term = TRAINING_TERMS["proximal"](SimpleNamespace(received=anchor, device=torch.device("cpu")), section)
    value = term(model)
    value.backward()
    diff = {n: (p.detach() - anchor[n]).double() for n, p in model.named_parameters()}
    squared = sum(float((d ** 2).sum()) for d in diff.values())
    assert squared > 1.0
    assert value.item() == pytest.approx(lam / (2 * alpha_k) * squared, rel=1e-5)
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        np.testing.assert_allclose(p.grad.numpy(), (lam / alpha_k * diff[n]).numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_fedamp_refuses_a_proximal_step_that_diverges(tiny_config) -> None:
    """lr·λ/α_K >= 2 makes plain SGD on the proximal term diverge: a ConfigError names the keys."""
    bad = tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {"alpha_k": 0.01, "sigma": 1.0, "lam": 4.0}}})
    with pytest.raises(ConfigError, match=r"strategy\.params\.fedamp\.lam.*client\.lr"):
        resolve(load_config(bad, ""))  # lr 0.05 · 4 / 0.01 = 20
    ok = tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {"alpha_k": 0.01, "sigma": 1.0, "lam": 0.1}}})
    resolve(load_config(ok, ""))  # 0.05 · 0.1 / 0.01 = 0.5


# --------------------------------------------------------------------------- cwFedAvg's defaults


def test_cwfedavg_defaults_are_the_papers_estimator_and_lambda() -> None:
    """The `bias` estimator is an option, not the default (docs/algorithms/cwfedavg.md); λ = 10 is the paper's MNIST
    value."""
    p = CwFedAvgParams()
    assert (p.estimator, p.wdr_lambda) == ("norm", 10.0)
    for path in ("configs/cwfedavg.yaml", "configs/default.yaml"):
        params = resolve(load_config(path, "strategy.name=cwfedavg")).params
        assert (params.estimator, params.wdr_lambda) == ("norm", 10.0), path


# --------------------------------------------------------------------------- found by `make mutate`: robust rules


def test_cap_weights_refuses_bad_weights_and_shares() -> None:
    """Each refusal on its own (the conditions are or-ed: a mutant that drops one must be caught by one case)."""
    from fedapps.server.robust import cap_weights

    for bad in ([2.0, -1.0], [1.0, np.nan], [np.inf, 1.0], [0.0, 0.0], [], [[1.0, 2.0]]):
        with pytest.raises(ValueError):
            cap_weights(bad, 0.5)
    with pytest.raises(ValueError):
        cap_weights([1.0, 1.0], 0.0)
    np.testing.assert_array_equal(cap_weights([5.0], 0.5), [1.0])  # one client: all the weight, cap or not
    assert cap_weights(np.array([1, 3], np.float32), 0.6).dtype == np.float64


def test_robust_rules_return_float64_and_trim_zero_is_the_mean() -> None:
    from fedapps.server.robust import AggregationRule, combine, coordinate_median, trimmed_mean

    stack = np.array([[1.0, 4.0], [2.0, 0.0], [6.0, 5.0]], np.float32)
    assert coordinate_median(stack).dtype == np.float64 and trimmed_mean(stack, 0.2).dtype == np.float64
    assert combine(stack, [1, 1, 1], AggregationRule("median")).dtype == np.float64
    np.testing.assert_allclose(trimmed_mean(stack, 0.0), stack.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(combine(stack, [1, 1, 2], AggregationRule("mean")), [3.75, 3.5], rtol=1e-6)


# --------------------------------------------------------------------------- found by `make mutate`: cwFedAvg's estimates


def test_bias_evidence_and_l1_error_by_hand() -> None:
    from strategies.cwfedavg import bias_evidence, l1_error

    sent = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    uploaded = np.array([0.8, -1.5, 2.0, 0.25], np.float32)
    # only the classes whose bias went UP count, by how much
    np.testing.assert_allclose(bias_evidence(uploaded, sent), [0.3, 0.0, 0.0, 0.25], atol=1e-7)
    assert bias_evidence(uploaded, sent).dtype == np.float64
    p_hat = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    p_true = np.array([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    assert l1_error(p_hat, p_true) == pytest.approx((1.0 + 2.0) / 2)  # Σ_j |p̂ − p| per client, mean over clients


# --------------------------------------------------------------------------- found by `make mutate`: pseudo-labels


def test_temperature_row_by_row() -> None:
    from fedapps.wire.pseudolabels import apply_temperature

    p = np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    sharp = apply_temperature(p, 0.5)  # p² renormalised, per row
    np.testing.assert_allclose(sharp, (p ** 2) / (p ** 2).sum(axis=1, keepdims=True), rtol=1e-6)
    assert sharp.dtype == np.float32
    np.testing.assert_array_equal(apply_temperature(p, 0), [[0, 0, 1], [1, 0, 0]])
    assert apply_temperature(p, 1) is p  # T = 1 leaves p as it is
    # tiny T on a row of tiny probabilities: stable (the row's own max is subtracted before exp), no warnings
    tiny = np.array([[1e-5, 2e-5, 0.0], [0.5, 0.5, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = apply_temperature(tiny, 0.01)
    np.testing.assert_allclose(out, [[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]], atol=1e-6)


def test_aggregations_per_sample() -> None:
    from fedapps.wire.pseudolabels import aggregate

    stack = np.array([  # 3 members × 3 samples × 3 classes
        [[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.2, 0.8, 0.0]],
        [[0.0, 1.0, 0.0], [0.1, 0.1, 0.8], [0.3, 0.7, 0.0]],
        [[0.0, 0.0, 1.0], [0.5, 0.5, 0.0], [0.4, 0.6, 0.0]],
    ])
    np.testing.assert_allclose(aggregate(stack), stack.mean(axis=0))  # the default is the mean
    # median per class, renormalised per sample; sample 0: every median is 0 (no division by zero)
    np.testing.assert_allclose(aggregate(stack, "median"), [[0, 0, 0], [5 / 9, 4 / 9, 0], [0.3, 0.7, 0]], atol=1e-12)
    # max: sample 0 — all members equally confident, the first wins; sample 1 — member 1 (0.8); 2 — member 0
    np.testing.assert_allclose(aggregate(stack, "max"), [[1, 0, 0], [0.1, 0.1, 0.8], [0.2, 0.8, 0]])


def test_pseudo_label_encodings_edges() -> None:
    from fedapps.wire.pseudolabels import decode, encode, label_dtype, one_hot

    assert label_dtype(2 ** 32) == np.uint64  # beyond uint32 (the marker M itself must fit)
    np.testing.assert_array_equal(encode(np.array([2, 0, 3]), "hard", 3), [2, 0, 3])  # hard labels as they are; 3 = abstain
    for bad in (np.array([-1, 0]), np.array([4, 0])):
        with pytest.raises(ValueError):
            encode(bad, "hard", 3)
    for bad in (np.zeros(3, np.float32), np.zeros((2, 4), np.float32)):
        with pytest.raises(ValueError):
            encode(bad, "float32", 3)
    assert decode(np.zeros((2, 3), np.float16), 3).dtype == np.float32
    labels = one_hot(np.array([1, 3, 0]), 3)
    assert labels.dtype == np.float32
    np.testing.assert_array_equal(labels, [[0, 1, 0], [0, 0, 0], [1, 0, 0]])


# --------------------------------------------------------------------------- found by `make mutate`: clustering


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
    from fedapps.server.clustering import greedy_threshold_clustering

    d = graph(9, [(0, 1), (0, 2), (0, 3), (0, 4), (7, 1), (7, 2), (7, 8), (5, 6)])
    assert greedy_threshold_clustering(d, 0.5) == [[0, 1, 2, 3, 4], [5, 6], [7, 8]]
    # closeness in one direction is enough: the relation is made symmetric
    assert greedy_threshold_clustering(graph(3, [], asymmetric=(0, 2)), 0.5) == [[0, 2], [1]]
    for bad in (np.zeros(4), np.zeros((2, 3))):
        with pytest.raises(ValueError, match="square"):
            greedy_threshold_clustering(bad, 0.5)


def test_auto_threshold_defaults_and_refusals() -> None:
    from fedapps.server.clustering import auto_threshold

    d = graph(4, [(0, 1), (2, 3)])
    b0, clusters, tried = auto_threshold(d, 2)  # defaults: start 0.05, step 0.05
    assert (b0, clusters, tried) == (0.1, [[0, 1], [2, 3]], [(0.05, 4), (0.1, 2)])
    assert auto_threshold(d, 2, start=0.0, step=0.1)[0] == 0.1  # start 0 is allowed
    assert auto_threshold(np.zeros((0, 0)), 1)[1] == []  # no clients: nothing to cluster
    for bad in ({"max_clusters": 0}, {"max_clusters": 2, "step": 0.0}, {"max_clusters": 2, "start": -0.1}):
        with pytest.raises(ValueError):
            auto_threshold(d, **bad)


# --------------------------------------------------------------------------- found by `make mutate`: cwFedAvg's mixing maths


def test_normalise_rows_zero_rows_small_sums_and_dtype() -> None:
    from strategies.cwfedavg import normalise_rows

    x = np.array([[0.2, 0.3, 0.0], [0.0, 0.0, 0.0], [2.0, 6.0, 0.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-zero row must not divide by zero
        out = normalise_rows(x)
    np.testing.assert_allclose(out, [[0.4, 0.6, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.75, 0.0]], rtol=1e-6)
    assert out.dtype == np.float64


def test_fedavg_and_class_weights_with_masks_and_small_counts() -> None:
    from strategies.cwfedavg import class_weights, fedavg_weights

    np.testing.assert_allclose(fedavg_weights([1.0, 3.0, 4.0], [True, False, True]), [0.2, 0.0, 0.8])
    np.testing.assert_allclose(fedavg_weights([0.2, 0.3]), [0.4, 0.6])  # counts below 1 are fine
    np.testing.assert_allclose(fedavg_weights([0.0, 0.0, 0.0], [True, False, False]), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(fedavg_weights([0.0, 0.0, 0.0], [True, False, True]), [0.5, 0.0, 0.5])
    n = np.array([1.0, 1.0, 2.0])
    p = np.array([[0.3, 0.7, 0.0], [0.2, 0.8, 0.0], [0.5, 0.5, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # class 2 is held by nobody: no 0/0
        q = class_weights(n, p, [True, True, False])
    # class 0: masses 0.3, 0.2 (client 2 masked out) -> 0.6, 0.4; class 2: nobody -> FedAvg over the mask
    np.testing.assert_allclose(q, [[0.6, 0.7 / 1.5, 0.5], [0.4, 0.8 / 1.5, 0.5], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(class_weights(n, p)[:, 0], [0.3 / 1.5, 0.2 / 1.5, 1.0 / 1.5])


def test_mixing_keeps_the_models_dtype_and_mixes_integer_arrays_in_float() -> None:
    from strategies.cwfedavg import mix, mixing_matrix

    stack = np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)
    out = mix(np.array([0.25, 0.75]), stack)
    assert out.dtype == np.float32  # float64 weights do not upcast (and double) the personalised models
    np.testing.assert_allclose(out, [2.5, 5.0])
    np.testing.assert_allclose(mix(np.array([0.5, 0.5]), np.array([[2], [5]])), [3.5])  # not truncated to int
    a = mixing_matrix(np.array([[1.0, 0.0]], np.float32), np.array([[0.5, 0.5], [0.5, 0.5]], np.float32))
    assert a.dtype == np.float64


def test_row_norm_distribution_of_small_rows() -> None:
    from strategies.cwfedavg import class_distribution_from_rows

    np.testing.assert_allclose(class_distribution_from_rows(torch.tensor([[0.1, 0.0], [0.0, 0.3]])).numpy(), [0.25, 0.75],
                               rtol=1e-6)


# --------------------------------------------------------------------------- found by `make mutate`: ops, FedAMP, FedProx


def test_weighted_mean_with_weights_below_one() -> None:
    assert ops.weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([0.2, 0.3])).item() == pytest.approx(2.2)


def test_attention_weights_are_float64_and_an_empty_anchor_costs_nothing() -> None:
    from strategies.fedamp import attention_weights
    from strategies.fedprox import proximal_penalty

    xi = attention_weights(np.zeros((3, 3), np.float32), 0.1, 1.0)
    assert xi.dtype == np.float64
    np.testing.assert_allclose(xi.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    assert proximal_penalty(nn.Linear(2, 1), {}, 1.0).item() == 0.0


# --------------------------------------------------------------------------- found by `make mutate`: distances


def test_distance_to_centres_both_metrics_by_hand() -> None:
    from fedapps.server.clustering import distance_to_centres

    pred = np.array([[1.0, 0.0], [0.0, 1.0]])  # n = 2 samples × 2 classes
    centres = np.array([pred, [[0.0, 1.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])
    np.testing.assert_allclose(distance_to_centres(pred, centres), [0.0, 1.0, 1.0])  # Σ|·| / n; l1 by default
    np.testing.assert_allclose(distance_to_centres(pred, centres, "l2"), [0.0, 1.0, math.sqrt(0.5)])  # ‖·‖₂ / √n


def test_identical_rows_are_at_distance_zero_and_one_column_blocks_work() -> None:
    from fedapps.server.clustering import l2_distance_matrix
    from fedapps.server.pairwise_l1 import l1_distance_matrix

    x = np.array([[0.2, 0.8, 0.0], [0.2, 0.8, 0.0], [1.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(np.diag(l2_distance_matrix(x)), 0.0)
    assert l2_distance_matrix(x)[0, 1] == 0.0
    np.testing.assert_allclose(l1_distance_matrix(x, block=1), [[0, 0, 1.6], [0, 0, 1.6], [1.6, 1.6, 0]], rtol=1e-6)
    # more threads asked for than there are blocks (3 columns in blocks of 2: 2 blocks): as many threads as blocks
    np.testing.assert_allclose(l1_distance_matrix(x, threads=3, block=2), l1_distance_matrix(x), rtol=1e-6)


def test_cap_weights_spreads_the_excess_over_zero_weight_clients():
    from fedapps.server.robust import cap_weights

    out = cap_weights([1.0, 0.0, 0.0], 0.5)
    np.testing.assert_allclose(out, [0.5, 0.25, 0.25])
    out = cap_weights([3.0, 1.0, 0.0, 0.0], 0.4)  # 0.75 capped to 0.4; 0.25 scaled to 0.6 -> capped; zeros share 0.2
    np.testing.assert_allclose(out, [0.4, 0.4, 0.1, 0.1])


# --------------------------------------------------------------------------- found by `make mutate`: FedUV


def test_feduv_terms_on_a_batch_of_two_and_of_one() -> None:
    """Two samples are enough for both terms (a batch of 2 has a variance and one pair); one sample gives 0, not
    the logits' sum."""
    from strategies.feduv import LOG_GAUSSIAN, uniformity, variance_hinge

    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]], dtype=torch.float64)
    # each column (3/4, 1/4): unbiased variance 1/8, std 0.3536; hinge 0.5 − std per class
    assert variance_hinge(logits, 0.5, eps=0.0).item() == pytest.approx(0.5 - math.sqrt(1 / 8), abs=1e-12)
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    # one pair: log-gaussian on the unit rows, squared distance 2; median-rbf on the raw rows, d = m = 5: exp(−1)
    assert uniformity(z, LOG_GAUSSIAN, 2.0).item() == pytest.approx(-2.0 * 2.0, abs=1e-12)
    assert uniformity(z).item() == pytest.approx(math.exp(-1.0), abs=1e-12)
    assert variance_hinge(torch.tensor([[1.0, 2.0, 3.0]]), 0.5).item() == 0.0
    for form in ("median-rbf", LOG_GAUSSIAN):
        assert uniformity(torch.tensor([[1.0, 2.0, 3.0]]), form).item() == 0.0


def feduv_batch():
    from fedapps.models import build_model

    model = build_model("mlp", 10, (1, 8, 8), seed=0)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)


def test_feduv_loss_computes_only_the_terms_that_are_on_and_sums_them_over_batches() -> None:
    from strategies.feduv import FeatureTap, feduv_loss, iid_threshold, uniformity, variance_hinge

    model, x, y = feduv_batch()
    with torch.no_grad():
        feats = model.fc2(model.fc1(torch.flatten(x, 1)))
        logits = model.fc(feats)
        ce, v, u = F.cross_entropy(logits, y), variance_hinge(logits, iid_threshold(10)), uniformity(feats)
        loss_fn, sums = feduv_loss(None, 0.0, 0.0)  # both off: the cross-entropy exactly, nothing summed
        assert torch.equal(loss_fn(model, x, y, None), ce) and sums == {}
        loss_fn, sums = feduv_loss(None, 0.5, 0.0)  # the variance term alone needs no features
        assert loss_fn(model, x, y, None).item() == pytest.approx((ce + 0.5 * v).item(), rel=1e-6)
        assert set(sums) == {"variance", "batches"}
        assert float(sums["variance"]) == pytest.approx(v.item(), rel=1e-6)
        tap = FeatureTap(model)
        loss_fn, sums = feduv_loss(tap, 0.0, 0.5)  # the uniformity term alone (a coefficient below 1)
        with tap:
            assert loss_fn(model, x, y, None).item() == pytest.approx((ce + 0.5 * u).item(), rel=1e-6)
            loss_fn(model, x, y, None)  # a second batch: the running sums add up
        assert set(sums) == {"uniformity", "batches"}
        assert float(sums["batches"]) == 2.0 and float(sums["uniformity"]) == pytest.approx(2 * u.item(), rel=1e-6)


def test_feduv_loss_adds_the_other_training_terms_evaluated_on_the_model() -> None:
    from strategies.feduv import feduv_loss

    model, x, y = feduv_batch()
    regulariser = lambda m: (m.fc.weight ** 2).sum()  # noqa: E731
    with torch.no_grad():
        ce = F.cross_entropy(model(x), y)
        loss_fn, _ = feduv_loss(None, 0.0, 0.0, regulariser=regulariser)
        assert loss_fn(model, x, y, None).item() == pytest.approx((ce + regulariser(model)).item(), rel=1e-6)


# --------------------------------------------------------------------------- found by `make mutate`: FedNH


def test_cosine_head_normalises_each_feature_vector_also_with_extra_leading_dimensions() -> None:
    """Like nn.Linear, the head takes (*, d) inputs: each d-vector is normalised, not a column across samples."""
    from fedapps.models.heads import CosineClassifier

    head = CosineClassifier(2, 2, scale=3.0)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    z = torch.tensor([[[3.0, 4.0], [0.0, 2.0], [5.0, 0.0]], [[1.0, 1.0], [-2.0, 0.0], [0.0, 0.5]]])  # 2 × 3 × d
    want = 3.0 * F.normalize(z, dim=-1)  # cosines with the unit axes
    torch.testing.assert_close(head(z), want)


def test_fednh_normalise_rows_zero_and_tiny_rows() -> None:
    """A row at or below the guard (norm ≤ 1e-12) is set to zero, not left as whatever memory np.divide found."""
    from strategies.fednh import normalise_rows

    a = np.array([[3.0, 4.0], [0.0, 0.0], [1e-12, 0.0], [2e-12, 0.0]])
    for _ in range(3):  # freed arrays of the same size are reused: an unset output row would show their values
        junk = np.full_like(a, 7.0)
        del junk
        np.testing.assert_array_equal(normalise_rows(a), [[0.6, 0.8], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])


def test_fednh_min_pairwise_angle_of_integer_and_rounded_rows() -> None:
    from strategies.fednh import min_pairwise_angle

    assert min_pairwise_angle([[1, 0], [0, 1]]) == pytest.approx(90.0)  # integer rows are fine
    # (1, 1, 1)/√3 · itself rounds to 1 + 2e-16: clipped, not a math domain error
    assert min_pairwise_angle(np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])) == 0.0


def test_fednh_orthogonal_prototypes_square_seeded_float32() -> None:
    from strategies.fednh import orthogonal_prototypes

    p = orthogonal_prototypes(4, 4, seed=5)  # K = d is allowed: a rotation
    assert p.dtype == np.float32
    np.testing.assert_allclose(p @ p.T, np.eye(4), atol=1e-6)
    np.testing.assert_array_equal(orthogonal_prototypes(3, 6, seed=5), orthogonal_prototypes(3, 6, seed=5))
    assert not np.allclose(orthogonal_prototypes(3, 6, seed=5), orthogonal_prototypes(3, 6, seed=6))


def test_fednh_update_keeps_unseen_classes_at_rho_zero_and_the_input_dtype() -> None:
    from strategies.fednh import update_prototypes

    p = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    local = np.array([[[0.0, 1.0], [0.0, 0.0]]], np.float32)
    counts = np.array([[2, 0]])  # class 1: nobody has samples
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0/0 for the unseen class
        new = update_prototypes(p, local, counts, 0.0)
    assert new.dtype == np.float32
    np.testing.assert_array_equal(new, [[0.0, 1.0], [0.0, 1.0]])  # class 0 moved all the way; class 1 kept


# --------------------------------------------------------------------------- found by `make mutate`: pFedHN


def test_pfedhn_embedding_size_one_and_optimizer_settings() -> None:
    from strategies.pfedhn import HyperNetwork, embedding_size, make_optimizer

    assert embedding_size(20, 1) == 1  # a given size of 1 is kept, not replaced by the rule
    hn = HyperNetwork(3, {"w": (2, 3)}, embed_dim=2, hidden_dim=3, hidden_layers=1)
    rest, emb = make_optimizer(hn, lr=0.1, embed_lr=0.0, momentum=0.7, weight_decay=0.01).param_groups
    assert (rest["lr"], rest["momentum"], rest["weight_decay"]) == (0.1, 0.7, 0.01)
    assert (emb["lr"], emb["momentum"], emb["weight_decay"]) == (0.1, 0.7, 0.01)  # embed_lr 0: the same lr
    assert [id(t) for t in emb["params"]] == [id(hn.embeddings.weight)]
    assert {id(t) for t in rest["params"]} == {id(t) for n, t in hn.named_parameters() if not n.startswith("emb")}
    assert make_optimizer(hn, lr=0.1, embed_lr=0.3, momentum=0.0, weight_decay=0.0).param_groups[1]["lr"] == 0.3


def test_pfedhn_step_without_a_gradient_reports_zero_and_moves_nothing() -> None:
    from strategies.pfedhn import HyperNetwork, hypernetwork_step, make_optimizer

    hn = HyperNetwork(3, {"w": (2, 3)}, embed_dim=2, hidden_dim=3, hidden_layers=1)
    before = [p.detach().clone() for p in hn.parameters()]
    assert hypernetwork_step(hn, make_optimizer(hn, 0.1, 0.0, 0.9, 0.0), clip_norm=1.0) == 0.0
    assert all(torch.equal(a, p) for a, p in zip(before, hn.parameters()))
