"""Strategies, one module per algorithm, and the name -> class registry.

Every module in this package that defines a subclass of PersonalisedStrategy with a ``name`` is
registered automatically: adding a strategy means adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from strategies.base import PersonalisedStrategy


def _discover() -> dict[str, type[PersonalisedStrategy]]:
    found: dict[str, type[PersonalisedStrategy]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, PersonalisedStrategy) and obj.name and obj.__module__ == module.__name__:
                if obj.name in found:
                    raise RuntimeError(f"two strategies are named '{obj.name}'")
                found[obj.name] = obj
    return found


STRATEGIES: dict[str, type[PersonalisedStrategy]] = _discover()

__all__ = ["STRATEGIES", "PersonalisedStrategy"]
