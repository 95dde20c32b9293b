"""FedUV: its two terms by hand (value and gradient), what they are computed on, that they are off at
coefficient 0 (FedAvg's client step to the bit), that each moves training the way it should, and a short run
in-process and one through `flwr run`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deployed_toy import evaluate, tensors
from fedapps.client.worker import Worker
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from fedapps.wire.protocol import ARRAYS
from strategies import resolve
from strategies.feduv import (
    FORM,
    LOG_GAUSSIAN,
    MEDIAN_RBF,
    MU_U,
    MU_V,
    TEMPERATURE,
    TRAIN_OP,
    UNIFORMITY,
    VARIANCE,
    FeatureTap,
    feduv_loss,
    iid_threshold,
    log_gaussian_uniformity,
    median_rbf_uniformity,
    uniformity,
    variance_hinge,
)
from test_ops_worker import train_settings, worker_message

LN3 = math.log(3.0)


# --------------------------------------------------------------------------- the variance hinge


def test_threshold_is_the_std_of_one_perfect_sample_per_class():
    # C = 4: a class's probabilities over the batch are (1, 0, 0, 0): mean 1/4, squared deviations
    # 9/16 + 3·1/16 = 3/4, unbiased variance (3/4)/3 = 1/4, std 1/2 = 1/√4
    assert iid_threshold(4) == pytest.approx(0.5)
    for c in (2, 10, 100):
        assert iid_threshold(c) == pytest.approx(np.std(np.eye(c)[:, 0], ddof=1))
    with pytest.raises(ValueError):
        iid_threshold(1)


def three_by_two_logits() -> torch.Tensor:
    # softmax rows: (1/2, 1/2), (3/4, 1/4), (1/4, 3/4)
    return torch.tensor([[0.0, 0.0], [LN3, 0.0], [0.0, LN3]], dtype=torch.float64, requires_grad=True)


def test_variance_hinge_value_and_gradient_by_hand():
    logits = three_by_two_logits()
    value = variance_hinge(logits, gamma=0.3, eps=0.0)
    # each column (1/2, 3/4, 1/4): mean 1/2, squared deviations 0 + 1/16 + 1/16, unbiased variance 1/16,
    # std 1/4; hinge 0.3 − 0.25 per class, mean over the 2 classes 0.05. (Variance instead of std: 0.2375;
    # population std: 0.0959; sum over classes: 0.1.)
    assert value.item() == pytest.approx(0.05, abs=1e-12)
    value.backward()
    # dV/dP_bc = −(1/C)(P_bc − mean_c)/((B − 1)·std_c) = −(P_bc − 1/2): column 0 (0, −1/4, 1/4), column 1 the
    # opposite; through the softmax, dL_bk = Σ_c dV/dP_bc · P_bc(δ_ck − P_bk): row 1 = (−3/32, 3/32), row 2 = −row 1
    expected = np.array([[0.0, 0.0], [-0.09375, 0.09375], [0.09375, -0.09375]])
    np.testing.assert_allclose(logits.grad.numpy(), expected, atol=1e-12)
    # the descent step makes each prediction more extreme: the variance of the probabilities grows
    stepped = (logits - 1.0 * logits.grad).detach()
    assert F.softmax(stepped, 1)[:, 0].var() > F.softmax(logits.detach(), 1)[:, 0].var()


def test_variance_hinge_is_zero_above_the_threshold_and_uses_eps():
    logits = three_by_two_logits()
    off = variance_hinge(logits, gamma=0.2, eps=0.0)  # std 0.25 > 0.2: the hinge is inactive (not |γ − s|)
    assert off.item() == 0.0
    off.backward()
    assert not logits.grad.any()
    with_eps = variance_hinge(three_by_two_logits(), gamma=0.3)  # default ε = 1e-4 inside the root
    assert with_eps.item() == pytest.approx(0.3 - math.sqrt(1 / 16 + 1e-4), abs=1e-12)


def numpy_variance_hinge_grad(logits: np.ndarray, gamma: float, eps: float) -> tuple[float, np.ndarray]:
    """An independent formula: V and dV/dlogits by the chain rule written out."""
    e = np.exp(logits - logits.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    b, c = p.shape
    dev = p - p.mean(0)
    s = np.sqrt((dev**2).sum(0) / (b - 1) + eps)
    active = (gamma - s) > 0
    value = float(np.where(active, gamma - s, 0.0).mean())
    dp = np.where(active, -dev / ((b - 1) * s) / c, 0.0)
    dlogits = p * (dp - (dp * p).sum(1, keepdims=True))
    return value, dlogits


def test_variance_hinge_matches_an_independent_formula_on_a_random_batch():
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(7, 4)) * 0.5
    logits = torch.tensor(raw, requires_grad=True)
    gamma = iid_threshold(4)
    value = variance_hinge(logits, gamma)
    value.backward()
    want_value, want_grad = numpy_variance_hinge_grad(raw, gamma, 1e-4)
    assert value.item() == pytest.approx(want_value, rel=1e-10)
    np.testing.assert_allclose(logits.grad.numpy(), want_grad, rtol=1e-8, atol=1e-12)


def test_variance_hinge_on_degenerate_batches_is_finite():
    one = torch.zeros(1, 3, requires_grad=True)
    value = variance_hinge(one, iid_threshold(3))
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(one.grad).all()
    same = torch.ones(4, 3, requires_grad=True)  # every row equal: std 0, sqrt(ε) keeps the gradient finite
    value = variance_hinge(same, iid_threshold(3))
    value.backward()
    assert value.item() == pytest.approx(1 / math.sqrt(3) - math.sqrt(1e-4))
    assert torch.isfinite(same.grad).all()


# --------------------------------------------------------------------------- the uniformity term


def test_median_rbf_uniformity_value_and_gradient_by_hand():
    # 1-D features 0, 1, 3: squared distances (0,1) 1, (0,2) 9, (1,2) 4; their median m = 4 = d12
    z = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64, requires_grad=True)
    e1, e2, e3 = math.exp(-1 / 4), math.exp(-9 / 4), math.exp(-1.0)
    value = median_rbf_uniformity(z)
    assert value.item() == pytest.approx((e1 + e2 + e3) / 3, abs=1e-12)
    assert uniformity(z).item() == value.item()  # the default form
    value.backward()
    # dU/dz_k = (1/3) Σ_pairs exp(−d/m)·(−∂d/m + d·∂m/m²), with ∂m through the pair (1, 2) that sets m (its own
    # term d12/m ≡ 1 has no gradient): by hand
    by_hand = np.array([0.5 * e1 + 1.5 * e2, -0.75 * e1 - 2.25 * e2, 0.25 * e1 + 0.75 * e2]) / 3
    np.testing.assert_allclose(z.grad.numpy().ravel(), by_hand, rtol=1e-12)
    # with m detached the middle sample's gradient would be (1/3)(−0.5·e1) instead: the median is NOT detached
    assert abs(by_hand[1] - (-0.5 * e1 / 3)) > 0.1
    wrong = {
        "log of the mean": math.log((e1 + e2 + e3) / 3),
        "sum over pairs": e1 + e2 + e3,
        "m the mean distance": (math.exp(-3 / 14) + math.exp(-27 / 14) + math.exp(-12 / 14)) / 3,
        "distances not squared (m = 2)": (math.exp(-1 / 2) + math.exp(-3 / 2) + math.exp(-1.0)) / 3,
    }
    assert all(abs(v - value.item()) > 1e-3 for v in wrong.values())


def numpy_median_rbf(z: np.ndarray) -> tuple[float, np.ndarray]:
    """U and dU/dz by hand: pairs a < b, m the lower median of the non-zero squared distances (carrying gradient
    through the pair that sets it)."""
    n = len(z)
    a, b = np.triu_indices(n, 1)
    d = ((z[a] - z[b]) ** 2).sum(1)
    nz = np.flatnonzero(d > 0)
    pick = nz[np.argsort(d[nz], kind="stable")[(len(nz) - 1) // 2]]
    m = d[pick]
    k = np.exp(-d / m)
    grad = np.zeros_like(z)
    dm = np.zeros_like(z)
    dm[a[pick]] += 2 * (z[a[pick]] - z[b[pick]])
    dm[b[pick]] -= 2 * (z[a[pick]] - z[b[pick]])
    for p in range(len(d)):
        dd = np.zeros_like(z)
        dd[a[p]] += 2 * (z[a[p]] - z[b[p]])
        dd[b[p]] -= 2 * (z[a[p]] - z[b[p]])
        grad += k[p] * (-dd / m + d[p] * dm / m**2)
    return float(k.mean()), grad / len(d)


def test_median_rbf_uniformity_matches_a_hand_formula_on_random_batches():
    rng = np.random.default_rng(3)
    for n, dim in ((5, 4), (6, 3)):  # 10 pairs (an even count: the lower middle value) and 15
        raw = rng.normal(size=(n, dim))
        zr = torch.tensor(raw, requires_grad=True)
        value = median_rbf_uniformity(zr)
        value.backward()
        want, grad = numpy_median_rbf(raw)
        assert value.item() == pytest.approx(want, rel=1e-12)
        np.testing.assert_allclose(zr.grad.numpy(), grad, rtol=1e-9, atol=1e-12)
        # the data-set bandwidth makes it scale-free (a global scale), unlike a fixed kernel
        assert median_rbf_uniformity(torch.tensor(raw * 7.0)).item() == pytest.approx(want, rel=1e-9)
        # a duplicate row: its zero distance counts in the mean (exp(0) = 1), not in the median
        raw[-1] = raw[0]
        assert median_rbf_uniformity(torch.tensor(raw)).item() == pytest.approx(numpy_median_rbf(raw)[0], rel=1e-12)


def test_median_rbf_uniformity_on_degenerate_batches_and_its_direction():
    one = torch.ones(1, 4, requires_grad=True)
    value = median_rbf_uniformity(one)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(one.grad).all()
    same = torch.ones(3, 4, requires_grad=True)  # no non-zero distance: U = 1, no gradient, nothing NaN
    value = median_rbf_uniformity(same)
    value.backward()
    assert value.item() == 1.0 and torch.equal(same.grad, torch.zeros(3, 4))
    # a descent step moves a close pair apart relative to the batch's spread
    z = torch.tensor([[0.0, 0.0], [0.1, 0.0], [2.0, 1.0], [-1.0, 2.0]], requires_grad=True)
    median_rbf_uniformity(z).backward()
    stepped = (z - 0.5 * z.grad).detach()
    assert median_rbf_uniformity(stepped) < median_rbf_uniformity(z.detach())
    with pytest.raises(ValueError, match="uniformity form"):
        uniformity(z, "log")


def three_by_two_features() -> torch.Tensor:
    # normalised rows: (0.6, 0.8), (0, 1), (−1, 0)
    return torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)


def test_log_gaussian_uniformity_value_by_hand():
    z = three_by_two_features()
    # squared distances of the unit rows: ‖(0.6, −0.2)‖² = 0.4, ‖(1.6, 0.8)‖² = 3.2, ‖(1, 1)‖² = 2
    expected = math.log((math.exp(-2 * 0.4) + math.exp(-2 * 3.2) + math.exp(-2 * 2.0)) / 3)
    assert log_gaussian_uniformity(z, 2.0).item() == pytest.approx(expected, abs=1e-12)
    assert log_gaussian_uniformity(z, 0.5).item() == pytest.approx(
        math.log((math.exp(-0.2) + math.exp(-1.6) + math.exp(-1.0)) / 3), abs=1e-12
    )
    # what a wrong formula would give instead (each differs from the value above)
    wrong = {
        "distance not squared": math.log(
            (math.exp(-2 * 0.4**0.5) + math.exp(-2 * 3.2**0.5) + math.exp(-2 * 2**0.5)) / 3
        ),
        "sum over pairs": math.log(math.exp(-0.8) + math.exp(-6.4) + math.exp(-4.0)),
        "no log": (math.exp(-0.8) + math.exp(-6.4) + math.exp(-4.0)) / 3,
        "sign of the exponent": math.log((math.exp(0.8) + math.exp(6.4) + math.exp(4.0)) / 3),
    }
    assert all(abs(v - expected) > 1e-3 for v in wrong.values())
    # on the sphere: scaling a sample's features changes nothing
    scaled = three_by_two_features().detach() * torch.tensor([[10.0], [0.1], [3.0]], dtype=torch.float64)
    assert log_gaussian_uniformity(scaled, 2.0).item() == pytest.approx(expected, abs=1e-12)


def numpy_uniformity_grad(z: np.ndarray, t: float) -> np.ndarray:
    """dU/dz by hand: U = log M, M = (1/P) Σ_{a<b} exp(−t‖u_a − u_b‖²), u = z/‖z‖."""
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    u = z / norms
    n = len(z)
    pairs = n * (n - 1) / 2
    k = np.exp(-t * ((u[:, None, :] - u[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(k, 0.0)
    m = k[np.triu_indices(n, 1)].sum() / pairs
    # dM/du_a = (1/P) Σ_{b≠a} k_ab · (−2t)(u_a − u_b)
    du = (-2 * t / pairs) * (k.sum(1, keepdims=True) * u - k @ u) / m
    # through the normalisation: dz_a = (I − u_a u_aᵀ) du_a / ‖z_a‖
    return (du - (du * u).sum(1, keepdims=True) * u) / norms


def test_log_gaussian_uniformity_gradient_by_hand_and_its_direction():
    z = three_by_two_features()
    log_gaussian_uniformity(z, 2.0).backward()
    np.testing.assert_allclose(z.grad.numpy(), numpy_uniformity_grad(z.detach().numpy(), 2.0), rtol=1e-9)
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(6, 5))
    zr = torch.tensor(raw, requires_grad=True)
    log_gaussian_uniformity(zr, 0.7).backward()
    np.testing.assert_allclose(zr.grad.numpy(), numpy_uniformity_grad(raw, 0.7), rtol=1e-8, atol=1e-12)
    # a descent step pushes the two closest samples apart (minimising U spreads the features)
    stepped = F.normalize((z - 0.1 * z.grad).detach(), dim=1)
    assert ((stepped[0] - stepped[1]) ** 2).sum() > 0.4


def test_log_gaussian_uniformity_on_one_sample_and_on_identical_samples_is_finite():
    one = torch.ones(1, 4, requires_grad=True)
    value = log_gaussian_uniformity(one, 2.0)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(one.grad).all()
    same = torch.ones(3, 4, requires_grad=True)  # every distance 0: log(mean(1)) = 0
    value = log_gaussian_uniformity(same, 2.0)
    value.backward()
    assert value.item() == pytest.approx(0.0) and torch.isfinite(same.grad).all()


# --------------------------------------------------------------------------- the client's loss


def test_loss_is_ce_plus_the_weighted_terms_on_the_classifiers_input():
    model = build_model("mlp", 10, (1, 8, 8), seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
    with torch.no_grad():
        feats = model.fc2(model.fc1(torch.flatten(x, 1)))  # the MLP's penultimate activations
        logits = model.fc(feats)
        want = (
            F.cross_entropy(logits, y)
            + 2.5 * variance_hinge(logits, iid_threshold(10))
            + 0.5 * median_rbf_uniformity(feats)
        )
        tap = FeatureTap(model)
        loss_fn, sums = feduv_loss(tap, 2.5, 0.5)
        with tap:
            got = loss_fn(model, x, y, None)
            assert torch.equal(tap.features, feats)
        assert tap.features is None and not model.fc._forward_pre_hooks  # the hook is gone after the block
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert float(sums["batches"]) == 1.0
    assert float(sums["uniformity"]) == pytest.approx(median_rbf_uniformity(feats).item(), rel=1e-6)
    with torch.no_grad(), tap:  # the earlier spec's form, by name
        loss_fn, sums = feduv_loss(tap, 2.5, 0.5, LOG_GAUSSIAN, 3.0)
        got = loss_fn(model, x, y, None)
    want = (
        F.cross_entropy(logits, y)
        + 2.5 * variance_hinge(logits, iid_threshold(10))
        + 0.5 * log_gaussian_uniformity(feats, 3.0)
    )
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match="FeatureTap"):
        feduv_loss(None, 0.0, 0.5)


def feduv_message(mu_v: float, mu_u: float, ops_list=(TRAIN_OP,), form: str | None = None, **client):
    """A message of ``ops_list`` with FedUV's settings (no FORM unless ``form``: the default) and ``client`` over the
    client settings."""
    own = {MU_V: mu_v, MU_U: mu_u, TEMPERATURE: 2.0, **({FORM: form} if form else {})}
    return worker_message(
        list(ops_list),
        returns=protocol.Return(arrays=True),
        client=client,
        training=train_settings(extra=own),
        arrays={k: v.numpy() for k, v in build_model("mlp", 10, (1, 8, 8), seed=0).state_dict().items()},
    )


def reply_arrays(mu_v: float, mu_u: float, ops_list=(TRAIN_OP,)):
    grid, msg = feduv_message(mu_v, mu_u, ops_list)
    reply = Worker(msg, grid.contexts[100]).run()
    return {k: v.numpy() for k, v in reply.content[ARRAYS].items()}, dict(reply.content[protocol.METRICS])


def test_at_zero_coefficients_the_client_step_is_fedavgs_to_the_bit():
    plain, plain_metrics = reply_arrays(0.0, 0.0, ops_list=("train",))
    zero, zero_metrics = reply_arrays(0.0, 0.0)
    assert all(np.array_equal(plain[k], zero[k]) for k in plain)
    assert zero_metrics["train-loss"] == plain_metrics["train-loss"]
    assert VARIANCE not in zero_metrics and UNIFORMITY not in zero_metrics
    for mu_v, mu_u in ((1.0, 0.0), (0.0, 1.0)):  # either term on changes the step
        moved, metrics = reply_arrays(mu_v, mu_u)
        assert not all(np.array_equal(plain[k], moved[k]) for k in plain)
        assert (VARIANCE in metrics) == (mu_v > 0) and (UNIFORMITY in metrics) == (mu_u > 0)


def terms_after_training(mu_v: float, mu_u: float, form: str | None = None) -> tuple[float, float]:
    """V on the client's whole training split (IID digits) and U (in ``form``; None: the default form, also for
    training) as a mean over the split's batches of the training batch size (U is a per-batch term: its median
    bandwidth is the batch's), for the model after 3 local epochs."""
    grid, msg = feduv_message(mu_v, mu_u, form=form, epochs=3)
    w = Worker(msg, grid.contexts[100])
    w.run()
    model, batch = w.model.eval(), 16  # worker_message's client.batch_size
    with torch.no_grad(), FeatureTap(model) as tap:
        v = variance_hinge(model(w.train_x), iid_threshold(10)).item()
        u = []
        for start in range(0, len(w.train_x) - batch + 1, batch):
            model(w.train_x[start : start + batch])
            u.append(uniformity(tap.features, form or MEDIAN_RBF).item())
    return v, float(np.mean(u))


