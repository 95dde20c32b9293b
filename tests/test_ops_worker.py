"""Each client operation on tiny data, directly and through the generic worker."""

import numpy as np
import pytest
import torch

from fedapps.client import ops
from fedapps.client.worker import STATE_MODEL, Worker
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model, classifier_name
from fedapps.wire import protocol, pseudolabels
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
    ops.distill(model, x, targets, ops.OptimSettings(epochs=1, batch_size=8, lr=0.1), ops.DistillSettings(),
                sample_weights=torch.zeros(64))
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
    expected = 0.5 * 2.0 * sum((p ** 2).sum() for p in model.parameters())
    assert torch.allclose(proximal_penalty(model, anchor, 2.0), expected)


# found by `make mutate`
def test_weighted_mean_with_weights_below_one() -> None:
    assert ops.weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([0.2, 0.3])).item() == pytest.approx(2.2)


def worker_message(ops_list, extra=None, arrays=None):
    grid = InProcessGrid(2)  # sets Flower's task identity so messages can be built
    cfg = {
        "data.source": "digits", "data.root": "/tmp", "data.download": False, "data.partition": "iid",
        "data.num_clients": 2, "data.classes_per_client": 2, "data.alpha": 0.1, "data.min_samples": 40,
        "data.groups": 5, "data.redistribute_fraction": 0.1, "data.test_fraction": 0.25,
        "data.public_fraction": 0.2, "data.seed": 1, "data.synthetic_classes": 10,
        "data.synthetic_shape": [3, 32, 32], "data.synthetic_samples": 100, "data.swap_pairs": 1,
        "model.name": "mlp", "model.seed": 0, "client.epochs": 1, "client.batch_size": 16, "client.lr": 0.05,
        "client.optimizer": "sgd", "client.device": "cpu",
    }
    cfg.update(extra or {})
    return grid, protocol.build_message(100, 1, ops_list, cfg, arrays=arrays)


def test_worker_runs_ops_in_order_and_persists_model():
    grid, msg = worker_message(["evaluate", "train", "evaluate:after", "predict"],
                               {"predict.encoding": "float16", "return-arrays": True})
    ctx = grid.contexts[100]
    reply = Worker(msg, ctx).run()
    m = reply.content["metrics"]
    assert m["client-id"] == 0 and m["num-examples"] > 0
    for key in ("eval-acc", "after-acc", "train-loss", "t-train", "t-total"):
        assert key in m
    assert m["after-acc"] > m["eval-acc"]
    pred = reply.content["predictions"]["predictions"].numpy()
    assert pred.dtype == np.float16 and pred.shape[1] == 10
    assert STATE_MODEL in ctx.state and "arrays" in reply.content


def test_arrays_for_part_of_the_state_leave_the_rest_as_the_client_starts_it():
    """The worker's model object is shared by the messages a process serves. A message whose arrays cover the whole
    state loads them straight into it (nothing before: every value is overwritten); one whose arrays cover a part
    gets the rest from the client's own starting state, never from whatever the previous message left there."""
    initial = build_model("mlp", 10, (1, 8, 8), seed=0).state_dict()
    head = classifier_name(build_model("mlp", 10, (1, 8, 8), seed=0)) + "."
    rng = np.random.default_rng(3)
    settings = {"load-arrays": True, "persist-model": False, "return-arrays": True}

    def returned(arrays):
        grid, msg = worker_message(["evaluate"], settings, arrays=protocol.arrays_record(arrays))
        out = Worker(msg, grid.contexts[100]).run().content["arrays"]
        return {k: out[k].numpy() for k in out.keys()}

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
    grid, msg = worker_message(["predict"], {"predict.encoding": "hard"})
    reply = Worker(msg, grid.contexts[100]).run()
    labels = reply.content["predictions"]["predictions"].numpy()
    assert labels.dtype == np.uint8
    targets = protocol.arrays_record({"targets": pseudolabels.encode(labels.astype(np.int64), "hard", 10)})
    grid2, msg2 = worker_message(["distill"], {"distill.loss": "ce"})
    msg2.content[protocol.TARGETS] = targets
    reply2 = Worker(msg2, grid2.contexts[100]).run()
    assert "distill-loss" in reply2.content["metrics"]


def test_worker_refuses_other_public_set():
    grid, msg = worker_message(["predict"], {"public.fingerprint": "deadbeef"})
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "public set mismatch" in reply.error.reason


def test_unknown_op_rejected_before_any_op_runs():
    grid, msg = worker_message(["train", "dance"])
    ctx = grid.contexts[100]
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "unknown client operation 'dance'" in reply.error.reason
    assert STATE_MODEL not in ctx.state  # 'train' did not run either
