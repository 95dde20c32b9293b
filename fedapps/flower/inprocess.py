"""An in-process stand-in for Flower's Grid: the same messages served by the same generic client code, in this
process, without Ray or a SuperLink, several clients at a time on threads. For unit tests of strategies and for
quick sweeps; real runs go through `flwr run` (Ray simulation) or SuperLink/SuperNode deployment.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import Context, Message, RecordDict
from flwr.app.error import Error

from fedapps.client import ops
from fedapps.client.worker import handle
from fedapps.flower import faults, require_checked_flower

log = logging.getLogger("fedapps")

WORKERS_ENV = "FEDAPPS_INPROCESS_WORKERS"  # clients served at once (default: the CPUs this process may use)


def default_workers() -> int:
    """Clients served at once: ``FEDAPPS_INPROCESS_WORKERS``, else the CPUs this process may run on (each client
    trains on one torch thread, so that is one thread per core)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"{WORKERS_ENV}={value!r} must be a positive integer (clients the in-process engine "
                "serves at once), e.g. 1"
            )
        return int(value)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class _Job:
    """One message being served on its own thread, and what became of it."""

    msg: Message
    ctx: Context
    node_lock: threading.Lock
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # monotonic; None: no timeout
    done: bool = False
    abandoned: bool = False  # still running at its deadline: its reply, if it comes, is not delivered
    reply: Message | None = None
    dropped: str = ""  # the reason of a ReplyDropped fault (no reply)
    busy: bool = False  # the node was still serving an earlier (abandoned) message until this one's deadline

    @property
    def node(self) -> int:
        return int(self.msg.metadata.dst_node_id)


