"""``package.module:name`` in a config: the user's own model factory (``model.name``) or data loader
(``data.source``), imported by name wherever it is needed — by the config check, by the server and by every client
process. Those processes must therefore be able to import the module: an installed package, or its folder on
PYTHONPATH when ``fedapps run`` / ``flwr run`` / a SuperNode starts (docs/configuration.md#your-own-model).

A client imports and calls the callable its message names: in a deployment, a node runs only code installed on its
own machine, but the server chooses which of it (docs/deployment.md).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
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
