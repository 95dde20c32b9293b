"""``package.module:name`` in a config: the user's own model factory (``model.name``) or data loader
(``data.source``), imported by name wherever it is needed — by the config check, by the server and by every client
process. Those processes must therefore be able to import the module: an installed package, or its folder on
PYTHONPATH when ``fedapps run`` / ``flwr run`` / a SuperNode starts (docs/configuration.md#your-own-model).

A client imports and calls the callable its message names: in a deployment, a node runs only code installed on its
own machine, but the server chooses which of it (docs/configuration.md#your-own-model).

Also here: the check that the project's other top-level modules (``strategies``, ``server_app``, ``client_app``,
``fedapps_tools``) are the ones installed beside ``fedapps``, not a user's modules of the same names
(:func:`check_own_modules`).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedapps.config import ConfigError

# dotted module name, a colon, a dotted attribute path (a callable, or a class's static method)
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
EXAMPLE = "mypackage.models:make_net"

IMPORTABLE_EVERYWHERE = (
    "it must be importable by every process of the run (the config check, the server, every client): install "
    "its package (pip install -e /path/to/your/project) or put the folder that holds it on PYTHONPATH before "
    "starting fedapps run, flwr run or a SuperNode"
)


def is_import_path(value: object) -> bool:
    """True for a name written as an import path (it holds a colon); whether it is a well-formed one, and importable,
    is :func:`load_callable`'s to say."""
    return isinstance(value, str) and ":" in value


def load_callable(key: str, ref: str, error: type[ConfigError] = ConfigError) -> Callable[..., Any]:
    """The callable ``ref`` (``package.module:name``) names; ``error`` (a ConfigError) naming ``key`` when it is
    malformed, its module cannot be imported (or fails while importing), the attribute is missing, or is not
    callable."""
    if not IMPORT_PATH.match(ref):
        raise error(
            f"'{key}' is {ref!r}, which is not an import path: write package.module:callable (a dotted module "
            f"name, a colon, the name of a function or class in it), e.g. {EXAMPLE}"
        )
    module_name, _, attribute = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise error(
                f"'{key}' is {ref!r}, but there is no module {module_name!r} here: {IMPORTABLE_EVERYWHERE}"
            ) from exc
        raise error(f"'{key}' is {ref!r}: importing {module_name!r} failed: ModuleNotFoundError: {exc}") from exc
    except Exception as exc:
        raise error(f"'{key}' is {ref!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for depth, part in enumerate(attribute.split(".")):
        if not hasattr(obj, part):
            where = module_name if depth == 0 else f"{module_name}:{'.'.join(attribute.split('.')[:depth])}"
            names = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_"))[:12]
            listing = f"; its callables: {', '.join(names)}" if names else ""
            raise error(
                f"'{key}' is {ref!r}, but {where} ({getattr(module, '__file__', None) or 'no file'}) has no "
                f"attribute {part!r}{listing}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(
            f"'{key}' is {ref!r}, which is not callable (an object of type {type(obj).__name__}): name a function "
            f"or a class (e.g. {EXAMPLE})"
        )
    return obj


# The project's top-level names besides ``fedapps`` (installed beside it: pyproject.toml [tool.setuptools]). A module of
# the same name earlier on the Python path (a user's strategies.py, say) would be imported in their place.
PROJECT_MODULES = ("strategies", "server_app", "client_app", "fedapps_tools")


def module_root(name: str) -> Path | None:
    """The folder on the Python path that a top-level module ``name`` is (or would be) imported from; None when it
    is nowhere. Nothing is imported: a loaded module's file, else ``importlib.util.find_spec``."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None) if module is not None else importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: the folder that holds its folder
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    return Path(spec.origin).resolve().parent if spec.origin else None


def shadowed_modules() -> list[str]:
    """One sentence for each of :data:`PROJECT_MODULES` that would not come from where ``fedapps`` comes from (another
    module of that name is earlier on the Python path); empty when they all do."""
    home = Path(__file__).resolve().parent.parent  # the folder that holds fedapps/
    out = []
    for name in PROJECT_MODULES:
        root = module_root(name)
        if root is not None and root != home:
            out.append(
                f"the module '{name}' comes from {root}, not from fedapps' own folder {home}: another module of that "
                "name is earlier on the Python path; rename yours, or take its folder off PYTHONPATH (and out of the "
                "working directory of the command)"
            )
    return out


def check_own_modules() -> None:
    """ImportError naming each of the project's top-level modules that another module of the same name shadows
    (:func:`shadowed_modules`): said before importing them, instead of a confusing error from inside them."""
    problems = shadowed_modules()
    if problems:
        raise ImportError("; ".join(problems))