class InProcessGrid:
    """Nodes first_node_id + (0..N-1) with partition-id 0..N-1, each with its own persistent Context.state.

    ``record=True`` keeps every message sent and every reply in ``sent`` / ``replies`` (for tests that inspect
    the traffic); by default nothing is kept, so memory does not grow with the run.

    ``mods`` are Flower client mods (``mod(msg, context, call_next) -> Message``) wrapped around the worker as
    ``ClientApp(mods=...)`` does, the first outermost; e.g. :func:`fedapps.flower.faults.faults_mod` with a node config
    ``faults`` (``node_configs={1: {"faults": "shape@1/1"}}``). A mod raising
    :class:`fedapps.flower.faults.ReplyDropped` means no reply; a reply :func:`fedapps.flower.faults.take_duplicate`
    marks is delivered twice.

    ``wire=True`` sends every message, reply and node Context through Flower's own protobuf encoding
    (``flwr.common.serde``) and back, as they cross the wire and the Ray backend under `flwr run`: what does not
    survive the trip (state kept on the Context outside ``context.state``'s records, anything that relies on a
    message or Context being the same object from one call to the next) fails or changes the numbers here as it
    would there, without starting Ray.

    ``send_and_receive`` serves up to ``workers`` messages at once (default :func:`default_workers`), each on a
    thread of its own, and returns the replies in the order of the messages, whatever order they finished in.
    ``timeout`` is each client's own deadline, counted from when its message starts being served: a client still
    running then is abandoned (counted missing; its thread finishes in the background, its reply is never
    delivered, as a late reply under Flower) and the others are not held up by it. A node serves one message at a
    time: a message to a node still busy with an abandoned one waits for it, within its own deadline. Ctrl-C while
    the messages are served stops at once; the clients still training stop at their next minibatch.
    """

    def __init__(
        self,
        num_nodes: int,
        drop: Callable[[int, int], bool] | None = None,
        node_configs: dict[int, dict] | None = None,
        first_node_id: int = 100,
        record: bool = False,
        mods: list[Callable] | None = None,
        node_ids: list[int] | None = None,
        workers: int | None = None,
        wire: bool = False,
    ) -> None:
        # Flower's node ids are unsigned 64-bit and usually large: tests pass first_node_id >= 2**63 to mimic them;
        # ``node_ids[i]`` (instead of first_node_id + i) serves partition i, in any order, as Flower's random ids do
        ids = list(node_ids) if node_ids is not None else [first_node_id + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes:
            raise ValueError(f"node_ids must be {num_nodes} distinct ids, got {ids}")
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": i, "num-partitions": num_nodes, **(node_configs or {}).get(i, {})},
                state=RecordDict(),
                run_config={},
            )
            for i, node in enumerate(ids)
        }
        self.node_locks = {node: threading.Lock() for node in ids}  # a node serves one message at a time
        require_checked_flower(
            "The in-process engine (Message() outside Flower's runtime: flwr.supercore)",
            workaround="run through `flwr run` (--engine flower)",
        )
        from flwr.supercore.task_identity import TaskIdentity

        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
            if getattr(TaskIdentity, attr) is None:  # Message() needs an identity outside Flower's runtime
                setattr(TaskIdentity, attr, value)
        self.drop = drop  # drop(round, partition_id) -> True simulates a client that never replies
        self.record = record
        self.mods = [faults.faults_mod] if mods is None else list(mods)  # as client_app.py: a no-op unless asked
        self.workers = default_workers() if workers is None else max(1, int(workers))
        self.wire = wire
        self.sent: list[Message] = []  # stays empty unless record=True
        self.replies: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def _serve(self, msg: Message, ctx: Context) -> Message:
        call: Callable[[Message, Context], Message] = handle
        for mod in reversed(self.mods):
            call = functools.partial(_apply_mod, mod, call)
        if not self.wire:
            return call(msg, ctx)
        served = _through_wire_context(ctx)
        reply = call(_through_wire(msg), served)
        ctx.state = _through_wire_context(served).state  # what the node keeps must survive the trip too
        return _through_wire(reply)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        jobs: list[_Job] = []
        for msg in messages:
            if self.record:
                self.sent.append(msg)
            node = msg.metadata.dst_node_id
            ctx = self.contexts[node]
            rnd = int(msg.metadata.group_id or 0)
            if self.drop is not None and self.drop(rnd, int(ctx.node_config["partition-id"])):
                continue
            jobs.append(_Job(msg, ctx, self.node_locks[node]))
        self._run(jobs, timeout)
        out = []
        for job in jobs:
            if job.abandoned or job.busy:
                what = "was still serving an earlier message" if job.busy else "did not reply"
                log.warning(
                    "node %s %s within its %.1f s deadline: abandoned, counted missing", job.node, what, timeout
                )
                continue
            if job.dropped:
                log.warning("node %s: %s", job.node, job.dropped)
                continue
            assert job.reply is not None
            out.append(job.reply)
            if faults.take_duplicate(job.reply):
                out.append(job.reply)
        if self.record:
            self.replies.extend(out)
        return out

    def _run(self, jobs: list[_Job], timeout: float | None) -> None:
        """Serve the jobs, ``self.workers`` at a time, until each is done or past its deadline."""
        finished = threading.Condition()
        pending, running = deque(jobs), list[_Job]()
        try:
            while pending or running:
                while pending and len(running) < self.workers:
                    job = pending.popleft()
                    job.deadline = None if timeout is None else time.monotonic() + timeout
                    threading.Thread(
                        target=self._work, args=(job, finished), daemon=True, name=f"fedapps-node-{job.node}"
                    ).start()
                    running.append(job)
                with finished:
                    if not any(job.done for job in running):
                        deadlines = [job.deadline for job in running if job.deadline is not None]
                        finished.wait(None if not deadlines else max(0.0, min(deadlines) - time.monotonic()))
                now = time.monotonic()
                for job in list(running):
                    if job.done:
                        running.remove(job)
                    elif job.deadline is not None and now >= job.deadline:
                        job.abandoned = True
                        running.remove(job)
        except BaseException:  # Ctrl-C (or any error here): nothing more starts, what runs stops at its next step
            for job in jobs:
                job.cancel.set()
            raise

    def _work(self, job: _Job, finished: threading.Condition) -> None:
        """One message on this thread: wait for the node (within the deadline), serve it, record the outcome."""
        try:
            wait = -1.0 if job.deadline is None else max(0.0, job.deadline - time.monotonic())
            if not job.node_lock.acquire(timeout=wait):
                job.busy = True
                return
            try:
                if job.cancel.is_set():
                    return
                with ops.cancel_when(job.cancel):
                    job.reply = self._serve(job.msg, job.ctx)
            except faults.ReplyDropped as exc:
                job.dropped = str(exc)
            except Exception as exc:  # noqa: BLE001 - as Flower does: an exception becomes an error reply
                log.warning("node %s raised %s", job.node, exc)
                job.reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=job.msg)
            finally:
                job.node_lock.release()
        finally:
            with finished:
                job.done = True
                finished.notify_all()


def _apply_mod(mod: Callable, call_next: Callable[[Message, Context], Message], msg: Message, ctx: Context) -> Message:
    return mod(msg, ctx, call_next)


def _through_wire(msg: Message) -> Message:
    """``msg`` encoded as Flower sends it (protobuf) and decoded again."""
    from flwr.common.serde import message_from_proto, message_to_proto

    return message_from_proto(message_to_proto(msg))


def _through_wire_context(ctx: Context) -> Context:
    """``ctx`` encoded as Flower stores a node's Context (protobuf) and decoded again."""
    from flwr.common.serde import context_from_proto, context_to_proto

    return context_from_proto(context_to_proto(ctx))
