"""cwFedAvg: the mixing maths against explicit computations, exact layer matching, the estimators, WDR's
gradient, and end-to-end runs on the in-process grid (partial participation, a dropped client)."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from deployed_toy import evaluate, private, tensors
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.server.aggregation import weighted_average
from fedapps.server.strategy import RunContext
from fedapps.wire.protocol import CLIENT_ID, NUM_EXAMPLES, ClientReply
from strategies import resolve
from strategies.cwfedavg import (
    CLASS_COUNTS,
    CwFedAvg,
    SavedStack,
    bias_evidence,
    class_distribution_from_rows,
    class_models,
    class_weights,
    classwise_keys,
    fedavg_weights,
    l1_error,
    mix,
    mixing_matrix,
    normalise_rows,
    row_norm_distribution,
    wdr_penalty,
)

torch.set_num_threads(1)

BASE = "strategy.name=cwfedavg data.source=digits model.name=cnn client.lr=0.05"


def make_strategy(overrides: str = "", clients: int = 6, context: RunContext | None = None) -> CwFedAvg:
    cfg = load_config(
        None, f"{BASE} data.num_clients={clients} strategy.params.cwfedavg.track_estimation_error=false {overrides}"
    )
    return CwFedAvg(cfg, context=context)


def perturbed(base: dict[str, np.ndarray], seed: int, scale: float = 0.1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}


def reply(cid: int, arrays: dict[str, np.ndarray], counts: np.ndarray) -> ClientReply:
    metrics = {CLIENT_ID: cid, NUM_EXAMPLES: int(counts.sum()), CLASS_COUNTS: [int(c) for c in counts]}
    return ClientReply(node_id=100 + cid, client_id=cid, num_examples=int(counts.sum()), metrics=metrics, arrays=arrays)


def explicit_personalised(
    models: list[dict[str, np.ndarray]], n: np.ndarray, p: np.ndarray, i: int, classwise: list[str]
) -> dict[str, np.ndarray]:
    """The K-model computation: class models w_j = Σ_l q_lj w_l, then w_i = Σ_j p_ij w_j; FedAvg elsewhere."""
    k = p.shape[1]
    out = weighted_average(models, list(n))
    for key in classwise:
        class_model = []
        for j in range(k):
            q = n * p[:, j]
            q = q / q.sum() if q.sum() > 0 else n / n.sum()
            class_model.append(sum(q[c] * models[c][key].astype(np.float64) for c in range(len(models))))
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


@pytest.mark.parametrize(
    "bad, match",
    [
        ("layers=last-0", "last-N"),
        ("layers=head", "allowed"),
        ("estimator=oracle", "estimator"),
        ("wdr_lambda=-1", "wdr_lambda"),
        ("mix=all", "mix"),
        ("buffers=shared", "buffers"),
        ("lamda=3", "unknown key"),
    ],
)
def test_params_are_validated(bad, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(None, f"{BASE} strategy.params.cwfedavg.{bad}"))


# --------------------------------------------------------------------------- pure maths: edges (found by `make mutate`)


def test_bias_evidence_and_l1_error_by_hand() -> None:
    sent = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    uploaded = np.array([0.8, -1.5, 2.0, 0.25], np.float32)
    # only the classes whose bias went UP count, by how much
    np.testing.assert_allclose(bias_evidence(uploaded, sent), [0.3, 0.0, 0.0, 0.25], atol=1e-7)
    assert bias_evidence(uploaded, sent).dtype == np.float64
    p_hat = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    p_true = np.array([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    assert l1_error(p_hat, p_true) == pytest.approx((1.0 + 2.0) / 2)  # Σ_j |p̂ − p| per client, mean over clients


def test_normalise_rows_zero_rows_small_sums_and_dtype() -> None:
    x = np.array([[0.2, 0.3, 0.0], [0.0, 0.0, 0.0], [2.0, 6.0, 0.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-zero row must not divide by zero
        out = normalise_rows(x)
    np.testing.assert_allclose(out, [[0.4, 0.6, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.75, 0.0]], rtol=1e-6)
    assert out.dtype == np.float64


def test_fedavg_and_class_weights_with_masks_and_small_counts() -> None:
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
    stack = np.array([[1.0, 2.0], [3.0, 6.0]], np.float32)
    out = mix(np.array([0.25, 0.75]), stack)
    assert out.dtype == np.float32  # float64 weights do not upcast (and double) the personalised models
    np.testing.assert_allclose(out, [2.5, 5.0])
    np.testing.assert_allclose(mix(np.array([0.5, 0.5]), np.array([[2], [5]])), [3.5])  # not truncated to int
    a = mixing_matrix(np.array([[1.0, 0.0]], np.float32), np.array([[0.5, 0.5], [0.5, 0.5]], np.float32))
    assert a.dtype == np.float64


def test_row_norm_distribution_of_small_rows() -> None:
    np.testing.assert_allclose(
        class_distribution_from_rows(torch.tensor([[0.1, 0.0], [0.0, 0.3]])).numpy(), [0.25, 0.75], rtol=1e-6
    )


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


@pytest.mark.heavy
def test_buffers_stay_local_by_default():
    s = make_strategy("model.name=resnet18 data.source=synthetic data.synthetic_shape=[3,8,8]", clients=2)
    assert all("running_" not in k and "num_batches" not in k for k in s.keys)
    s2 = make_strategy(
        "model.name=resnet18 data.source=synthetic data.synthetic_shape=[3,8,8] "
        "strategy.params.cwfedavg.buffers=fedavg",
        clients=2,
    )
    assert any("running_mean" in k for k in s2.keys)


def test_partial_mix_round_uses_only_repliers():
    s = make_strategy(
        "strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.mix=round strategy.params.cwfedavg.layers=all"
    )
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


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_partial_participation_and_a_dropped_client(tmp_path):
    dropped = lambda rnd, pid: rnd == 2 and pid == 3  # noqa: E731
    summary, rows = run(
        tmp_path,
        "rounds=2 strategy.fraction=0.5 strategy.params.cwfedavg.estimator=norm strategy.params.cwfedavg.wdr_lambda=10",
        clients=6,
        drop=dropped,
    )
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


# --------------------------------------------------------------------------- server state: O(F + M·C), not M models


class TinyBN(nn.Module):
    """A model small enough for many rounds in a test, with BatchNorm (float and integer buffers)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.fc1 = nn.Linear(4, 6)
        self.fc = nn.Linear(6, num_classes)
        self._fedapps_classifier = "fc"


