"""cwFedAvg: the mixing maths against explicit computations, exact layer matching, the estimators, WDR's
gradient, and end-to-end runs on the in-process grid (partial participation, a dropped client)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from torch import nn

from fedapps.config import ConfigError, load_config
from fedapps.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.protocol import ClientReply
from strategies import resolve
from strategies.base import weighted_average
from strategies.cwfedavg import (
    CwFedAvg,
    class_distribution_from_rows,
    wdr_penalty,
    class_models,
    class_weights,
    classwise_keys,
    fedavg_weights,
    mix,
    mixing_matrix,
    row_norm_distribution,
)

torch.set_num_threads(1)

BASE = "strategy.name=cwfedavg data.source=digits model.name=cnn client.lr=0.05"


def make_strategy(overrides: str = "", clients: int = 6) -> CwFedAvg:
    cfg = load_config(None, f"{BASE} data.num_clients={clients} strategy.params.cwfedavg.track_estimation_error=false {overrides}")
    return CwFedAvg(cfg)


def perturbed(base: dict[str, np.ndarray], seed: int, scale: float = 0.1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}


def reply(cid: int, arrays: dict[str, np.ndarray], counts: np.ndarray) -> ClientReply:
    metrics = {"client-id": cid, "num-examples": int(counts.sum()), "class-counts": [int(c) for c in counts]}
    return ClientReply(node_id=100 + cid, client_id=cid, num_examples=int(counts.sum()), metrics=metrics, arrays=arrays)


def explicit_personalised(models: list[dict[str, np.ndarray]], n: np.ndarray, p: np.ndarray, i: int,
                          classwise: list[str]) -> dict[str, np.ndarray]:
    """The K-model computation: class models w_j = Σ_l q_lj w_l, then w_i = Σ_j p_ij w_j; FedAvg elsewhere."""
    k = p.shape[1]
    out = weighted_average(models, list(n))
    for key in classwise:
        class_model = []
        for j in range(k):
            q = n * p[:, j]
            q = q / q.sum() if q.sum() > 0 else n / n.sum()
            class_model.append(sum(q[l] * models[l][key].astype(np.float64) for l in range(len(models))))
        out[key] = sum(p[i, j] * class_model[j] for j in range(k))
    return out


# --------------------------------------------------------------------------- pure maths


def test_mixing_matrix_rows_are_convex_and_match_class_models():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 50, 7).astype(float)
    p = rng.dirichlet(np.ones(5) * 0.3, 7)
    stack = rng.standard_normal((7, 3, 4)).astype(np.float32)
    q = class_weights(n, p)
    a = mixing_matrix(p, q)
    assert np.allclose(a.sum(axis=1), 1.0)
    np.testing.assert_allclose(mix(a, stack), np.einsum("ij,jab->iab", p, class_models(q, stack)), atol=1e-5)


def test_iid_limit_is_fedavg():
    rng = np.random.default_rng(1)
    n = rng.integers(5, 60, 8).astype(float)
    p = np.tile(rng.dirichlet(np.ones(10)), (8, 1))  # p_ij = p_j for every client
    stack = rng.standard_normal((8, 50)).astype(np.float32)
    a = mixing_matrix(p, class_weights(n, p))
    np.testing.assert_allclose(a, np.tile(fedavg_weights(n), (8, 1)), atol=1e-12)
    fedavg = weighted_average([{"w": s} for s in stack], list(n))["w"]
    for i in range(8):
        np.testing.assert_allclose(mix(a[i], stack), fedavg, atol=1e-6)


def test_one_class_per_client_is_per_class_fedavg():
    rng = np.random.default_rng(2)
    labels = np.array([0, 1, 0, 2, 1, 0])
    n = rng.integers(5, 60, 6).astype(float)
    p = np.eye(3)[labels]
    stack = rng.standard_normal((6, 9)).astype(np.float32)
    a = mixing_matrix(p, class_weights(n, p))
    for i, c in enumerate(labels):
        same = labels == c
        expected = (n[same, None] * stack[same]).sum(0) / n[same].sum()
        np.testing.assert_allclose(mix(a[i], stack), expected, atol=1e-6)


def test_class_nobody_holds_falls_back_to_fedavg_weights():
    n = np.array([10.0, 30.0])
    p = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    q = class_weights(n, p)
    np.testing.assert_allclose(q[:, 2], [0.25, 0.75])
    np.testing.assert_allclose(q.sum(0), 1.0)


def test_row_norm_distribution():
    w = np.zeros((4, 3))
    w[0, 0], w[1, :2], w[2, 2], w[3] = 3.0, [3.0, 4.0], 2.0, 0.0  # norms 3, 5, 2, 0
    np.testing.assert_allclose(row_norm_distribution(w), [0.3, 0.5, 0.2, 0.0])
    t = torch.randn(10, 16)
    np.testing.assert_allclose(row_norm_distribution(t.numpy()), class_distribution_from_rows(t).numpy(), atol=1e-6)


def test_wdr_gradient_reaches_only_the_classifier_weight():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    target = torch.zeros(10)
    target[:2] = 0.5
    wdr_penalty(model.fc.weight, target, 10.0).backward()
    for name, param in model.named_parameters():
        if name == "fc.weight":
            assert param.grad is not None and param.grad.abs().sum() > 0
        else:
            assert param.grad is None or param.grad.abs().sum() == 0, name


def test_layers_are_matched_by_exact_name():
    model = build_model("cnn", 10, (1, 28, 28))  # children conv1, conv2, fc1, fc: 'fc' is a prefix of 'fc1'
    assert classwise_keys(model, "output") == ["fc.weight", "fc.bias"]
    assert classwise_keys(model, "last-1") == ["fc.weight", "fc.bias"]
    assert classwise_keys(model, "last-2") == ["fc1.0.weight", "fc1.0.bias", "fc.weight", "fc.bias"]
    assert len(classwise_keys(model, "all")) == len(list(model.parameters()))

    class Net(nn.Module):  # the head is registered before a layer whose name extends it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.fc1 = nn.Linear(4, 4)

    net = Net()
    net._fedapps_classifier = "fc"
    assert classwise_keys(net, "output") == ["fc.weight", "fc.bias"]
    with pytest.raises(ConfigError, match="last-3"):
        classwise_keys(net, "last-3")


@pytest.mark.parametrize("bad, match", [("layers=last-0", "last-N"), ("layers=head", "allowed"),
                                        ("estimator=oracle", "estimator"), ("wdr_lambda=-1", "wdr_lambda"),
                                        ("mix=all", "mix"), ("buffers=shared", "buffers"), ("lamda=3", "unknown key")])
def test_params_are_validated(bad, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(None, f"{BASE} strategy.params.cwfedavg.{bad}"))


# --------------------------------------------------------------------------- the strategy's aggregation


@pytest.mark.parametrize("layers", ["output", "last-2", "all"])
def test_personalised_models_equal_explicit_k_model_computation(layers):
    s = make_strategy(f"strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.layers={layers}")
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 20, (6, 10)) * (rng.random((6, 10)) < 0.5)
    counts[:, 0] += 1
    models = [perturbed(s.initial, seed=i) for i in range(6)]
    s.aggregate(1, [reply(i, models[i], counts[i]) for i in range(6)])
    p = counts / counts.sum(1, keepdims=True)
    n = counts.sum(1).astype(float)
    for i in range(6):
        ours = s.personalised(i)
        ref = explicit_personalised(models, n, p, i, s.classwise)
        assert set(ours) == set(s.keys)
        for key in s.keys:
            np.testing.assert_allclose(ours[key], ref[key], atol=1e-5, err_msg=f"{layers} {key}")
    fedavg = weighted_average(models, list(n))
    for key in s.keys:  # a client the server has never seen gets the FedAvg model
        np.testing.assert_allclose(s.personalised(None)[key], fedavg[key], atol=1e-6)
        np.testing.assert_allclose(s.personalised(99)[key], fedavg[key], atol=1e-6)


def test_strategy_iid_limit_is_fedavg():
    s = make_strategy("strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.layers=all")
    counts = np.array([[3] * 10, [6] * 10, [1] * 10, [2] * 10, [5] * 10, [4] * 10])
    models = [perturbed(s.initial, seed=10 + i) for i in range(6)]
    s.aggregate(1, [reply(i, models[i], counts[i]) for i in range(6)])
    fedavg = weighted_average(models, list(counts.sum(1)))
    for i in range(6):
        for key, value in s.personalised(i).items():
            np.testing.assert_allclose(value, fedavg[key], atol=1e-6)


def test_buffers_stay_local_by_default():
    s = make_strategy("model.name=resnet18 data.source=synthetic data.synthetic_shape=[3,8,8]", clients=2)
    assert all("running_" not in k and "num_batches" not in k for k in s.keys)
    s2 = make_strategy("model.name=resnet18 data.source=synthetic data.synthetic_shape=[3,8,8] "
                       "strategy.params.cwfedavg.buffers=fedavg", clients=2)
    assert any("running_mean" in k for k in s2.keys)


def test_partial_mix_round_uses_only_repliers():
    s = make_strategy("strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.mix=round strategy.params.cwfedavg.layers=all")
    counts = np.eye(10, dtype=int)[[0, 1, 0, 1, 2, 2]] * 10
    models = [perturbed(s.initial, seed=20 + i) for i in range(6)]
    s.aggregate(1, [reply(i, models[i], counts[i]) for i in range(6)])
    s.aggregate(2, [reply(i, models[i], counts[i]) for i in (0, 1, 4)])  # 2, 3, 5 did not reply
    key = s.classwise[0]
    np.testing.assert_allclose(s.personalised(2)[key], models[0][key], atol=1e-6)  # class 0: only client 0 replied
    s_latest = make_strategy("strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.layers=all")
    s_latest.aggregate(1, [reply(i, models[i], counts[i]) for i in range(6)])
    s_latest.aggregate(2, [reply(i, models[i], counts[i]) for i in (0, 1, 4)])
    np.testing.assert_allclose(s_latest.personalised(2)[key], (models[0][key] + models[2][key]) / 2, atol=1e-6)


# --------------------------------------------------------------------------- end to end (in-process grid)


def run(tmp_path, overrides: str, clients: int = 8, drop=None) -> tuple[dict, list[dict]]:
    import server_app

    ov = f"{BASE} data.num_clients={clients} data.partition=pathological data.classes_per_client=2 {overrides}"
    cfg = load_config(None, ov)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("{}\n")
    summary = server_app.run_experiment(InProcessGrid(clients, drop=drop), str(cfg_path), ov, str(tmp_path))
    with open(tmp_path / cfg.resolved_run_name() / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    return summary, rows


def test_bias_estimator_recovers_p_in_round_one(tmp_path):
    summary, rows = run(tmp_path, "rounds=1 strategy.params.cwfedavg.estimator=bias")
    assert float(rows[0]["est_l1_bias"]) < 0.15
    assert float(rows[0]["est_l1_norm"]) > 3 * float(rows[0]["est_l1_bias"])
    assert float(rows[0]["est_l1"]) == float(rows[0]["est_l1_bias"])
    for col in ("acc_mean", "acc_weighted", "acc_after_training_mean", "acc_after_training_weighted"):
        assert rows[0][col] != ""
    assert (tmp_path / summary["run_name"] / "weight_norms.png").is_file()
    assert (tmp_path / summary["run_name"] / "estimates.csv").is_file()
    assert json.loads((tmp_path / summary["run_name"] / "summary.json").read_text())["cwfedavg"]["estimator"] == "bias"


def test_true_estimator_is_exact(tmp_path):
    _, rows = run(tmp_path, "rounds=1 strategy.params.cwfedavg.estimator=true")
    assert float(rows[0]["est_l1"]) < 1e-9


def test_partial_participation_and_a_dropped_client(tmp_path):
    dropped = lambda rnd, pid: rnd == 2 and pid == 3  # noqa: E731
    summary, rows = run(tmp_path, "rounds=2 strategy.fraction=0.5 strategy.params.cwfedavg.estimator=norm strategy.params.cwfedavg.wdr_lambda=10", clients=6, drop=dropped)
    assert summary["rounds"] == 2
    assert all(int(r["clients"]) <= 3 for r in rows)
    _, rows = run(tmp_path, "rounds=2 run_name=drop strategy.params.cwfedavg.mix=round", clients=6, drop=dropped)
    assert [int(r["clients"]) for r in rows] == [6, 5]


def test_dropped_client_keeps_its_estimate():
    s = make_strategy("strategy.params.cwfedavg.estimator=true")
    counts = np.eye(10, dtype=int)[[0, 1, 2, 3, 4, 5]] * 7
    models = [perturbed(s.initial, seed=30 + i) for i in range(6)]
    s.aggregate(1, [reply(i, models[i], counts[i]) for i in range(6)])
    s.aggregate(2, [reply(i, models[i], counts[i]) for i in range(5)])
    row = s.stack.row_of[5]
    assert s.estimated[row] and np.argmax(s.p_hat[row]) == 5
    np.testing.assert_allclose(s.personalised(5)["fc.weight"], models[5]["fc.weight"], atol=1e-6)
