"""FedNH: its maths by hand (cosine logits, the prototype update, the initial spread, the client's class means),
what the client does with the prototypes, the deployed model's companion column, and a short run."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import server_app
from deployed_toy import finetuned, tensors
from fedapps.client.worker import Worker
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import ModelError, build_model
from fedapps.models.heads import CosineClassifier
from fedapps.reporting.results import measured_columns, read_csv, round_row
from fedapps.server.driver import RoundDriver
from fedapps.server.evaluation import with_evaluations
from fedapps.server.rounds import RoundLog
from fedapps.server.strategy import DeployedModel
from fedapps.wire import protocol
from fedapps.wire.protocol import ARRAYS, ClientReply
from strategies import RunContext, resolve
from strategies.fednh import (
    COUNTS,
    TRAIN_OP,
    FedNH,
    class_prototypes,
    min_pairwise_angle,
    normalise_rows,
    orthogonal_prototypes,
    penultimate_features,
    uniform_prototypes,
    update_prototypes,
)
from test_ops_worker import worker_message

PATHOLOGICAL = {"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 2}


def unit(*v: float) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    return a / np.linalg.norm(a)


# --------------------------------------------------------------------------- cosine logits


def test_cosine_logits_are_s_times_the_cosine() -> None:
    head = CosineClassifier(3, 2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))  # not unit: the forward normalises
        head.scale.fill_(4.0)
    z = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, -5.0]])
    expected = [[4 * 3 / 5, 4 * 7 / (5 * math.sqrt(2))], [0.0, 0.0]]
    np.testing.assert_allclose(head(z).detach().numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(head(10 * z).detach().numpy(), expected, rtol=1e-6, atol=1e-7)  # scale-free in z
    assert head.bias is None and head.scale.requires_grad


def test_cosine_variant_of_a_zoo_model_replaces_only_the_classifier() -> None:
    plain, cos = build_model("cnn", 10, (1, 8, 8), seed=0), build_model("cnn+cosine", 10, (1, 8, 8), seed=0)
    assert isinstance(cos.fc, CosineClassifier) and cos.fc.weight.shape == plain.fc.weight.shape
    body = {k: v for k, v in plain.state_dict().items() if not k.startswith("fc.")}
    assert set(cos.state_dict()) == set(body) | {"fc.weight", "fc.scale"}
    assert all(torch.equal(cos.state_dict()[k], v) for k, v in body.items())  # same seeded body
    nested = build_model("squeezenet+cosine", 4, (1, 8, 8), seed=0)  # a classifier inside a Sequential
    assert isinstance(nested.get_submodule("classifier.3"), CosineClassifier)
    with pytest.raises(ModelError, match="unknown classifier head 'arc'.*allowed: cosine"):
        build_model("cnn+arc", 10, (1, 8, 8))


# found by `make mutate`
def test_cosine_head_normalises_each_feature_vector_also_with_extra_leading_dimensions() -> None:
    """Like nn.Linear, the head takes (*, d) inputs: each d-vector is normalised, not a column across samples."""
    head = CosineClassifier(2, 2, scale=3.0)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    z = torch.tensor([[[3.0, 4.0], [0.0, 2.0], [5.0, 0.0]], [[1.0, 1.0], [-2.0, 0.0], [0.0, 0.5]]])  # 2 × 3 × d
    want = 3.0 * F.normalize(z, dim=-1)  # cosines with the unit axes
    torch.testing.assert_close(head(z), want)


# --------------------------------------------------------------------------- the prototype update


def test_prototype_update_by_hand() -> None:
    p = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    local = np.array(
        [
            [[0.0, 1.0], [0.0, 0.0], [0.0, -2.0], [5.0, 5.0]],  # client A: class 2's row not unit
            [[1.0, 0.0], [3.0, 4.0], [0.0, 0.0], [1.0, 0.0]],
        ]
    )  # client B
    counts = np.array(
        [
            [3, 0, 1, 0],  # A has no class-1 or class-3 samples: its rows there are ignored
            [1, 2, 0, 0],
        ]
    )  # nobody has class 3
    rho = 0.25
    new = update_prototypes(p, local, counts, rho)
    # class 0: (3·(0,1) + 1·(1,0)) / 4 = (1/4, 3/4), normalised (1,3)/√10, then 0.25·(1,0) + 0.75·that
    c0 = unit(*(0.25 * np.array([1.0, 0.0]) + 0.75 * unit(1.0, 3.0)))
    c1 = unit(*(0.25 * np.array([0.0, 1.0]) + 0.75 * unit(3.0, 4.0)))  # B alone
    c2 = unit(*(0.25 * np.array([-1.0, 0.0]) + 0.75 * np.array([0.0, -1.0])))  # A alone, its row renormalised
    np.testing.assert_allclose(new, [c0, c1, c2, [0.0, -1.0]], atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(new, axis=1), 1.0)
    # the formula's parts: ignoring the counts, or swapping ρ and 1 − ρ, moves class 0 elsewhere
    assert not np.allclose(update_prototypes(p, local, (counts > 0).astype(float), rho)[0], c0, atol=1e-3)
    assert not np.allclose(update_prototypes(p, local, counts, 1 - rho)[0], c0, atol=1e-3)
    np.testing.assert_allclose(update_prototypes(p, local, counts, 1.0), p)  # ρ = 1: prototypes never move
    np.testing.assert_allclose(update_prototypes(p, local, counts, 0.0)[0], unit(1.0, 3.0), atol=1e-12)


def test_class_prototypes_are_normalised_means_of_normalised_features() -> None:
    z = torch.tensor([[3.0, 4.0], [0.0, 10.0], [-2.0, 0.0], [7.0, 7.0]])
    y = torch.tensor([0, 0, 2, 0])
    mu, counts = class_prototypes(z, y, 4)
    m0 = (unit(3, 4) + unit(0, 1) + unit(1, 1)) / 3  # each feature normalised before the mean
    np.testing.assert_allclose(mu.numpy(), [unit(*m0), [0, 0], [-1, 0], [0, 0]], atol=1e-6)
    assert counts.tolist() == [3, 0, 1, 0]


# found by `make mutate`
def test_fednh_update_keeps_unseen_classes_at_rho_zero_and_the_input_dtype() -> None:
    p = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    local = np.array([[[0.0, 1.0], [0.0, 0.0]]], np.float32)
    counts = np.array([[2, 0]])  # class 1: nobody has samples
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0/0 for the unseen class
        new = update_prototypes(p, local, counts, 0.0)
    assert new.dtype == np.float32
    np.testing.assert_array_equal(new, [[0.0, 1.0], [0.0, 1.0]])  # class 0 moved all the way; class 1 kept


# --------------------------------------------------------------------------- the initial spread


def test_uniform_initialisation_spreads_the_prototypes() -> None:
    k, d = 10, 16
    p = uniform_prototypes(k, d, seed=3)
    assert p.shape == (k, d) and p.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-6)
    best = math.degrees(math.acos(-1 / (k - 1)))  # the regular simplex: the largest possible smallest angle
    rand = min_pairwise_angle(np.random.default_rng(3).normal(size=(k, d)))
    assert min_pairwise_angle(p) > best - 0.5 and min_pairwise_angle(p) > rand + 20
    np.testing.assert_array_equal(uniform_prototypes(k, d, 3, steps=50), uniform_prototypes(k, d, 3, steps=50))
    assert not np.allclose(uniform_prototypes(k, d, 3, steps=50), uniform_prototypes(k, d, 4, steps=50))  # seeded
    many = uniform_prototypes(40, 8, seed=0)  # more classes than dimensions: no simplex, still spread
    assert min_pairwise_angle(many) > min_pairwise_angle(np.random.default_rng(0).normal(size=(40, 8))) + 15


def test_orthogonal_initialisation() -> None:
    p = orthogonal_prototypes(10, 16, seed=0)
    np.testing.assert_allclose(p @ p.T, np.eye(10), atol=1e-6)
    with pytest.raises(ValueError, match="at least 12 dimensions"):
        orthogonal_prototypes(12, 8, seed=0)


def test_orthogonal_init_with_too_few_dimensions_is_refused(tiny_config) -> None:
    cfg = load_config(
        tiny_config(strategy={"name": "fednh", "params": {"fednh": {"init": "orthogonal"}}}, model={"name": "mlp"}), ""
    )
    resolve(cfg)  # 10 classes, 200 features: fine
    small = load_config(
        tiny_config(
            strategy={"name": "fednh", "params": {"fednh": {"init": "orthogonal"}}},
            data={
                "source": "synthetic",
                "synthetic_classes": 300,
                "synthetic_samples": 600,
                "synthetic_shape": [1, 8, 8],
                "partition": "iid",
                "num_clients": 2,
            },
        ),
        "",
    )
    with pytest.raises(ConfigError, match=r"strategy\.params\.fednh\.init.*300 classes.*200"):
        resolve(small)


# found by `make mutate`
def test_fednh_normalise_rows_zero_and_tiny_rows() -> None:
    """A row at or below the guard (norm ≤ 1e-12) is set to zero, not left as whatever memory np.divide found."""
    a = np.array([[3.0, 4.0], [0.0, 0.0], [1e-12, 0.0], [2e-12, 0.0]])
    for _ in range(3):  # freed arrays of the same size are reused: an unset output row would show their values
        junk = np.full_like(a, 7.0)
        del junk
        np.testing.assert_array_equal(normalise_rows(a), [[0.6, 0.8], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])


# found by `make mutate`
def test_fednh_min_pairwise_angle_of_integer_and_rounded_rows() -> None:
    assert min_pairwise_angle([[1, 0], [0, 1]]) == pytest.approx(90.0)  # integer rows are fine
    # (1, 1, 1)/√3 · itself rounds to 1 + 2e-16: clipped, not a math domain error
    assert min_pairwise_angle(np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])) == 0.0


# found by `make mutate`
def test_fednh_orthogonal_prototypes_square_seeded_float32() -> None:
    p = orthogonal_prototypes(4, 4, seed=5)  # K = d is allowed: a rotation
    assert p.dtype == np.float32
    np.testing.assert_allclose(p @ p.T, np.eye(4), atol=1e-6)
    np.testing.assert_array_equal(orthogonal_prototypes(3, 6, seed=5), orthogonal_prototypes(3, 6, seed=5))
    assert not np.allclose(orthogonal_prototypes(3, 6, seed=5), orthogonal_prototypes(3, 6, seed=6))


# --------------------------------------------------------------------------- the client


def fednh_message(strategy: FedNH, ops: list[str]):
    grid, msg = worker_message(
        ops,
        model=strategy.arch,
        load=protocol.Load(into_model=True),
        returns=protocol.Return(arrays=True),
        keep=protocol.Keep(persist=False),
        client={"momentum": 0.9, "weight_decay": 0.01},
        arrays=strategy.global_arrays,
    )
    return grid, msg


def test_client_trains_the_body_never_the_prototypes_and_sends_its_class_means(tiny_config) -> None:
    strategy = FedNH(load_config(tiny_config(strategy={"name": "fednh"}, data={"num_clients": 2}), ""))
    sent = strategy.global_arrays
    grid, msg = fednh_message(strategy, [TRAIN_OP])
    w = Worker(msg, grid.contexts[100])
    for p in w.model.parameters():
        p.grad = None
    reply = w.run()
    assert w.model.fc.weight.grad is None  # no gradient ever reached the prototypes
    assert w.model.fc.scale.grad is not None and w.model.fc1[0].weight.grad is not None
    kept = {k: v.detach().numpy() for k, v in w.model.state_dict().items()}
    np.testing.assert_array_equal(kept["fc.weight"], sent["fc.weight"])  # so no step moved them
    assert not np.allclose(kept["fc1.0.weight"], sent["fc1.0.weight"])  # the body learnt
    assert kept["fc.scale"][0] != sent["fc.scale"][0]  # s is learnable
    back = {k: v.numpy() for k, v in reply.content[ARRAYS].items()}
    mu, counts = class_prototypes(penultimate_features(w.model, w.train_x), w.train_y, 10)
    np.testing.assert_allclose(back["fc.weight"], mu.numpy(), atol=1e-6)  # the prototype slot: its class means
    np.testing.assert_array_equal(back["fc1.0.weight"], kept["fc1.0.weight"])
    reported = list(reply.content[protocol.METRICS][COUNTS])
    assert reported == torch.bincount(w.train_y, minlength=10).tolist() == counts.tolist()


def test_server_leaves_out_replies_with_bad_counts(tiny_config) -> None:
    strategy = FedNH(load_config(tiny_config(strategy={"name": "fednh"}, data={"num_clients": 2}), ""))
    arrays = {k: v.copy() for k, v in strategy.global_arrays.items()}
    good = ClientReply(1, 0, 10, {COUNTS: [1.0] * 10}, arrays)
    for bad in ([1.0] * 9, [-1.0] + [1.0] * 9, [0.5] + [1.0] * 9, [2.0] * 10):  # length, sign, whole, sum > n
        assert strategy.class_counts(ClientReply(2, 1, 10, {COUNTS: bad}, arrays)) is None
    assert strategy.class_counts(good) is not None
    assert strategy.aggregate(1, [ClientReply(2, 1, 10, {}, arrays)]) == {}  # nothing usable: nothing moves


# --------------------------------------------------------------------------- the companion column (generic model)


def test_companions_ride_with_the_deployed_evaluation() -> None:
    d = DeployedModel("x", source="message", evaluate="evaluate-finetuned", companions=(("generic", "evaluate"),))
    assert with_evaluations([TRAIN_OP], d, True) == [
        "evaluate-finetuned:deployed",
        "evaluate:deployed.generic",
        TRAIN_OP,
        "evaluate:after",
    ]
    assert with_evaluations([TRAIN_OP], d, False) == [TRAIN_OP, "evaluate:after"]
    assert protocol.companion_name("deployed.generic") == "generic"
    assert protocol.companion_name("deployed") is None and protocol.companion_name("after") is None


def test_companion_is_filed_under_the_round_it_measures() -> None:
    def metrics(cid, dep, gen, after):
        out = {protocol.CLIENT_ID: cid, protocol.NUM_EXAMPLES: 10}
        for tag, (correct, n) in (("deployed", dep), ("deployed.generic", gen), ("after", after)):
            out.update({f"{tag}-acc": correct / n, f"{tag}-n": n, f"{tag}-correct": correct, f"{tag}-loss": 1.0})
        return out

    ms = [metrics(0, (8, 10), (5, 10), (9, 10)), metrics(1, (3, 5), (1, 5), (4, 5))]
    cols = measured_columns(ms, 2)
    assert cols["generic_acc_mean"] == pytest.approx((0.5 + 0.2) / 2)
    assert cols["generic_acc_weighted"] == pytest.approx(6 / 15) and cols["acc_mean"] == pytest.approx(0.7)
    replies = [ClientReply(i, i, 10, m) for i, m in enumerate(ms)]
    row = round_row(RoundLog(5, replies, 0, 0), 2)  # the training phase's row: the companion is not its own
    assert not any(k.startswith(("generic", "deployed")) for k in row) and "acc_after_training_mean" in row


def test_generic_column_is_the_global_model_of_the_round_it_is_filed_under() -> None:
    """``deployed.generic`` of round r (taken on round r+1's message, or the final one) is the evaluation of the
    global body, prototypes and s right after round r's server step; the model after training is another one."""
    import dataclasses

    from fedapps.client import ops
    from fedapps.data import get_federation

    cfg = load_config(
        None,
        "strategy.name=fednh rounds=2 data.source=digits data.partition=pathological "
        "data.num_clients=2 model.name=mlp client.epochs=1 client.batch_size=32 client.lr=0.05 "
        "strategy.params.fednh.finetune_epochs=1",
    )
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    fed = get_federation(dataclasses.asdict(cfg.data))
    expected, logs = {}, []

    def on_round(entry) -> None:
        logs.append(entry)
        model = build_model("mlp+cosine", 10, (1, 8, 8))
        model.load_state_dict({k: torch.as_tensor(v) for k, v in s.global_arrays.items()})
        expected[entry.round] = {c: ops.evaluate(model, fed.client(c).test_x, fed.client(c).test_y) for c in (0, 1)}

    s = resolved.build(cfg, RunContext(on_round=on_round))
    RoundDriver(s).start(InProcessGrid(2))
    measured = {m.round: m for e in logs for m in e.measurements}
    assert sorted(measured) == [1, 2]
    for rnd, m in measured.items():
        for r in m.replies:
            want = expected[rnd][r.client_id]
            assert r.metrics["deployed.generic-correct"] == want["correct"], (rnd, r.client_id)
            assert r.metrics["deployed.generic-loss"] == pytest.approx(want["loss"], rel=1e-5)
    after = {r.client_id: r.metrics["after-correct"] for r in logs[0].replies}
    assert after != {r.client_id: r.metrics["deployed.generic-correct"] for r in measured[1].replies}


# --------------------------------------------------------------------------- end to end


def test_short_run_in_process(tiny_config, tmp_path) -> None:
    cfg_path = tiny_config(
        rounds=3, strategy={"name": "fednh", "params": {"fednh": {"finetune_epochs": 2}}}, data=PATHOLOGICAL
    )
    grid = InProcessGrid(4, record=True)
    summary = server_app.run_experiment(grid, str(cfg_path), "", str(tmp_path / "out"))
    assert not [m.error.reason for m in grid.replies if m.has_error()]
    rows = read_csv(tmp_path / "out" / "fednh-digits-pathological-s0" / "rounds.csv")
    assert all(isinstance(r["generic_acc_mean"], float) and isinstance(r["acc_mean"], float) for r in rows)
    assert summary["accuracy_mean"] > 0.8 and summary["final_generic_acc_mean"] == rows[-1]["generic_acc_mean"]
    assert rows[-1]["prototype_min_angle_deg"] > 45 and all(r["prototype_shift_deg"] > 0 for r in rows)
    sent = [m for m in grid.sent if m.metadata.group_id == "2" and m.metadata.message_type == "train"]
    assert all(protocol.request_of(m).setup.model.name == "mlp+cosine" for m in sent)
    p = sent[0].content[ARRAYS]["fc.weight"].numpy()
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-5)  # the server's prototypes stay unit
    summary_json = json.loads((tmp_path / "out" / "fednh-digits-pathological-s0" / "summary.json").read_text())
    assert "fine-tuned" in summary_json["deployed_model"]


@pytest.mark.heavy
def test_end_to_end_through_flowers_wire_format(tmp_path) -> None:
    """2 rounds of FedNH on digits, 3 clients, every message, reply and node Context through Flower's protobuf
    encoding (:func:`conftest.wire_run`; the Ray path itself: test_cli_e2e.py)."""
    from conftest import wire_run

    out = wire_run(
        tmp_path,
        strategy={"name": "fednh", "params": {"fednh": {"finetune_epochs": 1}}},
        data={"source": "digits", "partition": "iid", "num_clients": 3},
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fednh" and summary["rounds"] == 2 and 0.0 < summary["accuracy_mean"] <= 1.0
    rows = read_csv(out / "rounds.csv")
    assert [isinstance(r["generic_acc_mean"], float) for r in rows] == [True, True]


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """FedNH's deployed model after round rnd: that round's global model (cosine head) with its prototypes and
    scale fine-tuned on the client's train split, body frozen, with the client's optimiser."""
    section = protocol.Section(epochs=s.params.finetune_epochs)
    return finetuned(s, tensors(s.global_arrays), data, rnd, cid, section, "body", arch="mlp+cosine")


DEPLOYED_BY_HAND = {"fednh": deployed_by_hand}
