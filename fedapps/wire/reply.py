"""A client's reply: what the worker fills and encodes (:class:`Reply`), and what the server makes of an accepted
one (:class:`ClientReply`; the one parser is :func:`fedapps.wire.validation.parse_reply`).

A reply carries ``metrics`` (MetricRecord: ``client-id``, ``num-examples``, evaluation results, timings ``t-<tag>``
and ``t-total``, and while privacy is on the client's ε so far, ``privacy-epsilon``), and optionally ``arrays`` (the
client's model) and ``predictions`` (encoded predictions on U), with ``info`` (:class:`ReplyInfo`: the client's
architecture and U's fingerprint) and ``profile`` (:class:`MessageProfile`: where the client's time on the message
went, left out of the byte counts). The entries of ``info`` and ``profile`` are declared on the fields
(:func:`fedapps.wire.keys.wire`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedapps.wire.arrays import arrays_record, metrics_record
from fedapps.wire.keys import (
    ARRAYS,
    CLIENT_ID,
    INFO,
    METRICS,
    NUM_EXAMPLES,
    NUMBER,
    PREDICTION_ARRAY,
    PREDICTIONS,
    PROFILE,
    STR,
    MessageError,
    key_of,
    short,
    wire,
)


@dataclass(frozen=True)
class ReplyInfo:
    """The reply's ``info`` record: the architecture of the client's model and the fingerprint of its U."""

    arch: str | None = wire("arch", STR)
    fingerprint: str | None = wire("fingerprint", STR)

    def encode(self) -> ConfigRecord:
        return ConfigRecord(
            {f.metadata["key"]: getattr(self, f.name) for f in _INFO if getattr(self, f.name) is not None}
        )

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> ReplyInfo:
        """The info a record holds (entries it does not know are ignored: the reply validator bounds them)."""
        values = {f.name: record.get(f.metadata["key"]) for f in _INFO}
        for f in _INFO:
            if values[f.name] is not None and not f.metadata["kind"].accepts(values[f.name]):
                raise MessageError(
                    f"'{INFO}' entry '{f.metadata['key']}' must be {f.metadata['kind'].name}, got "
                    f"{short(values[f.name])}"
                )
        return cls(**values)


_INFO = dataclasses.fields(ReplyInfo)
INFO_ARCH = key_of(ReplyInfo, "arch")  # the architecture of the client's model
INFO_FINGERPRINT = key_of(ReplyInfo, "fingerprint")  # the fingerprint of the client's U
# in the reason of a client's refusal when its saved private model would not load: the server's delivery check reads it
# (fedapps.reporting.results.DeliveryCheck) and the run exits 1 saying so
PRIVATE_STATE_UNREADABLE = "saved private model unreadable"


def _seconds(name: str) -> Any:
    return wire(name, NUMBER, 0.0, always=True)


@dataclass(frozen=True)
class MessageProfile:
    """The reply's ``profile`` record: seconds of the client's time on one message, per phase (each phase measured
    exclusively: a model built inside an evaluation counts as ``model``, not ``evaluate``), and ``wall``, from the
    message's arrival at the worker to its reply encoded. The phases sum to at most ``wall``; what is left of it is
    the worker's own glue. What the framework spends beyond ``wall`` (transport, queues, the ClientApp's start) is
    not the client's to measure (bench/message_profile.py)."""

    decoding: float = _seconds("decoding-seconds")  # the message's settings, arrays and targets decoded
    data: float = _seconds("data-seconds")  # the client's data looked up (once per process: loaded, partitioned)
    model: float = _seconds("model-seconds")  # the private model restored (built or reused), received arrays loaded
    train: float = _seconds("train-seconds")  # the training loops (train, distill)
    evaluate: float = _seconds("evaluate-seconds")  # the evaluations
    predict: float = _seconds("predict-seconds")  # predictions on U
    other: float = _seconds("other-seconds")  # the rest of the operations' time (an algorithm's own steps)
    keep: float = _seconds("keep-seconds")  # the private model kept for the next round (Context.state, the disk)
    encoding: float = _seconds("encoding-seconds")  # the reply's arrays and records encoded
    wall: float = _seconds("wall-seconds")  # from the message's arrival to its reply encoded (>= the phases' sum)

    def phases(self) -> dict[str, float]:
        """Seconds per phase (every field but ``wall``), in the order of the fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "wall"}

    def encode(self) -> MetricRecord:
        return MetricRecord({k: float(getattr(self, name)) for name, k in PROFILE_FIELDS.items()})

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> MessageProfile:
        """The profile a record holds; MessageError on an entry it does not know or a value that is not a finite,
        non-negative number."""
        fields = {k: name for name, k in PROFILE_FIELDS.items()}
        values: dict[str, float] = {}
        for k, value in record.items():
            if k not in fields:
                raise MessageError(f"'{PROFILE}' has an unknown entry '{short(k)}'")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < math.inf:
                raise MessageError(
                    f"'{PROFILE}' entry '{k}' must be a finite number of seconds >= 0, got {short(value)}"
                )
            values[fields[k]] = float(value)
        return cls(**values)


# MessageProfile's fields -> their entries in the profile record
PROFILE_FIELDS = {f.name: f.metadata["key"] for f in dataclasses.fields(MessageProfile)}


def profile_of(content: RecordDict) -> MessageProfile | None:
    """A reply's profile (None without one); ReplyError when its ``profile`` record is malformed."""
    if PROFILE not in content:
        return None
    record = content[PROFILE]
    if not isinstance(record, MetricRecord):
        raise ReplyError(f"'{PROFILE}' must be a MetricRecord")
    try:
        return MessageProfile.decode(record)
    except MessageError as exc:
        raise ReplyError(str(exc)) from exc


