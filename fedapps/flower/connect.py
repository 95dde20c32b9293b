"""Waiting for the federation: a run starts only once the client nodes it expects are connected."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("fedapps")


class FederationIncomplete(RuntimeError):
    """Fewer client nodes connected than the run expects, after ``strategy.connect_timeout``."""


def wait_for_clients(
    grid: Any, expected: int, timeout: float, poll: float = 0.5, clock: Callable[[], float] = time.monotonic
) -> list[int]:
    """The connected node ids once at least ``expected`` are there (progress logged every ~10 s); after
    ``timeout`` seconds a :class:`FederationIncomplete` that says how many came and how to proceed."""
    start = clock()
    last_note = start
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= expected:
            return nodes
        now = clock()
        if now - start >= timeout:
            raise FederationIncomplete(
                f"only {len(nodes)} of the {expected} expected client nodes connected within {timeout:.0f} s "
                "(strategy.connect_timeout): start the missing SuperNodes, or set strategy.expected_clients="
                f"{max(len(nodes), 1)} to run with fewer, or raise strategy.connect_timeout"
            )
        if now - last_note >= 10:
            log.info(
                "waiting for client nodes: %d of %d connected (%.0f s of %.0f s)",
                len(nodes),
                expected,
                now - start,
                timeout,
            )
            last_note = now
        time.sleep(poll)