def test_each_term_moves_local_training_its_way():
    v0, u0 = terms_after_training(0.0, 0.0)
    v1, _ = terms_after_training(5.0, 0.0)
    _, u1 = terms_after_training(0.0, 2.0)
    _, g0 = terms_after_training(0.0, 0.0, LOG_GAUSSIAN)
    _, g1 = terms_after_training(0.0, 5.0, LOG_GAUSSIAN)
    # measured: V 0.190 -> 0.128; median-rbf U 0.394 -> 0.376 (half the pairs lie within the median, so U >=
    # exp(-1)/2 whatever the spread: the term has little room and mainly punishes pairs far closer than the
    # batch's typical distance); log-gaussian U -0.97 -> -2.44
    assert v1 < v0 - 0.03  # the class probabilities vary more over the batch
    assert u1 < u0 - 0.01  # no pair of samples much closer than the batch's typical distance
    assert g1 < g0 - 0.5  # the normalised features are spread more uniformly over the sphere


# found by `make mutate`
def test_feduv_terms_on_a_batch_of_two_and_of_one() -> None:
    """Two samples are enough for both terms (a batch of 2 has a variance and one pair); one sample gives 0, not
    the logits' sum."""
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
    model = build_model("mlp", 10, (1, 8, 8), seed=0)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)


