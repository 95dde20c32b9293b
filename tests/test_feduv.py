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

from fedapps import protocol
from fedapps.config import ConfigError, load_config
from fedapps.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.protocol import ARRAYS
from fedapps.results import read_csv
from fedapps.worker import Worker
from strategies import resolve
from strategies.feduv import (MU_U, MU_V, TEMPERATURE, TRAIN_OP, UNIFORMITY, VARIANCE, FeatureTap, feduv_loss,
                              iid_threshold, uniformity, variance_hinge)
from test_ops_worker import worker_message

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
    s = np.sqrt((dev ** 2).sum(0) / (b - 1) + eps)
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


def three_by_two_features() -> torch.Tensor:
    # normalised rows: (0.6, 0.8), (0, 1), (−1, 0)
    return torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)


def test_uniformity_value_by_hand():
    z = three_by_two_features()
    # squared distances of the unit rows: ‖(0.6, −0.2)‖² = 0.4, ‖(1.6, 0.8)‖² = 3.2, ‖(1, 1)‖² = 2
    expected = math.log((math.exp(-2 * 0.4) + math.exp(-2 * 3.2) + math.exp(-2 * 2.0)) / 3)
    assert uniformity(z, t=2.0).item() == pytest.approx(expected, abs=1e-12)
    assert uniformity(z, t=0.5).item() == pytest.approx(
        math.log((math.exp(-0.2) + math.exp(-1.6) + math.exp(-1.0)) / 3), abs=1e-12)
    # what a wrong formula would give instead (each differs from the value above)
    wrong = {"distance not squared": math.log((math.exp(-2 * 0.4 ** 0.5) + math.exp(-2 * 3.2 ** 0.5)
                                               + math.exp(-2 * 2 ** 0.5)) / 3),
             "sum over pairs": math.log(math.exp(-0.8) + math.exp(-6.4) + math.exp(-4.0)),
             "no log": (math.exp(-0.8) + math.exp(-6.4) + math.exp(-4.0)) / 3,
             "sign of the exponent": math.log((math.exp(0.8) + math.exp(6.4) + math.exp(4.0)) / 3)}
    assert all(abs(v - expected) > 1e-3 for v in wrong.values())
    # on the sphere: scaling a sample's features changes nothing
    scaled = three_by_two_features().detach() * torch.tensor([[10.0], [0.1], [3.0]], dtype=torch.float64)
    assert uniformity(scaled, 2.0).item() == pytest.approx(expected, abs=1e-12)


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


def test_uniformity_gradient_by_hand_and_its_direction():
    z = three_by_two_features()
    uniformity(z, t=2.0).backward()
    np.testing.assert_allclose(z.grad.numpy(), numpy_uniformity_grad(z.detach().numpy(), 2.0), rtol=1e-9)
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(6, 5))
    zr = torch.tensor(raw, requires_grad=True)
    uniformity(zr, t=0.7).backward()
    np.testing.assert_allclose(zr.grad.numpy(), numpy_uniformity_grad(raw, 0.7), rtol=1e-8, atol=1e-12)
    # a descent step pushes the two closest samples apart (minimising U spreads the features)
    stepped = F.normalize((z - 0.1 * z.grad).detach(), dim=1)
    assert ((stepped[0] - stepped[1]) ** 2).sum() > 0.4


def test_uniformity_on_one_sample_and_on_identical_samples_is_finite():
    one = torch.ones(1, 4, requires_grad=True)
    value = uniformity(one, 2.0)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(one.grad).all()
    same = torch.ones(3, 4, requires_grad=True)  # every distance 0: log(mean(1)) = 0
    value = uniformity(same, 2.0)
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
        want = (F.cross_entropy(logits, y) + 2.5 * variance_hinge(logits, iid_threshold(10))
                + 0.5 * uniformity(feats, 2.0))
        tap = FeatureTap(model)
        loss_fn, sums = feduv_loss(tap, 2.5, 0.5, 2.0)
        with tap:
            got = loss_fn(model, x, y, None)
            assert torch.equal(tap.features, feats)
        assert tap.features is None and not model.fc._forward_pre_hooks  # the hook is gone after the block
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert float(sums["batches"]) == 1.0
    assert float(sums["uniformity"]) == pytest.approx(uniformity(feats, 2.0).item(), rel=1e-6)
    with pytest.raises(ValueError, match="FeatureTap"):
        feduv_loss(None, 0.0, 0.5, 2.0)


