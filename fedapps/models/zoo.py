"""Model registry: name → builder, plus the helpers strategies need (classifier name, children, size)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fedapps.config import ConfigError
from fedapps.importpath import is_import_path, load_callable
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
_NO_CLASSIFIER_ATTR = "_fedapps_no_classifier"  # a user's model without one: why (classifier_name raises it)


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
    :mod:`fedapps.models.heads` of that name (same place, same in/out features). A name ``package.module:factory``
    is the user's own model: ``factory(num_classes, input_shape)`` must return an ``nn.Module``
    (:func:`build_user_model`). With a seed the initialisation is deterministic; the global RNG is left as it was.
    """
    name, head_kind = split_head(name)
    spec = _REGISTRY.get(name)
    if spec is None and not is_import_path(name):
        raise ModelError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}, or package.module:factory")
    if head_kind and head_kind not in HEADS:
        raise ModelError(
            f"unknown classifier head {head_kind!r} in model '{name}+{head_kind}'; allowed: {', '.join(HEADS)}"
        )
    if spec is None:
        return build_user_model(name, num_classes, input_shape, seed, head_kind)
    _check_classes(num_classes)
    shape = _check_shape(name, input_shape, spec.min_size)
    with seeded(seed):
        model = spec.builder(num_classes, shape)
        if spec.kaiming:
            vision.kaiming_init(model)
        if head_kind:
            _swap_head(model, spec.classifier, head_kind)
    setattr(model, _CLASSIFIER_ATTR, spec.classifier)
    head = model.get_submodule(spec.classifier)
    assert isinstance(head, nn.Linear) and head.out_features == num_classes, (name, head)
    return model


def _check_classes(num_classes: Any) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes must be a positive int, got {num_classes!r}")


def _swap_head(model: nn.Module, classifier: str, head_kind: str) -> None:
    """Replace the final nn.Linear ``classifier`` by the head ``head_kind`` (same place, same in/out features)."""
    linear = model.get_submodule(classifier)
    assert isinstance(linear, nn.Linear), classifier  # every caller names a final nn.Linear
    parent, _, attr = classifier.rpartition(".")
    setattr(model.get_submodule(parent), attr, HEADS[head_kind](linear.in_features, linear.out_features))


USER_MODEL_KEY = "model.name"  # where a user's factory is named (model.per_client entries name theirs too)


def user_factory(name: str, key: str = USER_MODEL_KEY) -> Callable[..., Any]:
    """The user's model factory ``package.module:factory``: imported, callable, and callable as
    ``factory(num_classes, input_shape)`` (ModelError naming ``key`` otherwise)."""
    factory = load_callable(key, name, ModelError)
    try:
        inspect.signature(factory).bind(10, (1, 28, 28))
    except TypeError as exc:
        raise ModelError(
            f"'{key}' is {name!r}, which cannot be called as factory(num_classes, input_shape) ({exc}): give it "
            "two parameters, the class count (int) and the input shape (C, H, W)"
        ) from None
    except ValueError:  # a builtin without a signature: the call itself will tell
        pass
    return factory


def user_classifier(model: nn.Module, num_classes: int) -> tuple[str, str]:
    """(the classifier's dotted name, '') of a user's model: its last registered nn.Linear, when that has
    ``num_classes`` outputs; else ('', why there is none) — the strategies that need one refuse the model with it."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return "", "has no nn.Linear layer, so no classifier head is found (its final nn.Linear is the head)"
    last, layer = linears[-1]
    if layer.out_features != num_classes:
        return "", (
            f"has as its last nn.Linear '{last}' with {layer.out_features} outputs, not the {num_classes} classes, "
            "so no classifier head is found (the head is the last nn.Linear registered, with one output per class)"
        )
    return last, ""


def build_user_model(
    name: str,
    num_classes: int,
    input_shape: Any,
    seed: int | None = None,
    head_kind: str = "",
    key: str = USER_MODEL_KEY,
) -> nn.Module:
    """The user's model ``package.module:factory``: ``factory(num_classes, (C, H, W))`` under the seed, which must
    return an ``nn.Module``; its classifier (:func:`user_classifier`) is recorded for :func:`classifier_name`, and
    replaced by ``head_kind`` where one is asked for."""
    factory = user_factory(name, key)
    _check_classes(num_classes)
    shape = _check_shape(name, input_shape, 1)
    with seeded(seed):
        try:
            model = factory(num_classes, shape)
        except Exception as exc:
            raise ModelError(
                f"'{key}' is {name!r}: {name}({num_classes}, {shape}) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"'{key}' is {name!r}, whose factory returned a {type(model).__name__}, not a "
                "torch.nn.Module: return the model (e.g. return MyNet(num_classes))"
            )
        head, why = user_classifier(model, num_classes)
        if head_kind:
            if not head:
                raise ModelError(f"'{key}' is {name!r}, whose model {why}; the {head_kind} head replaces it")
            _swap_head(model, head, head_kind)
    setattr(model, _CLASSIFIER_ATTR, head)
    setattr(model, _NO_CLASSIFIER_ATTR, why)
    return model


@functools.lru_cache(maxsize=32)
def check_user_model(name: str, num_classes: int, input_shape: tuple[int, int, int], key: str = USER_MODEL_KEY) -> str:
    """Build the user's model ``name`` once and run a batch of two zero inputs through it: ModelError unless it
    returns a (2, num_classes) tensor. Returns why it has no classifier head ('' when it has one). Cached: the config
    is checked by the CLI, then by the server."""
    model = build_user_model(name, num_classes, input_shape, seed=0, key=key)
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((2, *input_shape)))
    except Exception as exc:
        raise ModelError(
            f"'{key}' is {name!r}: its model fails on a batch of inputs of shape (2, "
            f"{', '.join(map(str, input_shape))}) (the data's shape): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(
            f"'{key}' is {name!r}: on a batch of 2 inputs its model returns {got}, but it must return "
            f"logits of shape (2, {num_classes}): one row per input, one column per class"
        )
    return str(getattr(model, _NO_CLASSIFIER_ATTR, ""))


def classifier_name(model: nn.Module) -> str:
    """Dotted module name of the final nn.Linear classifier (weight: num_classes × d)."""
    name = getattr(model, _CLASSIFIER_ATTR, None)
    if name:
        return name
    if name == "":  # a user's model built by build_model without one
        raise ModelError(f"{type(model).__name__} {getattr(model, _NO_CLASSIFIER_ATTR, 'has no classifier head')}")
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
    """``model.name`` and every ``model.per_client`` entry must name a model of the zoo, or a user's factory
    ``package.module:factory`` that imports and takes (num_classes, input_shape) (ModelError otherwise)."""
    for key, value in [("model.name", name)] + [(f"model.per_client[{i}]", v) for i, v in enumerate(per_client)]:
        if is_import_path(value):
            user_factory(value, key)
        elif value not in MODEL_NAMES:
            raise ModelError(
                f"'{key}' is '{value}', which is not known; allowed: {', '.join(MODEL_NAMES)}, or your own "
                "model as package.module:factory"
            )
