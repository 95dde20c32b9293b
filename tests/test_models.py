"""Model zoo: shapes, classifier head, the papers' CNN dimensions, seeded init, errors."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from fedapps.models import (
    MODEL_NAMES,
    ModelError,
    build_model,
    classifier_name,
    count_parameters,
    top_level_children,
)

torch.set_num_threads(1)

SHAPES = [(1, 28, 28), (3, 32, 32), (3, 64, 64)]
DIGITS = (1, 8, 8)
CASES = [(n, s, k) for n in MODEL_NAMES for s in SHAPES for k in (10, 47)]
CASES += [(n, DIGITS, k) for n in ("cnn", "mlp") for k in (10, 47)]


def _forward_capturing_head(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model and return (output, what the named classifier produced)."""
    seen: list[torch.Tensor] = []
    head = model.get_submodule(classifier_name(model))
    handle = head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        out = model(x)
    finally:
        handle.remove()
    assert len(seen) == 1
    return out, seen[0]


def test_names_are_the_interface():
    assert MODEL_NAMES == ("cnn", "mlp", "resnet18", "mobilenetv2", "squeezenet", "alexnet", "vgg11", "vgg16")


def _id(v: object) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize("name,shape,k", CASES, ids=_id)
def test_forward_shape_and_classifier(name, shape, k):
    model = build_model(name, k, shape, seed=0).eval()
    with torch.no_grad():
        out, head_out = _forward_capturing_head(model, torch.randn(2, *shape))
    assert out.shape == (2, k)
    assert torch.isfinite(out).all()
    # The named classifier is a Linear whose rows are the classes, and it is the model's last op.
    head = model.get_submodule(classifier_name(model))
    assert isinstance(head, nn.Linear)
    assert head.weight.shape == (k, head.in_features)
    assert torch.equal(head_out, out)
    # cwFedAvg's `last-1` (the last top-level child) contains the classifier.
    assert classifier_name(model).split(".")[0] == top_level_children(model)[-1]


@pytest.mark.parametrize("shape,dim", [((1, 28, 28), 1024), ((3, 32, 32), 1600), ((3, 64, 64), 10816)])
def test_cnn_is_fedavgcnn(shape, dim):
    model = build_model("cnn", 10, shape)
    assert top_level_children(model) == ["conv1", "conv2", "fc1", "fc"]
    assert classifier_name(model) == "fc"
    c1, c2 = model.conv1[0], model.conv2[0]
    assert (c1.in_channels, c1.out_channels, c2.in_channels, c2.out_channels) == (shape[0], 32, 32, 64)
    for conv in (c1, c2):
        assert conv.kernel_size == (5, 5) and conv.padding == (0, 0) and conv.stride == (1, 1)
        assert conv.bias is not None
    assert [type(m) for m in model.conv1] == [nn.Conv2d, nn.ReLU, nn.MaxPool2d]
    assert model.fc1[0].in_features == dim and model.fc1[0].out_features == 512
    assert model.fc.weight.shape == (10, 512)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in model.modules())


def test_cnn_param_count_matches_pfllib():
    # conv1 2,432 + conv2 51,264 + fc1 819,712 + fc 5,130
    assert count_parameters(build_model("cnn", 10, (3, 32, 32))) == 878_538


def test_cnn_on_digits_uses_padding():
    model = build_model("cnn", 10, DIGITS)
    assert model.conv1[0].padding == (2, 2) and model.conv2[0].padding == (2, 2)
    assert model.fc1[0].in_features == 64 * 2 * 2


def test_mlp_structure():
    model = build_model("mlp", 10, (1, 28, 28))
    assert top_level_children(model) == ["fc1", "fc2", "fc"]
    assert model.fc1[0].in_features == 784 and model.fc1[0].out_features == 200
    assert model.fc.weight.shape == (10, 200)
    assert count_parameters(model) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


