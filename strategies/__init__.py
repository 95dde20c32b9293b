"""Strategies, one module per algorithm, and the name -> class registry (:data:`STRATEGIES`).

Every module in this package that defines a subclass of PersonalisedStrategy with a ``name`` is
registered automatically: adding a strategy means adding one file. :func:`resolve` and :func:`prepare_run` are
:mod:`fedapps.server.prepare`'s on this registry (the config itself knows no strategy).
"""

from __future__ import annotations

import importlib
import pkgutil

from fedapps.config import ExperimentConfig
from fedapps.server import prepare
from fedapps.server.prepare import PreparedRun, ResolvedStrategy, ignored_settings, report_ignored
from fedapps.server.strategy import PersonalisedStrategy, RunContext


def _discover() -> dict[str, type[PersonalisedStrategy]]:
    found: dict[str, type[PersonalisedStrategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, PersonalisedStrategy)
                and obj.name
                and obj.__module__ == module.__name__
            ):
                if obj.name in found:
                    raise RuntimeError(f"two strategies are named '{obj.name}'")
                found[obj.name] = obj
    return found


STRATEGIES: dict[str, type[PersonalisedStrategy]] = _discover()


def resolve(cfg: ExperimentConfig) -> ResolvedStrategy:
    """The strategy ``cfg`` names and its checked params (:func:`fedapps.server.prepare.resolve`)."""
    return prepare.resolve(cfg, STRATEGIES)


def prepare_run(config_path: str | None, overrides: str | list[str] = "") -> PreparedRun:
    """Config file -> checked config and strategy (:func:`fedapps.server.prepare.prepare_run`)."""
    return prepare.prepare_run(config_path, overrides, STRATEGIES)


__all__ = [
    "STRATEGIES",
    "PersonalisedStrategy",
    "PreparedRun",
    "ResolvedStrategy",
    "RunContext",
    "ignored_settings",
    "prepare_run",
    "report_ignored",
    "resolve",
]