# found by `make mutate`
def test_feduv_loss_computes_only_the_terms_that_are_on_and_sums_them_over_batches() -> None:
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


# found by `make mutate`
def test_feduv_loss_adds_the_other_training_terms_evaluated_on_the_model() -> None:
    model, x, y = feduv_batch()
    regulariser = lambda m: (m.fc.weight**2).sum()  # noqa: E731
    with torch.no_grad():
        ce = F.cross_entropy(model(x), y)
        loss_fn, _ = feduv_loss(None, 0.0, 0.0, regulariser=regulariser)
        assert loss_fn(model, x, y, None).item() == pytest.approx((ce + regulariser(model)).item(), rel=1e-6)


# --------------------------------------------------------------------------- the strategy


def test_params_are_declared_and_checked(tiny_config):
    cfg = load_config(tiny_config(strategy={"name": "feduv"}))
    params = resolve(cfg).params
    assert (params.mu_v, params.mu_u, params.uniformity, params.t) == (2.5, 0.5, MEDIAN_RBF, 2.0)
    for bad in ({"mu_v": -1.0}, {"t": 0.0}, {"uniformity": "log"}):
        with pytest.raises(ConfigError, match=f"strategy.params.feduv.{next(iter(bad))}"):
            resolve(load_config(tiny_config(strategy={"name": "feduv", "params": {"feduv": bad}})))


