"""Flower 1.42's simulation delivers messages with one pass over the LinkState per node; this makes it one pass.

Flower's Simulation Engine (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) wakes every 0.1 s
and asks its in-memory LinkState for the next message of EVERY simulated node, one ``get_message_ins(node_id)``
call each; each call walks all stored messages and validates each one (expiry, federation). A sweep therefore
costs nodes × messages validations, under the LinkState's lock and in the process that also runs the ServerApp:
with 1,000 nodes and a 50-client cohort that is 50,000 validations every 0.1 s, and 1,000,000 when the final
evaluation messages all 1,000 clients. py-spy on ``bench/scale.py``'s 1,000-client FedAvg run put 65 % of the
server process's samples in that loop (docs/performance.md).

:func:`deliverable_messages` does the same sweep in one pass: every stored message is validated once (Flower's own
``_check_stored_messages``, which deletes expired messages and messages whose nodes left), then each node's first
undelivered message is taken and marked delivered, as ``get_message_ins(node_id, limit=1)`` does. What a sweep
hands out is the same; only the order within a sweep differs (the order the messages were stored, not the order of
the node ids). :func:`install` swaps it into Flower's engine; it is called when the ClientApp module loads, which
Flower's simulation does in its main thread BEFORE ``run_api`` starts the sweeping thread (``start_vce`` loads the
ClientApp to test it first). A LinkState that is not the in-memory one gets Flower's own sweep.
Being one pass, a sweep is cheap enough to run every :data:`INTERVAL` (0.02 s) instead of 0.1 s (less often when
the LinkState holds so many messages that a sweep takes over 1 ms, :func:`interval_after`), and
:func:`poll_replies_often` has the ServerApp's in-memory grid look for replies as often: between the last reply of a
round and the next round's first message both waits used to add ~0.1 s on average, while both workers idled
(docs/performance.md). ``FEDAPPS_MESSAGE_SWEEP=flower`` keeps Flower's sweep and polling (``bench/scale.py
--sweep flower`` measures it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from queue import Queue
from typing import Any

from fedapps.flower import require_checked_flower

VCE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"
ENV = "FEDAPPS_MESSAGE_SWEEP"
INTERVAL = 0.02  # seconds between two sweeps, and between two polls of the ServerApp's grid for replies (Flower: 0.1)
FLOWER_INTERVAL = 0.1  # Flower's own wait: never waited longer than this
SWEEP_WORKAROUND = f"set {ENV}=flower to keep Flower's own sweep and polling"
BUDGET = 20  # wait at least this many times as long as a sweep or poll took: at most ~5 % of a core on polling


def interval_after(seconds: float) -> float:
    """The wait after a sweep or poll that took ``seconds``: :data:`INTERVAL`, longer when the LinkState holds so
    many messages that polling that often would cost more than 1/(BUDGET + 1) of a core (a poll over 1,000
    outstanding messages takes ~2-3 ms here), never longer than Flower's 0.1 s."""
    return min(FLOWER_INTERVAL, max(INTERVAL, BUDGET * seconds))


def deliverable_messages(state: Any, node_ids: set[int]) -> list:
    """The first undelivered message of each node in ``node_ids``, in stored order, marked delivered.

    ``state`` is Flower's ``InMemoryLinkState``; all stored messages are validated first (invalid ones deleted).
    """
    with state.lock:
        state._check_stored_messages(set(state.message_ins_store))  # noqa: SLF001 - one validation per message
        first: dict[int, Any] = {}
        for message in state.message_ins_store.values():
            metadata = message.metadata
            node = metadata.dst_node_id
            if metadata.delivered_at == "" and node in node_ids and node not in first:
                first[node] = message
        delivered_at = datetime.now(tz=UTC).isoformat()
        for message in first.values():
            message.metadata.delivered_at = delivered_at
    return list(first.values())


def one_pass_sweep(flower_sweep: Callable) -> Callable:
    """A drop-in for Flower's ``add_messages_to_queue`` that sweeps with :func:`deliverable_messages`."""
    from flwr.server.superlink.linkstate import InMemoryLinkState

    def add_messages_to_queue(state: Any, queue: Queue, nodes_mapping: Iterable[int], f_stop: threading.Event) -> None:
        if not isinstance(state, InMemoryLinkState):
            return flower_sweep(state, queue, nodes_mapping, f_stop)
        node_ids = set(nodes_mapping)
        while not f_stop.is_set():
            started = time.perf_counter()
            for message in deliverable_messages(state, node_ids):
                queue.put(message)
            f_stop.wait(interval_after(time.perf_counter() - started))

    add_messages_to_queue.flower_sweep = flower_sweep  # type: ignore[attr-defined]  # read by install / in_use
    return add_messages_to_queue


def install() -> bool:
    """Swap the one-pass sweep into Flower's simulation engine if it is loaded in this process (it is in
    ``flwr-simulation``; Ray workers and SuperNodes do not load it). True when installed (or already)."""
    vce = sys.modules.get(VCE_MODULE)
    if vce is None or os.environ.get(ENV, "").strip().lower() == "flower":
        return False
    require_checked_flower("The one-pass message sweep of the simulation engine", workaround=SWEEP_WORKAROUND)
    current = getattr(vce, "add_messages_to_queue", None)
    if current is None:
        return False  # a Flower without this function: nothing to replace
    if getattr(current, "flower_sweep", None) is None:
        vce.add_messages_to_queue = one_pass_sweep(current)  # type: ignore[attr-defined]  # Flower's engine, patched
    return True


def in_use() -> str | None:
    """Which sweep this process's simulation engine runs: "one-pass", "flower", or None when it is not loaded
    (deployment: the SuperLink's Fleet API delivers; summary.json's ``simulation_message_sweep``)."""
    vce = sys.modules.get(VCE_MODULE)
    if vce is None:
        return None
    return "one-pass" if getattr(vce.add_messages_to_queue, "flower_sweep", None) is not None else "flower"


def poll_replies_often(grid: Any) -> bool:
    """Flower's in-memory grid (simulation) polls its LinkState for replies every 0.1 s: every :data:`INTERVAL`
    instead, or as :func:`interval_after` its last poll says (a poll costs a lookup per outstanding message).
    Other grids (deployment) are left alone. True when set."""
    if os.environ.get(ENV, "").strip().lower() == "flower":
        return False
    require_checked_flower("Polling the simulation's grid for replies every 0.02 s", workaround=SWEEP_WORKAROUND)
    from flwr.superlink.grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return False
    pull = grid.pull_messages

    def timed_pull(message_ids: Iterable[str]) -> Iterable:
        started = time.perf_counter()
        replies = pull(message_ids)
        grid.pull_interval = interval_after(time.perf_counter() - started)  # send_and_receive's next wait
        return replies

    grid.pull_messages = timed_pull  # type: ignore[method-assign]  # this grid's own poll, patched
    grid.pull_interval = INTERVAL
    return True