@dataclass
class Reply:
    """What a client sends back. The worker fills it while it serves a message (the operations add ``metrics``, and
    ``predictions`` or ``arrays`` of their own), then encodes it (:meth:`encode`); the server parses it into a
    :class:`ClientReply`."""

    client_id: int
    num_examples: int
    metrics: dict[str, Any] = field(default_factory=dict)  # what the operations measured, timings
    arrays: ArrayRecord | None = None  # the model asked back (Return), or an operation's own arrays
    predictions: np.ndarray | None = None  # encoded predictions on U (``predict``)
    info: ReplyInfo | None = None
    profile: MessageProfile | None = None  # where the client's time went (the worker fills it in last)

    def encode(self) -> RecordDict:
        """The reply's records: ``predictions``, ``arrays``, ``metrics`` (``client-id`` and ``num-examples`` first),
        ``info``, ``profile``; absent parts are left out."""
        content = RecordDict()
        if self.predictions is not None:
            content[PREDICTIONS] = arrays_record({PREDICTION_ARRAY: self.predictions})
        if self.arrays is not None:
            content[ARRAYS] = self.arrays
        content[METRICS] = metrics_record({CLIENT_ID: self.client_id, NUM_EXAMPLES: self.num_examples, **self.metrics})
        if self.info is not None:
            content[INFO] = self.info.encode()
        if self.profile is not None:
            content[PROFILE] = self.profile.encode()
        return content


@dataclass
class ClientReply:
    """A validated reply: who sent it, how much data it has, what it measured and returned."""

    node_id: int
    client_id: int
    num_examples: int
    metrics: dict[str, Any]
    arrays: dict[str, np.ndarray] | None = None
    predictions: dict[str, np.ndarray] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    profile: MessageProfile | None = None  # where the client's time went (None: the reply carried no profile)

    @property
    def required_arrays(self) -> dict[str, np.ndarray]:
        """The model arrays of a reply that was asked for them (the validator drops one that lacks them)."""
        if self.arrays is None:
            raise ReplyError(f"client {self.client_id}'s reply carries no model arrays")
        return self.arrays

    @property
    def required_predictions(self) -> dict[str, np.ndarray]:
        """The predictions of a reply that was asked for them (the validator drops one that lacks them)."""
        if self.predictions is None:
            raise ReplyError(f"client {self.client_id}'s reply carries no predictions")
        return self.predictions


class ReplyError(ValueError):
    """A reply that must not be used; the message says why."""