def run_inprocess(tiny_config, name: str, params: dict | None = None):
    strategy = {"name": name, "params": {name: params}} if params else {"name": name}
    cfg = load_config(tiny_config(rounds=2, strategy=strategy))
    s = resolve(cfg).build(cfg)
    grid = InProcessGrid(cfg.data.num_clients, record=True)
    return s, grid, RoundDriver(s).start(grid)


def test_feduv_at_zero_is_fedavg_and_otherwise_sends_its_settings(tiny_config):
    _, _, zero = run_inprocess(tiny_config, "feduv", {"mu_v": 0.0, "mu_u": 0.0})
    _, _, avg = run_inprocess(tiny_config, "fedavg")
    for k in avg.arrays:
        np.testing.assert_array_equal(zero.arrays[k].numpy(), avg.arrays[k].numpy())
    assert zero.evaluate_metrics_clientapp[1]["acc_mean"] == avg.evaluate_metrics_clientapp[1]["acc_mean"]
    s, grid, result = run_inprocess(tiny_config, "feduv", {"mu_v": 1.0, "mu_u": 0.25})
    sent = [protocol.request_of(m) for m in grid.sent if m.metadata.message_type == protocol.MESSAGE_TYPE]
    own = [r.training.section(protocol.TRAIN).extra for r in sent]
    assert all(TRAIN_OP in r.ops for r in sent)
    assert all(e[MU_V] == 1.0 and e[MU_U] == 0.25 and e[FORM] == MEDIAN_RBF for e in own)
    extras = result.train_metrics_clientapp[2]
    assert (
        0.0 <= extras["feduv_variance"] <= iid_threshold(10) and math.exp(-1) / 2 <= extras["feduv_uniformity"] <= 1.0
    )
    s, grid, result = run_inprocess(tiny_config, "feduv", {"uniformity": LOG_GAUSSIAN, "t": 3.0})
    assert all(
        r.training.section(protocol.TRAIN).extra[FORM] == LOG_GAUSSIAN
        and r.training.section(protocol.TRAIN).extra[TEMPERATURE] == 3.0
        for r in (protocol.request_of(m) for m in grid.sent if m.metadata.message_type == protocol.MESSAGE_TYPE)
    )
    assert result.train_metrics_clientapp[2]["feduv_uniformity"] <= 0.0  # a log of a mean of values <= 1
    assert not all(np.array_equal(result.arrays[k].numpy(), avg.arrays[k].numpy()) for k in avg.arrays)


@pytest.mark.heavy
def test_end_to_end_through_flowers_wire_format(tmp_path):
    """2 rounds of FedUV on digits, 3 clients, every message, reply and node Context through Flower's protobuf
    encoding (:func:`conftest.wire_run`; the Ray path itself: test_cli_e2e.py)."""
    from conftest import wire_run

    out = wire_run(
        tmp_path,
        strategy={"name": "feduv"},
        data={"source": "digits", "partition": "pathological", "num_clients": 3, "classes_per_client": 4},
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "feduv" and summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [3, 3]
    assert all(isinstance(r["feduv_variance"], float) and isinstance(r["feduv_uniformity"], float) for r in rows)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """FedUV's deployed model after round rnd: the global model aggregated in that round."""
    return evaluate(tensors(s.global_arrays), data)


DEPLOYED_BY_HAND = {"feduv": deployed_by_hand}
