"""Every touch of Flower beyond its public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``,
``flwr.simulation``): the in-process grid, the simulation's message sweep, the Control API and CLI internals the
``fedapps`` command uses, waiting for nodes, describing node data, fault injection.

Flower's private modules change between releases without notice, so each use of one is gated on the Flower release
it was written and tested against (:data:`CHECKED_FLWR`, the range pyproject.toml pins): with another release
installed, :func:`require_checked_flower` stops with a clear error that names the installed version and the fix.
``tests/test_architecture.py`` checks that no module outside this package imports a private Flower module.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

from flwr.app import Message

CHECKED_FLWR = (1, 42)  # the Flower minor release this package's private touches were written and tested against


class MessageGrid(Protocol):
    """What the server side uses of a Flower ``Grid``: the connected nodes, and messages out with their replies back.
    Flower's grids (simulation, deployment) and the in-process grid (:mod:`fedapps.flower.inprocess`) all have it."""

    def get_node_ids(self) -> Iterable[int]: ...

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]: ...


class UnsupportedFlowerVersion(RuntimeError):
    """The installed Flower is not the release a private touch was checked against."""


def installed_flwr() -> str:
    """The installed ``flwr`` distribution's version ("" when it is not installed)."""
    try:
        return version("flwr")
    except PackageNotFoundError:
        return ""


def is_checked_release(flwr_version: str) -> bool:
    """True when ``flwr_version`` (e.g. "1.42.0", "1.42.1rc1") is a release of :data:`CHECKED_FLWR`."""
    parts = flwr_version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) == CHECKED_FLWR
    except (IndexError, ValueError):
        return False


def require_checked_flower(what: str, workaround: str = "", flwr_version: str | None = None) -> None:
    """Stop with :class:`UnsupportedFlowerVersion` unless the installed Flower is a :data:`CHECKED_FLWR` release.

    ``what`` names the private touch (shown to the user); ``workaround`` says how to run without it, if one exists."""
    found = installed_flwr() if flwr_version is None else flwr_version
    if is_checked_release(found):
        return
    checked = ".".join(map(str, CHECKED_FLWR))
    hint = f"; or {workaround}" if workaround else ""
    raise UnsupportedFlowerVersion(
        f"{what} uses Flower {checked}'s private internals, but flwr {found or '(not installed)'} is installed: "
        f"install the release this project pins (pip install 'flwr[simulation]>={checked},<1.{CHECKED_FLWR[1] + 1}')"
        f"{hint}"
    )