def test_alexnet_matches_cosmos_spec():
    model = build_model("alexnet", 10, (3, 32, 32))
    convs = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs == [64, 128, 256, 256, 512, 512]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 4
    linears = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [(2048, 4096), (4096, 4096), (4096, 10)]
    assert any(isinstance(m, nn.Dropout) for m in model.modules())


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "squeezenet", "alexnet", "vgg11", "vgg16"])
def test_small_image_stem_and_kaiming_init(name):
    model = build_model(name, 10, (1, 28, 28), seed=1)
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 1 and first.stride == (1, 1) and first.kernel_size == (3, 3)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None:
            assert torch.count_nonzero(m.bias) == 0
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.count_nonzero(m.bias) == 0
    head = model.get_submodule(classifier_name(model))
    std = head.weight.std().item()
    assert std == pytest.approx((2.0 / head.in_features) ** 0.5, rel=0.2)  # Kaiming-normal, fan-in


def test_cnn_and_mlp_keep_pytorch_default_init():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    assert torch.count_nonzero(model.fc.bias) > 0  # default init: biases uniform, not zero


@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet18", "mobilenetv2", "squeezenet", "alexnet", "vgg11"])
def test_one_training_step(name):
    torch.manual_seed(0)
    model = build_model(name, 10, (3, 32, 32), seed=0).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    loss = nn.functional.cross_entropy(model(x), y)
    assert torch.isfinite(loss)
    loss.backward()
    head = model.get_submodule(classifier_name(model))
    assert head.weight.grad is not None and torch.count_nonzero(head.weight.grad) > 0
    opt.step()
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seeded_init_is_deterministic_and_leaves_global_rng(name):
    shape = (1, 28, 28)
    rng = torch.get_rng_state()
    a = build_model(name, 10, shape, seed=3).state_dict()
    b = build_model(name, 10, shape, seed=3).state_dict()
    assert torch.equal(rng, torch.get_rng_state())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build_model(name, 10, shape, seed=4).state_dict()
    w = classifier_name(build_model(name, 10, shape)) + ".weight"
    assert not torch.equal(a[w], c[w])


def test_unseeded_builds_differ():
    a = build_model("mlp", 10, (1, 28, 28)).fc.weight
    b = build_model("mlp", 10, (1, 28, 28)).fc.weight
    assert not torch.equal(a, b)


def test_unknown_name_lists_allowed_names():
    with pytest.raises(ModelError) as info:
        build_model("resnet50", 10, (3, 32, 32))
    assert isinstance(info.value, ValueError)
    for name in MODEL_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "name,k,shape",
    [
        ("cnn", 10, (3, 32)),
        ("cnn", 10, (3, 0, 32)),
        ("cnn", 10, "3x32x32"),
        ("cnn", 10, (1, 3, 3)),
        ("squeezenet", 10, (1, 7, 7)),
        ("mlp", 0, (1, 28, 28)),
        ("mlp", 2.5, (1, 28, 28)),
    ],
)
def test_bad_arguments_raise_model_error(name, k, shape):
    with pytest.raises(ModelError):
        build_model(name, k, shape)


def test_smallest_supported_inputs_work():
    for name, size in [("cnn", 4), ("squeezenet", 8), ("resnet18", 8), ("vgg11", 8), ("alexnet", 8)]:
        model = build_model(name, 5, (1, size, size)).eval()
        with torch.no_grad():
            assert model(torch.randn(2, 1, size, size)).shape == (2, 5)


def test_classifier_name_survives_copy_and_pickle():
    model = build_model("mobilenetv2", 10, (3, 32, 32))
    assert classifier_name(copy.deepcopy(model)) == "classifier.1"
    assert classifier_name(pickle.loads(pickle.dumps(model))) == "classifier.1"


def test_classifier_name_fallback_for_foreign_models():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert classifier_name(model) == "3"
    assert top_level_children(model) == ["0", "1", "2", "3"]
    assert count_parameters(model) == 4 * 8 + 8 + 8 * 3 + 3
    with pytest.raises(ModelError):
        classifier_name(nn.Sequential(nn.ReLU()))
