"""Each client operation on tiny data, directly and through the generic worker."""

import dataclasses

import numpy as np
import pytest
import torch

from fedapps.client import ops
from fedapps.client.worker import STATE_MODEL, Worker
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model, classifier_name
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.validation import parse_reply
from strategies.cwfedavg import wdr_penalty
from strategies.fedprox import proximal_penalty


def toy_data(n=64, k=3, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, k, (n,), generator=g)
    centres = torch.randn(k, d, generator=g) * 3
    x = centres[y] + 0.3 * torch.randn(n, d, generator=g)
    return x, y


class TinyNet(torch.nn.Module):
    def __init__(self, d=5, k=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 16)
        self.fc = torch.nn.Linear(16, k)

    def forward(self, x):
        return self.fc(torch.relu(self.fc1(x)))


def test_train_reduces_loss_and_evaluate_counts():
    torch.manual_seed(0)
    x, y = toy_data()
    model = TinyNet()
    before = ops.evaluate(model, x, y)
    ops.train(model, x, y, ops.OptimSettings(epochs=20, batch_size=8, lr=0.1))
    after = ops.evaluate(model, x, y)
    assert after["loss"] < before["loss"] and after["acc"] > 0.9
    assert after["n"] == 64 and after["correct"] == round(after["acc"] * 64)


def test_distill_moves_predictions_towards_targets():
    torch.manual_seed(0)
    x, _ = toy_data()
    model = TinyNet()
    targets = torch.zeros(64, 3)
    targets[:, 2] = 1.0
    ops.distill(model, x, targets, ops.OptimSettings(epochs=30, batch_size=16, lr=0.05), ops.DistillSettings(loss="kl"))
    probs = ops.predict(model, x, output="probs")
    assert probs[:, 2].mean() > 0.9
    assert torch.allclose(probs.sum(dim=1), torch.ones(64), atol=1e-5)


def test_distill_weights_zero_means_ignored():
    torch.manual_seed(0)
    x, _ = toy_data()
    model = TinyNet()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    targets = torch.full((64, 3), 1 / 3)
    ops.distill(
        model,
        x,
        targets,
        ops.OptimSettings(epochs=1, batch_size=8, lr=0.1),
        ops.DistillSettings(),
        sample_weights=torch.zeros(64),
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k])


def test_predict_outputs():
    x, _ = toy_data()
    model = TinyNet()
    logits = ops.predict(model, x, output="logits")
    assert torch.equal(ops.predict(model, x, output="labels"), logits.argmax(1))
    with pytest.raises(ValueError):
        ops.predict(model, x, output="bananas")


def test_wdr_gradient_only_reaches_classifier_weight():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    weight = model.get_submodule(classifier_name(model)).weight
    target = torch.full((10,), 0.1)
    target[0] = 0.5
    target = target / target.sum()
    wdr_penalty(weight, target, lam=10.0).backward()
    for name, p in model.named_parameters():
        if name == "fc.weight":
            assert p.grad is not None and p.grad.abs().sum() > 0
        else:
            assert p.grad is None, name


def test_proximal_penalty_value():
    model = TinyNet()
    anchor = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    expected = 0.5 * 2.0 * sum((p**2).sum() for p in model.parameters())
    assert torch.allclose(proximal_penalty(model, anchor, 2.0), expected)


# found by `make mutate`
def test_weighted_mean_with_weights_below_one() -> None:
    assert ops.weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([0.2, 0.3])).item() == pytest.approx(2.2)


# what the worker tests' messages carry: digits over two clients with a public set, the small MLP, SGD on the CPU
SETUP = protocol.Setup(
    data={
        "source": "digits",
        "root": "/tmp",
        "download": False,
        "partition": "iid",
        "num_clients": 2,
        "classes_per_client": 2,
        "alpha": 0.1,
        "min_samples": 40,
        "groups": 5,
        "redistribute_fraction": 0.1,
        "test_fraction": 0.25,
        "public_fraction": 0.2,
        "seed": 1,
        "synthetic_classes": 10,
        "synthetic_shape": [3, 32, 32],
        "synthetic_samples": 100,
        "swap_pairs": 1,
    },
    model=protocol.ModelSpec("mlp", 0),
    client={"epochs": 1, "batch_size": 16, "lr": 0.05, "optimizer": "sgd", "device": "cpu"},
)


def train_settings(**settings):
    """The Training of a request whose ``train`` section holds ``settings`` (optimiser fields, freeze) and
    ``extra`` (an algorithm's own)."""
    return protocol.Training(sections={protocol.TRAIN: protocol.Section(**settings)})


