"""Where a client's time on one message goes: a clock that charges every moment to exactly one phase.

The worker starts a :class:`PhaseClock` when a message arrives and enters a phase around each step (decoding, the data
lookup, the model, keeping the model, encoding the reply); while it serves the message on a thread
(:func:`measuring`), the training loops, evaluations and predictions of :mod:`fedapps.client.ops` enter theirs
(:func:`timed`). Phases nest, and each is timed exclusively: a model built inside an evaluation counts as ``model``
only, the evaluation keeps the rest. The result is the reply's :class:`fedapps.wire.protocol.MessageProfile`. Outside a
measured message (the server's own training, a test) the phases cost nothing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fedapps.wire.protocol import PROFILE_FIELDS, MessageProfile

PHASES = tuple(name for name in PROFILE_FIELDS if name != "wall")  # the phases a clock charges time to

F = TypeVar("F", bound=Callable[..., Any])


class PhaseClock:
    """Seconds per phase of one message since the clock was made; each moment inside a phase is charged to the
    innermost phase entered (:meth:`phase`), a moment in none to no phase."""

    def __init__(self) -> None:
        self.started = self._mark = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._open: list[str] = []

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._mark
        self._mark = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Within the block, time is charged to ``name`` (minus what phases entered inside it take)."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase '{name}'; known: {', '.join(PHASES)}")
        self._charge()
        self._open.append(name)
        try:
            yield
        finally:
            self._charge()
            self._open.pop()

    def profile(self) -> MessageProfile:
        """The phases so far, and the wall time since the clock was made (charged time of open phases included)."""
        self._charge()
        return MessageProfile(**self.seconds, wall=time.perf_counter() - self.started)


_CURRENT = threading.local()  # the clock of the message served on this thread (see measuring)


@contextmanager
def measuring(clock: PhaseClock) -> Iterator[None]:
    """Within the block, on this thread, :func:`phase` and :func:`timed` charge ``clock``."""
    previous = getattr(_CURRENT, "clock", None)
    _CURRENT.clock = clock
    try:
        yield
    finally:
        _CURRENT.clock = previous


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the block to ``name`` on the clock of the message served on this thread (none: a no-op)."""
    clock = getattr(_CURRENT, "clock", None)
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield


def timed(name: str) -> Callable[[F], F]:
    """Decorate a function so that its calls are charged to phase ``name`` (see :func:`phase`)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase '{name}'; known: {', '.join(PHASES)}")

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
