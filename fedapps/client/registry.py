"""The registries through which an algorithm adds client behaviour, from its own module.

The generic client (:mod:`fedapps.client.worker`) knows no algorithm: it looks every operation a message names up here.
An algorithm module registers what only it needs next to its server strategy:

- ``@client_op("select-model")`` — a whole operation ``fn(worker, tag)``, run when a message lists it;
- ``@training_term("wdr")`` — a term added to the local training loss, ``fn(worker, settings) -> Regulariser |
  None`` (None when the message's ``train.*`` settings do not ask for it; ``settings`` is the operation's
  :class:`fedapps.wire.protocol.Section`, the algorithm's own settings in its ``extra``, named by constants of the
  algorithm's module); ``data_free=True`` declares that the term reads nothing of the client's data (e.g. a proximal
  term to the received model), the one kind DP-SGD can add after its noise (:mod:`fedapps.client.privacy`);
- ``@distill_term("rb")`` — a term added to the distillation loss on U, ``fn(worker, settings) -> DistillTerm |
  None`` (:data:`fedapps.client.ops.DistillTerm`; None when the message's ``distill.*`` settings do not ask for it);
- ``@distill_weighting("label-free")`` — per-sample weights on the public set U for ``distill``,
  ``fn(worker, targets, rows) -> Tensor``.

Each name may be registered once; the client resolves names when a message arrives and refuses unknown ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedapps.wire import protocol

OpFn = Callable[[Any, str], None]
TermFn = Callable[[Any, Any], Any]  # (worker, its operation's protocol.Section) -> term or None
WeightingFn = Callable[[Any, Any, Any], Any]


class ProtocolError(RuntimeError):
    """The message cannot be served (wrong public set, unknown operation, incompatible arrays)."""


@dataclass(frozen=True)
class ClientOp:
    """A named client operation and the tag its metrics carry when the message gives none."""

    name: str
    run: OpFn
    default_tag: str


OPERATIONS: dict[str, ClientOp] = {}
TRAINING_TERMS: dict[str, TermFn] = {}
DATA_FREE_TERMS: set[str] = set()  # training terms that read nothing of the client's data (see training_term)
DISTILL_TERMS: dict[str, TermFn] = {}
DISTILL_WEIGHTINGS: dict[str, WeightingFn] = {}


def _register(table: dict, name: str, value: Any, what: str) -> None:
    if name in table and table[name] is not value:
        raise RuntimeError(f"two {what}s are registered as '{name}'")
    table[name] = value


def client_op(name: str, default_tag: str | None = None) -> Callable[[OpFn], OpFn]:
    """Register ``fn(worker, tag)`` as the client operation ``name`` (metrics tagged ``default_tag`` or ``name``).

    An evaluation operation (a name starting ``evaluate``) also files its tag in the wire's
    :data:`~fedapps.wire.protocol.EVALUATION_TAGS`, where the server's reply validator reads it."""

    def register(fn: OpFn) -> OpFn:
        _register(OPERATIONS, name, ClientOp(name, fn, default_tag or name), "client operation")
        if name.startswith("evaluate"):
            _register(protocol.EVALUATION_TAGS, name, default_tag or name, "evaluation tag")
        return fn

    return register


def training_term(name: str, data_free: bool = False) -> Callable[[TermFn], TermFn]:
    """Register a builder of an extra training-loss term (see the module docstring)."""

    def register(fn: TermFn) -> TermFn:
        _register(TRAINING_TERMS, name, fn, "training term")
        if data_free:
            DATA_FREE_TERMS.add(name)
        return fn

    return register


def distill_term(name: str) -> Callable[[TermFn], TermFn]:
    """Register a builder of an extra distillation-loss term (see the module docstring)."""

    def register(fn: TermFn) -> TermFn:
        _register(DISTILL_TERMS, name, fn, "distillation term")
        return fn

    return register


def distill_weighting(name: str) -> Callable[[WeightingFn], WeightingFn]:
    """Register a per-sample weighting of U for ``distill`` (the message selects it by ``distill.weighting``)."""

    def register(fn: WeightingFn) -> WeightingFn:
        _register(DISTILL_WEIGHTINGS, name, fn, "distillation weighting")
        return fn

    return register


def parse_op(op: str) -> tuple[ClientOp, str]:
    """'evaluate:after' -> (the evaluate operation, 'after'); an untagged op gets its default tag."""
    base, _, tag = str(op).partition(":")
    if base not in OPERATIONS:
        raise ProtocolError(f"unknown client operation '{op}'; known: {', '.join(sorted(OPERATIONS))}")
    found = OPERATIONS[base]
    return found, tag or found.default_tag