def worker_message(ops_list, arrays=None, client=None, model=None, **parts):
    """A fresh two-node grid and a round-1 message of ``ops_list`` to its node 100 (client 0): :data:`SETUP` with
    ``client`` over its client settings and ``model`` for its architecture, ``parts`` the other fields of the
    request (load, returns, training, public ...), ``arrays`` its model arrays."""
    grid = InProcessGrid(2)  # sets Flower's task identity so messages can be built
    setup = dataclasses.replace(
        SETUP, client={**SETUP.client, **(client or {})}, model=protocol.ModelSpec(model, 0) if model else SETUP.model
    )
    request = protocol.Request(ops=tuple(ops_list), round=1, setup=setup, **parts)
    return grid, protocol.Draft(100, request, arrays=arrays).message()


def test_worker_runs_ops_in_order_and_persists_model():
    grid, msg = worker_message(
        ["evaluate", "train", "evaluate:after", "predict"],
        public=protocol.PublicSet(encoding="float16"),
        returns=protocol.Return(arrays=True),
    )
    ctx = grid.contexts[100]
    reply = parse_reply(Worker(msg, ctx).run())
    m = reply.metrics
    assert reply.client_id == 0 and reply.num_examples > 0
    for key in ("eval-acc", "after-acc", "train-loss", "t-train", protocol.TOTAL_TIME):
        assert key in m
    assert m["after-acc"] > m["eval-acc"]
    pred = reply.predictions[protocol.PREDICTION_ARRAY]
    assert pred.dtype == np.float16 and pred.shape[1] == 10
    assert STATE_MODEL in ctx.state and reply.arrays is not None


def test_arrays_for_part_of_the_state_leave_the_rest_as_the_client_starts_it():
    """The worker's model object is shared by the messages a process serves. A message whose arrays cover the whole
    state loads them straight into it (nothing before: every value is overwritten); one whose arrays cover a part
    gets the rest from the client's own starting state, never from whatever the previous message left there."""
    initial = build_model("mlp", 10, (1, 8, 8), seed=0).state_dict()
    head = classifier_name(build_model("mlp", 10, (1, 8, 8), seed=0)) + "."
    rng = np.random.default_rng(3)
    settings = dict(
        load=protocol.Load(into_model=True), keep=protocol.Keep(persist=False), returns=protocol.Return(arrays=True)
    )

    def returned(arrays):
        grid, msg = worker_message(["evaluate"], arrays=arrays, **settings)
        return parse_reply(Worker(msg, grid.contexts[100]).run()).arrays

    whole = {k: rng.normal(size=tuple(v.shape)).astype(np.float32) for k, v in initial.items()}
    got = returned(whole)  # the shared model now holds these random values
    assert set(got) == set(initial)
    for k in whole:
        np.testing.assert_array_equal(got[k], whole[k])
    part = {k: rng.normal(size=tuple(v.shape)).astype(np.float32) for k, v in initial.items() if k.startswith(head)}
    assert part and len(part) < len(initial)
    got = returned(part)
    for k, v in initial.items():
        np.testing.assert_array_equal(got[k], part[k] if k in part else v.numpy())


def test_worker_hard_labels_smallest_type_and_distill():
    grid, msg = worker_message(["predict"], public=protocol.PublicSet(encoding="hard"))
    reply = parse_reply(Worker(msg, grid.contexts[100]).run())
    labels = reply.predictions[protocol.PREDICTION_ARRAY]
    assert labels.dtype == np.uint8
    targets = protocol.Targets(pseudolabels.encode(labels.astype(np.int64), "hard", 10)).encode()
    grid2, msg2 = worker_message(
        ["distill"], training=protocol.Training(sections={protocol.DISTILL: protocol.Section(loss="ce")})
    )
    msg2.content[protocol.TARGETS] = targets
    reply2 = parse_reply(Worker(msg2, grid2.contexts[100]).run())
    assert "distill-loss" in reply2.metrics


def test_worker_refuses_other_public_set():
    grid, msg = worker_message(["predict"], public=protocol.PublicSet(fingerprint="deadbeef"))
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "public set mismatch" in reply.error.reason


def test_unknown_op_rejected_before_any_op_runs():
    grid, msg = worker_message(["train", "dance"])
    ctx = grid.contexts[100]
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "unknown client operation 'dance'" in reply.error.reason
    assert STATE_MODEL not in ctx.state  # 'train' did not run either


def test_worker_refuses_a_malformed_message_naming_the_key():
    grid, msg = worker_message(["train"])
    msg.content[protocol.CONFIG][protocol.LOAD_ARRAYS] = "yes"  # a setting of the wrong type
    ctx = grid.contexts[100]
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "malformed message" in reply.error.reason
    assert f"'{protocol.LOAD_ARRAYS}' must be true or false" in reply.error.reason
    assert STATE_MODEL not in ctx.state  # nothing ran
