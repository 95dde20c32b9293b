"""What a round of the server's loop produced (:class:`RoundLog`, the deployed-model :class:`Measurement` s it took),
what the rounds so far leave for the summaries (:class:`RoundHistory`), and a round as Flower's metrics (what
:meth:`fedapps.server.driver.RoundDriver.start` files in Flower's ``Result``). The result sinks turn a
:class:`RoundLog` into a row of rounds.csv."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from flwr.app import MetricRecord

from fedapps.reporting.results import accuracy_stats, after_training_stats
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import Rejection


def measured_round(server_round: int, every: int, last_round: int) -> bool:
    """Whether round ``server_round``'s models are measured under ``evaluate_every`` = ``every``: rounds every,
    2·every, ... and always ``last_round``."""
    return server_round % every == 0 or server_round == last_round


@dataclass
class Measurement:
    """The deployed-model evaluation of round ``round``: the replies carrying ``deployed-*`` metrics, taken on
    round ``round`` + 1's messages, or (``final``) by the evaluation-only message after the last round."""

    round: int
    replies: list[ClientReply]
    final: bool = False


@dataclass
class RoundLog:
    """What one round produced (the results writer turns it into a row of rounds.csv)."""

    round: int
    replies: list[ClientReply]
    bytes_down: int
    bytes_up: int
    eval_bytes_down: int = 0
    eval_bytes_up: int = 0
    # bytes of the replies the validator rejected (both phases): counted apart, never in bytes_up / eval_bytes_up
    bytes_up_rejected: int = 0
    wall_seconds: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # reply validation (both phases of the round together): accepted, rejected, asked for but never answered
    replies_ok: int = 0
    replies_rejected: int = 0
    replies_missing: int = 0
    # the same counts per phase (protocol.MESSAGE_TYPE: the training messages; EVAL_MESSAGE_TYPE: the evaluation-only
    # messages after the last round): phase -> [accepted, rejected]; the exit status judges each phase on its own
    replies_by_phase: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    rejections: list[Rejection] = dataclasses.field(default_factory=list)  # the sinks append them to rejections.csv
    # what the algorithm left out of a validated round (a reply it could not use, or the whole round's step),
    # phase "aggregate"; also written to rejections.csv, not counted in replies_rejected
    skips: list[Rejection] = dataclasses.field(default_factory=list)
    sent: int = 0  # training messages sent this round (one per sampled node)
    received: int = 0  # replies that came back (error replies included: the message reached a client)
    skipped: bool = False  # fewer usable replies than strategy.min_clients: nothing was aggregated
    errors: list[str] = dataclasses.field(default_factory=list)  # reasons of the error replies
    # deployed-model measurements taken during this round: of the previous round (on this round's messages) and,
    # in the last round, of this round itself (the evaluation-only message); the sinks file each under its round
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    # seconds of the round's steps on the server (StepClock): its messages built, the exchange with the clients
    # (Flower's and Ray's delivery, the clients' work, the replies' return), the replies checked, the aggregation
    steps: dict[str, float] = dataclasses.field(default_factory=dict)


class StepClock:
    """Seconds of the consecutive steps of a round on the server, each from the end of the step before."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def done(self, step: str) -> None:
        """The step ``step`` ends now (it began when the previous one ended)."""
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self._mark
        self._mark = now


@dataclass
class RoundHistory:
    """What the rounds so far leave for a strategy's summary (kept by the round loop, saved in its checkpoint)."""

    # the extras of the last round that had usable replies
    last_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # round, clients and accuracy of the latest deployed-model measurement
    last_measured: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the run ended early: after which round (of how many), and why (the strategy's stop_reason); empty otherwise
    stopped: dict[str, Any] = dataclasses.field(default_factory=dict)


def round_metrics(entry: RoundLog) -> MetricRecord:
    """A round's training phase as Flower metrics: replies, the accuracy after local training and the numeric
    strategy extras (the deployed models' accuracy is :func:`measurement_metrics`, filed under its round)."""
    out: dict[str, Any] = {"clients": len(entry.replies)}
    out.update(after_training_stats([r.metrics for r in entry.replies]))
    out.update(
        {
            k: float(v)
            for k, v in entry.extra.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        }
    )
    return MetricRecord(out)


def measurement_metrics(m: Measurement) -> MetricRecord:
    """A deployed-model measurement as Flower metrics: clients measured, accuracy (mean over clients and
    sample-weighted) and weighted loss."""
    return MetricRecord(
        {"clients": len(m.replies), **accuracy_stats([r.metrics for r in m.replies], protocol.DEPLOYED_TAG)}
    )