def tiny_strategy(monkeypatch, overrides: str, clients: int, context: RunContext | None = None) -> CwFedAvg:
    from strategies import cwfedavg

    monkeypatch.setattr(cwfedavg, "_build", lambda cfg, stand_in=False: TinyBN(10))
    return make_strategy(f"strategy.params.cwfedavg.estimator=true {overrides}", clients=clients, context=context)


def reference_personalised(
    latest: dict[int, tuple[dict[str, np.ndarray], np.ndarray]],
    mixed: list[int],
    last: int,
    cid: int,
    classwise: list[str],
) -> dict[str, np.ndarray]:
    """Whole models kept, in float64: FedAvg of the shared float keys over the clients ``mixed``, integer keys
    from the last replier ``last``, and for the class-wise keys client ``cid``'s row of A = P Qᵀ
    (q_lj = n_l p_lj / Σ_m n_m p_mj over ``mixed``; FedAvg weights for a class nobody in it holds; a client
    never seen gets the FedAvg weights). ``latest[c]`` = (c's latest upload, its latest class counts)."""
    counts = np.array([latest[c][1] for c in mixed], dtype=np.float64)
    n = counts.sum(axis=1)
    fed = n / n.sum()
    mass = counts  # n_l p_lj = n_lj
    q = np.where(mass.sum(0) > 0, mass / np.maximum(mass.sum(0), 1e-300), fed[:, None])
    a = fed if cid not in latest else (latest[cid][1] / latest[cid][1].sum()) @ q.T
    out = {}
    for key, first in latest[mixed[0]][0].items():
        stacked = np.stack([latest[c][0][key].astype(np.float64) for c in mixed])
        if not np.issubdtype(first.dtype, np.floating):
            out[key] = latest[last][0][key]
        else:
            out[key] = np.tensordot(a if key in classwise else fed, stacked, axes=1)
    return out


