"""The round's reply checks: every reply checked against what its message asked (:class:`ReplyValidator`), and what
the algorithm left out of the validated ones (a reply it could not use, a step it did not take), tallied for the
round's record (rounds.csv's reply counts, rejections.csv). The strategy records its own skips here
(:meth:`ReplyChecks.skip_reply`, :meth:`ReplyChecks.skip_round`); the round loop validates and reads the tally."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from flwr.app import Message

from fedapps.server.rounds import RoundLog
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import Rejection, ReplyValidator

log = logging.getLogger("fedapps")

SKIP_PHASE = "aggregate"  # rejections.csv's phase of what a strategy left out (ReplyChecks.skip_reply)


class ReplyChecks:
    """The validator of a strategy's replies and the tally of the round in progress (validation counts, rejections,
    skips; reset by :meth:`begin`, copied into the round's record by :meth:`fill`). ``strategy``: the name the skips
    are recorded under."""

    def __init__(self, validator: ReplyValidator, strategy: str) -> None:
        self.validator = validator
        self.strategy = strategy
        self.tally = RoundLog(0, [], 0, 0)  # validation counts of the phases validated since the last reset

    def begin(self, server_round: int) -> None:
        """A new round: its tally starts empty."""
        self.tally = RoundLog(server_round, [], 0, 0)

    def fill(self, entry: RoundLog) -> None:
        """The tally's counts, rejections and skips into the round's record."""
        t = self.tally
        entry.replies_ok, entry.replies_rejected = t.replies_ok, t.replies_rejected
        entry.replies_missing, entry.rejections = t.replies_missing, list(t.rejections)
        entry.bytes_up_rejected, entry.skips = t.bytes_up_rejected, list(t.skips)
        entry.replies_by_phase = {phase: list(counts) for phase, counts in t.replies_by_phase.items()}

    def validate(
        self, server_round: int, replies: Iterable[Message], phase: str = protocol.MESSAGE_TYPE
    ) -> list[ClientReply]:
        """Check replies against what their messages asked (:mod:`fedapps.wire.validation`; recorded by
        ``validator.expect`` when the messages were built: what each reply must carry is read off its message);
        never raises. The accepted replies are returned; the counts and rejections go into the round's tally."""
        replies = list(replies)
        outcome = self.validator.validate_batch(server_round, replies, phase)
        received = sum(reply_nbytes(m) for m in replies)
        self.tally.bytes_up_rejected += max(0, received - sum(r.nbytes for r in outcome.accepted))
        self.tally.replies_ok += len(outcome.accepted)
        self.tally.replies_rejected += len(outcome.rejections)
        self.tally.replies_missing += outcome.missing
        counts = self.tally.replies_by_phase.setdefault(phase, [0, 0])
        counts[0] += len(outcome.accepted)
        counts[1] += len(outcome.rejections)
        self.tally.rejections.extend(outcome.rejections)
        return outcome.accepted

    def record_rejections(self, rejections: Iterable[Rejection], phase: str) -> None:
        """Rejections of a phase checked outside :meth:`validate` (the identify messages), filed under the round in
        progress: rows of rejections.csv, not counted in the round's replies."""
        self.tally.rejections.extend(dataclasses.replace(r, round=self.tally.round, phase=phase) for r in rejections)

    def skip_reply(self, server_round: int, reply: ClientReply, reason: str) -> None:
        """A validated reply the algorithm cannot use (e.g. arrays that answer no model of this round): logged and
        recorded (rejections.csv, phase ``aggregate``), never silently dropped."""
        log.warning("round %d: %s left out client %d's reply: %s", server_round, self.strategy, reply.client_id, reason)
        self.tally.skips.append(
            Rejection(server_round, SKIP_PHASE, reply.node_id, reply.client_id, f"{self.strategy}: {reason}")
        )

    def skip_round(self, server_round: int, reason: str) -> None:
        """A step of the round the algorithm did not take (no usable reply for it; too few replies): logged and
        recorded like :meth:`skip_reply`, without a node."""
        log.warning("round %d: %s: %s", server_round, self.strategy, reason)
        self.tally.skips.append(Rejection(server_round, SKIP_PHASE, None, None, f"{self.strategy}: {reason}"))


def reply_nbytes(msg: Message) -> int:
    """Payload bytes of a reply (:func:`protocol.record_nbytes`; 0 for an error reply, or one that cannot be
    measured: counting never fails a round)."""
    try:
        return 0 if msg.has_error() else protocol.record_nbytes(msg.content)
    except Exception:  # noqa: BLE001 - a hostile reply of any shape
        return 0
