"""Model registry: name → builder, plus the helpers strategies need (classifier name, children, size)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fedapps.config import ConfigError
from fedapps.seeds import GLOBAL_RNG_LOCK

from . import simple, vision
from .heads import HEADS

Shape = tuple[int, int, int]


class ModelError(ConfigError):
    """Unknown model name, bad class count or input shape the model cannot take."""


@dataclass(frozen=True)
class _Spec:
    builder: Callable[[int, Shape], nn.Module]
    classifier: str  # dotted name of the final nn.Linear
    kaiming: bool  # COSMOS init (True) or PyTorch default init (False, as the papers' CNN code)
    min_size: int  # smallest height/width the model accepts


_REGISTRY: dict[str, _Spec] = {
    "cnn": _Spec(simple.FedAvgCNN, "fc", False, 4),
    "mlp": _Spec(simple.MLP, "fc", False, 1),
    "resnet18": _Spec(vision.resnet18, "fc", True, 1),
    "mobilenetv2": _Spec(vision.mobilenetv2, "classifier.1", True, 1),
    "squeezenet": _Spec(vision.squeezenet, "classifier.3", True, 8),
    "alexnet": _Spec(vision.alexnet, "classifier.6", True, 1),
    "vgg11": _Spec(partial(vision.vgg, cfg_name="vgg11"), "classifier.2", True, 1),
    "vgg16": _Spec(partial(vision.vgg, cfg_name="vgg16"), "classifier.2", True, 1),
}
MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)

_CLASSIFIER_ATTR = "_fedapps_classifier"


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Seed the CPU RNG for the block (a model built in it, by the zoo or by a user's own factory, is initialised the
    same every time) and restore it after, so the caller's global RNG is untouched. Either way
    the block holds :data:`GLOBAL_RNG_LOCK`: an initialisation draws from the global RNG, which another thread
    must not re-seed or draw from meanwhile."""
    with GLOBAL_RNG_LOCK:
        if seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(int(seed))
            yield


def _check_shape(name: str, input_shape: Any, min_size: int) -> Shape:
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ModelError(f"input_shape must be (channels, height, width), got {input_shape!r}") from None
    if len(shape) != 3 or min(shape) < 1:
        raise ModelError(f"input_shape must be 3 positive ints (C, H, W), got {input_shape!r}")
    if min(shape[1:]) < min_size:
        raise ModelError(f"model {name!r} needs height and width >= {min_size}, got {shape}")
    return shape


def split_head(name: str) -> tuple[str, str]:
    """'cnn+cosine' -> ('cnn', 'cosine'); 'cnn' -> ('cnn', '') (the zoo model's own linear classifier)."""
    base, _, head = name.partition("+")
    return base, head


def build_model(name: str, num_classes: int, input_shape: tuple[int, int, int], seed: int | None = None) -> nn.Module:
    """Build zoo model `name` for `num_classes` classes and (C, H, W) inputs.

    ``<model>+<head>`` (e.g. ``cnn+cosine``) builds the zoo model with its classifier replaced by the head of
    :mod:`fedapps.models.heads` of that name (same place, same in/out features). With a seed the
    initialisation is deterministic; the global RNG is left as it was.
    """
    name, head_kind = split_head(name)
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if head_kind and head_kind not in HEADS:
        raise ModelError(
            f"unknown classifier head {head_kind!r} in model '{name}+{head_kind}'; allowed: {', '.join(HEADS)}"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes must be a positive int, got {num_classes!r}")
    shape = _check_shape(name, input_shape, spec.min_size)
    with seeded(seed):
        model = spec.builder(num_classes, shape)
        if spec.kaiming:
            vision.kaiming_init(model)
        if head_kind:
            linear = model.get_submodule(spec.classifier)
            assert isinstance(linear, nn.Linear), spec.classifier  # every spec names its final nn.Linear
            parent, _, attr = spec.classifier.rpartition(".")
            setattr(model.get_submodule(parent), attr, HEADS[head_kind](linear.in_features, linear.out_features))
    setattr(model, _CLASSIFIER_ATTR, spec.classifier)
    head = model.get_submodule(spec.classifier)
    assert isinstance(head, nn.Linear) and head.out_features == num_classes, (name, head)
    return model


def classifier_name(model: nn.Module) -> str:
    """Dotted module name of the final nn.Linear classifier (weight: num_classes × d)."""
    name = getattr(model, _CLASSIFIER_ATTR, None)
    if name is not None:
        return name
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ModelError(f"{type(model).__name__} has no nn.Linear classifier")
    return linears[-1]  # models not from build_model: the last Linear registered


STATE_PARTS = ("state", "params", "body")


def state_part(model: nn.Module, part: str) -> dict[str, torch.Tensor]:
    """A part of the model's state dict: 'state' (parameters and buffers), 'params' (parameters only) or
    'body' (parameters and buffers outside the classifier head: what FedPer-style methods share)."""
    sd = model.state_dict()
    if part == "params":
        names = {n for n, _ in model.named_parameters()}
        return {k: v for k, v in sd.items() if k in names}
    if part == "body":
        head = classifier_name(model) + "."
        return {k: v for k, v in sd.items() if not k.startswith(head)}
    if part == "state":
        return dict(sd)
    raise ModelError(f"unknown model part '{part}'; allowed: {', '.join(STATE_PARTS)}")


def top_level_children(model: nn.Module) -> list[str]:
    """Names of the model's direct children in registration order (cwFedAvg's `last-N` layers)."""
    return [n for n, _ in model.named_children()]


def count_parameters(model: nn.Module) -> int:
    """Number of scalars in the model's parameters (buffers such as BN running stats excluded)."""
    return sum(p.numel() for p in model.parameters())


def check_model_names(name: str, per_client: list[str]) -> None:
    """``model.name`` and every ``model.per_client`` entry must name a model of the zoo (ModelError otherwise)."""
    for key, value in [("model.name", name)] + [(f"model.per_client[{i}]", v) for i, v in enumerate(per_client)]:
        if value not in MODEL_NAMES:
            raise ModelError(f"'{key}' is '{value}', which is not known; allowed: {', '.join(MODEL_NAMES)}")