@pytest.mark.parametrize("mix_set", ["latest", "round"])
@pytest.mark.parametrize("layers", ["output", "last-2", "all"])
def test_rounds_with_partial_participation_equal_whole_model_reference(monkeypatch, mix_set, layers):
    """Five rounds, clients joining late, re-uploading with other models AND other counts, replies out of order
    (one round as a generator): every client's personalised model (never-seen ones too) equals the reference
    computed from every client's whole latest model. Capacity 4 for 7 clients: the stack grows twice."""
    s = tiny_strategy(
        monkeypatch,
        f"strategy.params.cwfedavg.mix={mix_set} strategy.params.cwfedavg.layers={layers} "
        "strategy.params.cwfedavg.buffers=fedavg",
        clients=4,
    )
    assert any(not np.issubdtype(v.dtype, np.floating) for v in s.initial.values())  # num_batches_tracked
    rng = np.random.default_rng(7)
    schedule = [[0, 1, 2, 3], [3, 1, 4], [0, 5], [5, 2, 3, 4, 1], [6, 0]]
    latest: dict[int, tuple[dict[str, np.ndarray], np.ndarray]] = {}
    for rnd, ids in enumerate(schedule, start=1):
        replies = []
        for cid in ids:
            model = perturbed(s.initial, seed=100 * rnd + cid, scale=1.0)
            for k, v in model.items():
                if not np.issubdtype(v.dtype, np.floating):
                    model[k] = np.full(v.shape, 10 * cid + rnd, v.dtype)
            counts = rng.integers(0, 9, 10) * (rng.random(10) < 0.4)
            counts[rng.integers(10)] += 1 + cid
            latest[cid] = (model, counts)
            replies.append(reply(cid, model, counts))
        s.aggregate(rnd, (r for r in replies) if rnd == 3 else replies)
        mixed = sorted(latest) if mix_set == "latest" else ids
        for cid in range(8):
            ref = reference_personalised(latest, mixed, ids[-1], cid, s.classwise)
            ours = s.personalised(cid)
            assert list(ours) == s.keys
            for key in s.keys:
                assert ours[key].dtype == s.initial[key].dtype
                np.testing.assert_allclose(
                    ours[key], ref[key], rtol=1e-5, atol=1e-5, err_msg=f"round {rnd} client {cid} {key}"
                )


