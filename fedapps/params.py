"""Declared strategy parameters: a dataclass field says its default and what values are allowed.

    @dataclass
    class MyParams:
        lr: float = param(1e-3, gt=0, help="learning rate")
        mode: str = param("mean", choices=("mean", "median"), help="how replies are combined")

``parse_params(MyParams, raw, "strategy.params.mine")`` builds the dataclass from a plain mapping (the same
typed coercion as the rest of the config: unknown keys and wrong types are errors naming the key) and checks
every declared constraint, raising :class:`ConfigError` with the full key, the value and what is allowed.
Checks that involve more than one value live in the strategy's ``check`` hook, not here.

This module knows no strategy (the registry in ``strategies`` uses it, not the other way round).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fedapps.config import ConfigError, _build_dataclass, did_you_mean

META_KEY = "fedapps.param"


@dataclass(frozen=True)
class Constraint:
    """What a parameter allows (all optional)."""

    choices: tuple[Any, ...] | Callable[[], Any] | None = None  # a tuple, or a callable returning one (registries)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    normalise: Callable[[Any], Any] | None = None  # applied after type coercion, before the checks
    help: str = ""  # what it is: in the generated reference (docs/reference/params/) and after the rule in errors

    def allowed_choices(self) -> tuple[Any, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def range_text(self) -> str:
        """'> 0', '>= 1', 'in [0, 1]', 'in (0, 1)' ... ('' when unbounded)."""
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if self.ge is not None else "> ") + low[1:]
        if high:
            return ("<= " if self.le is not None else "< ") + high[:-1]
        return ""

    def in_range(self, value: Any) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def param(
    default: Any,
    *,
    choices: tuple[Any, ...] | Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    normalise: Callable[[Any], Any] | None = None,
    help: str = "",  # noqa: A002 - the natural name
) -> Any:
    """A dataclass field with a default and declared constraints (checked by :func:`parse_params`)."""
    meta = {META_KEY: Constraint(choices, ge, gt, le, lt, normalise, help)}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def constraint(f: dataclasses.Field) -> Constraint | None:
    """The declared constraint of a field (None for a plain field)."""
    return f.metadata.get(META_KEY)


def parse_params(cls: type, raw: Mapping[str, Any] | None, prefix: str) -> Any:
    """Build ``cls`` from ``raw`` (None: all defaults) and check every declared constraint.

    ``prefix`` is the section's full key, e.g. ``strategy.params.cosmos``; messages name ``prefix.field``.
    """
    prefix = prefix.rstrip(".")
    obj = _build_dataclass(cls, {} if raw is None else raw, prefix=f"{prefix}.")
    for f in fields(cls):
        c = constraint(f)
        if c is None:
            continue
        value = getattr(obj, f.name)
        if c.normalise is not None:
            value = c.normalise(value)
            setattr(obj, f.name, value)
        check_value(f"{prefix}.{f.name}", value, c)
    return obj


def check_value(key: str, value: Any, c: Constraint) -> None:
    """Raise ConfigError if ``value`` breaks ``c``."""
    note = f" ({c.help})" if c.help else ""
    allowed = c.allowed_choices()
    if allowed is not None and value not in allowed:
        raise ConfigError(
            f"'{key}' is '{value}', which is not known{did_you_mean(value, allowed)}; allowed: "
            f"{', '.join(map(str, allowed))}{note}"
        )
    if not c.in_range(value):
        raise ConfigError(f"'{key}' must be {c.range_text()}{note}, got {value}")


def lower(value: Any) -> str:
    """Normaliser for string choices: YAML reads a bare ``true`` as a boolean, and ``NORM`` means ``norm``."""
    return str(value).lower()