def feduv_message(mu_v: float, mu_u: float, ops_list=(TRAIN_OP,), **extra):
    settings = {MU_V: mu_v, MU_U: mu_u, TEMPERATURE: 2.0, "return-arrays": True, **extra}
    return worker_message(list(ops_list), settings, arrays=protocol.arrays_record(
        {k: v.numpy() for k, v in build_model("mlp", 10, (1, 8, 8), seed=0).state_dict().items()}))


def reply_arrays(mu_v: float, mu_u: float, ops_list=(TRAIN_OP,)):
    grid, msg = feduv_message(mu_v, mu_u, ops_list)
    reply = Worker(msg, grid.contexts[100]).run()
    return {k: v.numpy() for k, v in reply.content[ARRAYS].items()}, dict(reply.content["metrics"])


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


def terms_after_training(mu_v: float, mu_u: float) -> tuple[float, float]:
    """V and U of the model after 3 local epochs, on the client's training split (IID digits)."""
    grid, msg = feduv_message(mu_v, mu_u, **{"client.epochs": 3})
    w = Worker(msg, grid.contexts[100])
    w.run()
    model = w.model.eval()
    with torch.no_grad(), FeatureTap(model) as tap:
        logits = model(w.train_x)
        return variance_hinge(logits, iid_threshold(10)).item(), uniformity(tap.features, 2.0).item()


def test_each_term_moves_local_training_its_way():
    v0, u0 = terms_after_training(0.0, 0.0)
    v1, _ = terms_after_training(5.0, 0.0)
    _, u1 = terms_after_training(0.0, 5.0)
    # measured: V 0.190 -> 0.128, U -0.97 -> -2.44
    assert v1 < v0 - 0.03  # the class probabilities vary more over the batch
    assert u1 < u0 - 0.5  # the features are spread more uniformly over the sphere


# --------------------------------------------------------------------------- the strategy


def test_params_are_declared_and_checked(tiny_config):
    cfg = load_config(tiny_config(strategy={"name": "feduv"}))
    params = resolve(cfg).params
    assert (params.mu_v, params.mu_u, params.t) == (2.5, 0.5, 2.0)
    for bad in ({"mu_v": -1.0}, {"t": 0.0}):
        with pytest.raises(ConfigError, match=f"strategy.params.feduv.{next(iter(bad))}"):
            resolve(load_config(tiny_config(strategy={"name": "feduv", "params": {"feduv": bad}})))


def run_inprocess(tiny_config, name: str, params: dict | None = None):
    strategy = {"name": name, "params": {name: params}} if params else {"name": name}
    cfg = load_config(tiny_config(rounds=2, strategy=strategy))
    s = resolve(cfg).build(cfg)
    grid = InProcessGrid(cfg.data.num_clients, record=True)
    return s, grid, s.start(grid)


def test_feduv_at_zero_is_fedavg_and_otherwise_sends_its_settings(tiny_config):
    _, _, zero = run_inprocess(tiny_config, "feduv", {"mu_v": 0.0, "mu_u": 0.0})
    _, _, avg = run_inprocess(tiny_config, "fedavg")
    for k in avg.arrays:
        np.testing.assert_array_equal(zero.arrays[k].numpy(), avg.arrays[k].numpy())
    assert zero.evaluate_metrics_clientapp[1]["acc_mean"] == avg.evaluate_metrics_clientapp[1]["acc_mean"]
    s, grid, result = run_inprocess(tiny_config, "feduv", {"mu_v": 1.0, "mu_u": 0.25, "t": 3.0})
    assert all(TRAIN_OP in m.content["config"]["ops"] and m.content["config"][MU_V] == 1.0
               and m.content["config"][MU_U] == 0.25 and m.content["config"][TEMPERATURE] == 3.0
               for m in grid.sent if m.metadata.message_type == "train")
    extras = result.train_metrics_clientapp[2]
    assert 0.0 <= extras["feduv_variance"] <= iid_threshold(10) and extras["feduv_uniformity"] <= 0.0
    assert not all(np.array_equal(result.arrays[k].numpy(), avg.arrays[k].numpy()) for k in avg.arrays)


@pytest.mark.heavy
def test_flwr_run_end_to_end(tmp_path):
    """`fedapps run` -> `flwr run` (own SuperLink, Ray simulation, 3 SuperNodes, 2 rounds of FedUV on digits)."""
    from conftest import flwr_run

    out = flwr_run(tmp_path, strategy={"name": "feduv"},
                   data={"source": "digits", "partition": "pathological", "num_clients": 3, "classes_per_client": 4})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "feduv" and summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [3, 3]
    assert all(isinstance(r["feduv_variance"], float) and isinstance(r["feduv_uniformity"], float) for r in rows)