@pytest.mark.parametrize("mix_set", ["latest", "round"])
def test_server_keeps_only_classwise_arrays_per_client(mix_set):
    """`output` with M = 40: the per-client stack holds the classifier only (plus, under `latest`, the shared
    float arrays, which an exact FedAvg over every client's latest model needs); under `round` everything the
    server keeps is O(model) + M × (classifier + a few K-vectors)."""
    clients = 40
    s = make_strategy(
        f"strategy.params.cwfedavg.estimator=true strategy.params.cwfedavg.mix={mix_set}", clients=clients
    )
    counts = np.eye(10, dtype=int)[np.arange(clients) % 10] * 5 + 1
    for rnd in (1, 2):
        s.aggregate(rnd, [reply(i, perturbed(s.initial, seed=i + rnd), counts[i]) for i in range(clients)])
    head = ["fc.weight", "fc.bias"]
    assert s.classwise == head
    per_client = head + (s.shared_float if mix_set == "latest" else [])
    assert sorted(s.stack.arrays) == sorted(head)  # stacked (what the mixing multiplies)
    for k in head:
        assert s.stack.arrays[k].shape == (s.stack.capacity,) + s.initial[k].shape
    # the shared arrays per client, apart (growing the stack copies no whole model)
    assert {c: sorted(v) for c, v in s.stack.loose.items()} == (
        {c: sorted(s.shared_float) for c in range(clients)} if mix_set == "latest" else {}
    )
    for c in range(clients):
        for k in per_client:
            np.testing.assert_array_equal(s.stack.get(c, k), perturbed(s.initial, seed=c + 2)[k])
    model_bytes = sum(v.nbytes for v in s.initial.values())
    head_bytes = sum(s.initial[k].nbytes for k in head)

    def nbytes(x) -> int:
        if isinstance(x, np.ndarray):
            return x.nbytes
        if isinstance(x, dict):
            return sum(nbytes(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(nbytes(v) for v in x)
        return nbytes(vars(x)) if hasattr(x, "__dict__") else 0

    state = nbytes(s.state_dict())
    small = 8 * 8 * s.num_classes  # per client: n, p̂, evidence, norm estimate, q, two snapshots (float64)
    if mix_set == "round":  # the initial model, the shared FedAvg arrays, the stack, the per-client vectors
        assert state <= 2 * model_bytes + s.stack.capacity * (head_bytes + small)
        assert not s.sums
    else:  # + the shared arrays of every client and their float64 running sum (twice a model's bytes)
        assert state >= s.stack.capacity * model_bytes
        assert state <= 5 * model_bytes + s.stack.capacity * (model_bytes + small)


def test_server_memory_follows_the_clients_heard_from_not_the_federation():
    """40 clients, 10 % sampled: the stack starts with a cohort's rows (not 40) and doubles as clients are heard
    from, so the state (and the checkpoint written every round) grows with them."""
    s = make_strategy("strategy.fraction=0.1 strategy.min_clients=1", clients=40)
    assert s.stack.capacity == 4
    counts = np.ones(10, dtype=int) * 3
    s.aggregate(1, [reply(i, perturbed(s.initial, seed=i), counts) for i in (7, 19, 23)])
    assert s.stack.capacity == 4 and len(s.stack) == 3
    s.aggregate(2, [reply(i, perturbed(s.initial, seed=i + 50), counts) for i in (2, 7, 31)])
    assert s.stack.capacity == 8 and len(s.stack) == 5
    assert all(a.shape[0] == 8 for a in (s.n, s.p_hat, s.estimated, *s.stack.arrays.values()))
    assert s.personalised(31).keys() == s.initial.keys() and s.personalised(39).keys() == s.initial.keys()


def test_checkpoint_round_trip(monkeypatch):
    """A restored state continues exactly: the next round as without the restart."""
    over = "strategy.params.cwfedavg.mix=latest strategy.params.cwfedavg.buffers=fedavg"
    models = {(r, c): None for r in (1, 2) for c in range(5)}
    s = tiny_strategy(monkeypatch, over, clients=5)
    for key in models:
        models[key] = perturbed(s.initial, seed=10 * key[0] + key[1], scale=1.0)
    counts = np.eye(10, dtype=int)[[0, 1, 0, 2, 1]] * 3 + 1
    rounds = {1: [0, 1, 2, 3, 4], 2: [1, 3]}

    def replies(rnd):
        return [reply(c, models[rnd, c], counts[c] + rnd) for c in rounds[rnd]]

    s.aggregate(1, replies(1))
    restored = tiny_strategy(monkeypatch, over, clients=5)
    restored.load_state_dict(copy.deepcopy(s.state_dict()))  # as a checkpoint file would: no shared arrays
    for strategy in (s, restored):
        strategy.aggregate(2, replies(2))
    for c in range(6):
        ref = s.personalised(c)
        for other in (restored,):
            for key, value in other.personalised(c).items():
                np.testing.assert_allclose(value, ref[key], rtol=1e-6, atol=1e-6, err_msg=f"{c} {key}")


def test_checkpoint_writes_the_changed_rows_of_the_stack_only(monkeypatch, tmp_path):
    """With a server-state folder the stack goes to one file per client, rewritten only when the client
    replied: round 2 (2 of 5 clients) writes 2 files; a strategy restored from either checkpoint continues
    exactly as the original (round 1's checkpoint still valid after round 2's files were written)."""
    over = "strategy.params.cwfedavg.mix=latest"
    counts = np.eye(10, dtype=int)[[0, 1, 0, 2, 1]] * 3 + 1
    rounds = {1: [0, 1, 2, 3, 4], 2: [1, 3], 3: [0, 3]}

    def replies(rnd):
        return [reply(c, perturbed(s.initial, seed=10 * rnd + c, scale=1.0), counts[c] + rnd) for c in rounds[rnd]]

    def restored(state, folder):
        other = tiny_strategy(monkeypatch, over, clients=5, context=RunContext(server_state_dir=str(folder)))
        other.load_state_dict(copy.deepcopy(state))
        return other

    s = tiny_strategy(monkeypatch, over, clients=5, context=RunContext(server_state_dir=str(tmp_path / "run")))
    stack_dir = tmp_path / "run" / "stack"
    s.aggregate(1, replies(1))
    state1 = copy.deepcopy(s.state_dict())
    assert sorted(p.name for p in stack_dir.iterdir()) == [f"{c}.v1.pt" for c in range(5)]
    # the map (a SavedStack's fields: a checkpoint holds data, not objects), not the arrays
    assert "stack" in state1 and set(state1["stack"]) == {f.name for f in dataclasses.fields(SavedStack)}
    after1 = {c: s.personalised(c) for c in range(5)}
    s.aggregate(2, replies(2))
    state2 = copy.deepcopy(s.state_dict())
    assert sorted(p.name for p in stack_dir.glob("*.v2.pt")) == ["1.v2.pt", "3.v2.pt"]

    shutil.copytree(tmp_path / "run", tmp_path / "crashed")
    back1 = restored(state1, tmp_path / "crashed")  # as after a crash before round 2's checkpoint replaced round 1's
    assert sorted(p.name for p in (tmp_path / "crashed" / "stack").iterdir()) == [f"{c}.v1.pt" for c in range(5)]
    for c in range(5):
        for key, value in back1.personalised(c).items():
            np.testing.assert_array_equal(value, after1[c][key], err_msg=f"{c} {key}")
    back2 = restored(state2, tmp_path / "run")
    for strategy in (s, back2):
        strategy.aggregate(3, replies(3))
    for c in range(6):
        ref = s.personalised(c)
        for key, value in back2.personalised(c).items():
            np.testing.assert_allclose(value, ref[key], rtol=1e-6, atol=1e-6, err_msg=f"{c} {key}")


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """cwFedAvg's deployed model after round rnd: the personalised parameters formed from that round's uploads
    under the client's own buffers."""
    return evaluate({**private(grid, cid), **tensors(s.personalised(cid))}, data)


DEPLOYED_BY_HAND = {"cwfedavg": deployed_by_hand}
