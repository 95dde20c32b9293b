"""An in-process stand-in for Flower's Grid: the same messages served by the same generic client code,
sequentially, in this process, without Ray or a SuperLink. For unit tests of strategies and for quick
sweeps; real runs go through `flwr run` (Ray simulation) or SuperLink/SuperNode deployment.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.app.error import Error

from flwr.supercore.task_identity import TaskIdentity

from fedapps import faults
from fedapps.worker import handle

log = logging.getLogger("fedapps")


class InProcessGrid:
    """Nodes first_node_id + (0..N-1) with partition-id 0..N-1, each with its own persistent Context.state.

    ``record=True`` keeps every message sent and every reply in ``sent`` / ``replies`` (for tests that inspect
    the traffic); by default nothing is kept, so memory does not grow with the run.

    ``mods`` are Flower client mods (``mod(msg, context, call_next) -> Message``) wrapped around the worker as
    ``ClientApp(mods=...)`` does, the first outermost; e.g. :func:`fedapps.faults.faults_mod` with a node config
    ``faults`` (``node_configs={1: {"faults": "shape@1/1"}}``). A mod raising :class:`fedapps.faults.ReplyDropped`
    means no reply; a reply :func:`fedapps.faults.take_duplicate` marks is delivered twice. ``send_and_receive``
    honours its ``timeout``: replies completed after it (counted from the call) are not delivered.
    """

    def __init__(self, num_nodes: int, drop: Callable[[int, int], bool] | None = None,
                 node_configs: dict[int, dict] | None = None, first_node_id: int = 100, record: bool = False,
                 mods: list[Callable] | None = None, node_ids: list[int] | None = None) -> None:
        # Flower's node ids are unsigned 64-bit and usually large: tests pass first_node_id >= 2**63 to mimic them;
        # ``node_ids[i]`` (instead of first_node_id + i) serves partition i, in any order, as Flower's random ids do
        ids = list(node_ids) if node_ids is not None else [first_node_id + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes:
            raise ValueError(f"node_ids must be {num_nodes} distinct ids, got {ids}")
        self.contexts = {
            node: Context(run_id=1, node_id=node,
                          node_config={"partition-id": i, "num-partitions": num_nodes, **(node_configs or {}).get(i, {})},
                          state=RecordDict(), run_config={})
            for i, node in enumerate(ids)
        }
        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
            if getattr(TaskIdentity, attr) is None:  # Message() needs an identity outside Flower's runtime
                setattr(TaskIdentity, attr, value)
        self.drop = drop  # drop(round, partition_id) -> True simulates a client that never replies
        self.record = record
        self.mods = [faults.faults_mod] if mods is None else list(mods)  # as client_app.py: a no-op unless asked
        self.sent: list[Message] = []  # stays empty unless record=True
        self.replies: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def _serve(self, msg: Message, ctx: Context) -> Message:
        call: Callable[[Message, Context], Message] = handle
        for mod in reversed(self.mods):
            call = functools.partial(_apply_mod, mod, call)
        return call(msg, ctx)

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        out = []
        start = time.monotonic()
        for msg in messages:
            if self.record:
                self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            rnd = int(msg.metadata.group_id or 0)
            if self.drop is not None and self.drop(rnd, int(ctx.node_config["partition-id"])):
                continue
            try:
                reply = self._serve(msg, ctx)
            except faults.ReplyDropped as exc:
                log.warning("node %s: %s", msg.metadata.dst_node_id, exc)
                continue
            except Exception as exc:  # as Flower does: an exception becomes an error reply
                log.warning("node %s raised %s", msg.metadata.dst_node_id, exc)
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            if timeout is not None and time.monotonic() - start > timeout:
                log.warning("node %s replied after the %.1f s timeout; reply not delivered", msg.metadata.dst_node_id, timeout)
                continue
            out.append(reply)
            if faults.take_duplicate(reply):
                out.append(reply)
        if self.record:
            self.replies.extend(out)
        return out


def _apply_mod(mod: Callable, call_next: Callable[[Message, Context], Message], msg: Message, ctx: Context) -> Message:
    return mod(msg, ctx, call_next)
