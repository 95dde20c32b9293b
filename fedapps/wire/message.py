"""A message before it is built (:class:`Draft`: its node, its settings, and what it carries besides them: model
arrays, the :class:`Targets` record, a model for evaluation only), the Flower messages built from a batch of drafts,
each once (:func:`build_messages`), the settings of a received message (:func:`request_of`) and the byte counts of
messages and replies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedapps.wire.arrays import arrays_record, npy_values
from fedapps.wire.keys import (
    ARRAYS,
    CONFIG,
    DISTILL_INDICES,
    EVAL_ARRAYS,
    MESSAGE_TYPE,
    PREDICT_INDICES,
    PROFILE,
    TARGET_ARRAY,
    TARGETS,
    MessageError,
    short,
)
from fedapps.wire.request import BOOKKEEPING_KEYS, Request


@dataclass(frozen=True)
class Targets:
    """The ``targets`` record: the server's encoded targets on U for ``distill`` (:mod:`fedapps.wire.pseudolabels`),
    the rows of U they are for (sent only with targets; None: all of U), and the rows of U to ``predict`` on (None:
    all of U)."""

    values: np.ndarray | None = None
    distill_rows: np.ndarray | None = None
    predict_rows: np.ndarray | None = None

    def encode(self) -> ArrayRecord | None:
        """The record (None when there is nothing to send)."""
        arrays: dict[str, np.ndarray] = {}
        if self.values is not None:
            arrays[TARGET_ARRAY] = self.values
            if self.distill_rows is not None:
                arrays[DISTILL_INDICES] = self.distill_rows
        if self.predict_rows is not None:
            arrays[PREDICT_INDICES] = self.predict_rows
        return arrays_record(arrays) if arrays else None

    @classmethod
    def decode(cls, record: Any) -> Targets:
        """The targets a record holds; MessageError for another record type, an unknown array, row indices that are
        not integers, or rows for distillation without targets."""
        if not isinstance(record, ArrayRecord):
            raise MessageError(f"the '{TARGETS}' record must be an ArrayRecord, got {type(record).__name__}")
        unknown = [k for k in record.keys() if k not in (TARGET_ARRAY, DISTILL_INDICES, PREDICT_INDICES)]
        if unknown:
            raise MessageError(f"the '{TARGETS}' record holds unknown array(s) {[short(k, 40) for k in unknown[:3]]}")
        if DISTILL_INDICES in record and TARGET_ARRAY not in record:
            raise MessageError(f"the '{TARGETS}' record has '{DISTILL_INDICES}' but no '{TARGET_ARRAY}'")
        out = {k: npy_values(record[k]) for k in (TARGET_ARRAY, DISTILL_INDICES, PREDICT_INDICES) if k in record}
        for k in (DISTILL_INDICES, PREDICT_INDICES):
            rows = out.get(k)
            if rows is not None and (rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer)):
                raise MessageError(f"'{k}' must be a vector of row indices of U, got {rows.dtype} {rows.shape}")
        return cls(out.get(TARGET_ARRAY), out.get(DISTILL_INDICES), out.get(PREDICT_INDICES))


# ====================================================================== drafts, and the messages built from them


@dataclass
class Draft:
    """One message before it is built: its node, its settings, and what it carries — model ``arrays`` (named numpy
    arrays, encoded as ``request.transport`` says when the message is built), the ``targets`` record
    (:meth:`Targets.encode`) and a model for evaluation only (``eval_arrays``). The strategy makes it
    (``round_messages``), the evaluation protocol and the transport edit it, the reply validator reads what the reply
    must carry off it; :func:`build_messages` makes the Flower message, once, right before it is sent. Drafts of a
    batch may share a request or arrays (the same objects): each is encoded once."""

    node: int
    request: Request
    arrays: Mapping[str, np.ndarray] | None = None
    targets: ArrayRecord | None = None
    eval_arrays: Mapping[str, np.ndarray] | None = None
    message_type: str = MESSAGE_TYPE

    def message(self) -> Message:
        """This draft as a Flower message (:func:`build_messages` of one)."""
        return build_messages([self])[0]


def build_messages(drafts: Iterable[Draft]) -> list[Message]:
    """One Flower message per draft, in order: the request's config record (:meth:`Request.encode`), the arrays
    encoded for the request's transport (:func:`fedapps.wire.arrays.arrays_record`), the targets and the model sent
    for evaluation only. A request or an arrays mapping shared by several drafts (the same object) is encoded once
    and its record shared (Flower checks each entry of a new record, docs/performance.md); nothing modifies a built
    message's records."""
    configs: dict[int, tuple[Request, ConfigRecord]] = {}
    records: dict[tuple[int, str], tuple[Mapping[str, np.ndarray], ArrayRecord]] = {}

    def config(request: Request) -> ConfigRecord:
        found = configs.get(id(request))
        if found is None or found[0] is not request:
            found = configs[id(request)] = (request, request.encode())
        return found[1]

    def record(arrays: Mapping[str, np.ndarray], transport: str) -> ArrayRecord:
        found = records.get((id(arrays), transport))
        if found is None or found[0] is not arrays:
            found = records[(id(arrays), transport)] = (arrays, arrays_record(arrays, transport))
        return found[1]

    out = []
    for d in drafts:
        content = RecordDict({CONFIG: config(d.request)})
        transport = d.request.array_transport
        if d.arrays is not None:
            content[ARRAYS] = record(d.arrays, transport)
        if d.targets is not None:
            content[TARGETS] = d.targets
        if d.eval_arrays is not None:
            content[EVAL_ARRAYS] = record(d.eval_arrays, transport)
        out.append(
            Message(content=content, dst_node_id=d.node, message_type=d.message_type, group_id=str(d.request.round))
        )
    return out


def request_of(msg: Message) -> Request:
    """The request a received message carries (:meth:`Request.decode`; MessageError when it has no config record)."""
    if CONFIG not in msg.content:
        raise MessageError(f"the message has no '{CONFIG}' record")
    return Request.decode(msg.content[CONFIG])


def eval_nbytes(content: RecordDict) -> int:
    """Bytes of the model a message carries for evaluation only (its ``eval-arrays`` record; 0 without)."""
    if EVAL_ARRAYS not in content:
        return 0
    return sum(len(a.data) for a in content.array_records[EVAL_ARRAYS].values())


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict (a message's or a reply's): array buffers plus an estimate for metrics/configs
    (bookkeeping keys, which depend on the run folder's path, are left out so that byte counts compare across
    folders; so is a reply's ``profile``, a measurement of the client's machine, not algorithm traffic)."""
    total = 0
    for name, rec in content.items():
        if name == PROFILE:
            continue
        if isinstance(rec, ArrayRecord):
            total += sum(len(a.data) for a in rec.values())
        else:
            for k, v in rec.items():
                if k in BOOKKEEPING_KEYS:
                    continue
                if isinstance(v, (bytes, str)):
                    total += len(v)
                elif isinstance(v, list):
                    total += 8 * len(v)
                else:
                    total += 8
    return total
