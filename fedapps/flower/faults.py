"""Fault injection for tests: a Flower client mod that makes chosen clients misbehave in chosen rounds.

Off unless asked for explicitly, by the node config key ``faults`` (``--node-config "faults='...'"``) or the
environment variable ``FEDAPPS_FAULTS`` (the node config wins). A spec is ``;``-separated entries

    KIND[=ARG]@CLIENTS[/ROUNDS[/PHASE]]

CLIENTS and ROUNDS are ``*`` or comma-separated integers (client ids; rounds from 1; default ``*``), PHASE is
``train`` (default), ``evaluate`` or ``*``. E.g. ``shape@1/1`` (client 1 sends a wrongly shaped array in round 1),
``raise@0,3/*`` (clients 0 and 3 fail every round), ``late=3@2/1``. Kinds:

- ``drop``: the client computes (its state moves on) but its reply is lost: :class:`ReplyDropped` is raised,
  which :class:`fedapps.flower.inprocess.InProcessGrid` treats as no reply (under Flower it becomes an error reply);
- ``raise``: the client fails before doing anything (an error reply); ``late=S``: it answers after S seconds;
- ``duplicate``: the reply is delivered twice (InProcessGrid asks :func:`take_duplicate`);
- identity: ``spoof[=ID]`` claims another client's id (default: the next one), ``bad-id`` an id outside the
  federation, ``list-id`` a list-valued id;
- metrics: ``huge-n`` (num-examples 10**12), ``zero-n``, ``list-n``, ``no-eval-n`` (drops ``<tag>-n``),
  ``acc-50`` (every ``<tag>-acc`` = 50), ``n-1e9`` (every ``<tag>-n`` = 10**9), ``loss-huge`` (every loss other
  than an evaluation's = −2e299), ``time-huge`` (every ``t-*`` timing = 10**12 s), ``list-huge`` (an extra metric
  holding a list of ARG floats, default 10**5), ``eval-claim[=N]`` (every evaluation claims N samples, default its
  own n, all of them correct: acc 1, correct = n = N, counts that agree with each other), ``metric-flood[=L]`` (up
  to 1,020 extra metrics, as many as keep the reply within the validator's 1,024, each a list of L floats, default
  4,096: every count and length limit met, the total not);
- arrays: ``shape`` (one array gets an extra row), ``transpose`` (a non-square matrix transposed),
  ``undecodable`` (garbage bytes), ``int-arrays`` (every array cast to int64), ``nan-arrays``; wire types:
  ``f64-huge`` (every floating array as float64, one value 1e300: finite in float64, inf in float32),
  ``longdouble`` (every floating array as numpy's longdouble), ``big-endian`` (float32 in big-endian byte order),
  ``dtype-lie`` (float64 bytes under a float32 label), ``trailing-bytes`` (1 MB of junk after a valid array);
- predictions: ``pred-shape`` (a row short), ``pred-huge`` (float scores 1e30; hard labels the dtype's
  maximum), ``pred-undecodable``, ``pred-dtype`` (float scores as float64, hard labels as uint64),
  ``fingerprint`` (another public-set fingerprint).

Capture attacks (:data:`CAPTURE_FAULTS`): replies the validator accepts — right names, shapes, wire types, finite
values within every bound — crafted to take over OTHER clients' models (tests/test_hostile_clients.py, the capture
table scripts/capture_table.py, docs/reliability.md's threat model):

- ``scale=S``: every floating array of the reply multiplied by S (default 100): one scaled model;
- ``one-hot-rows=C``: the classifier (the last 2-D floating array, as this project's models order their state) keeps
  only row C, scaled by 100: its row norms, cwFedAvg's class-distribution estimate, say "class C only";
- ``pred-const=C``: every row of the predictions votes for class C (default 0) as confidently as the reply's kind
  allows: a one-hot probability row, logits of +1e4 on C and -1e4 elsewhere (inside the validator's bound), the hard
  label C;
- ``pred-flip``: every row votes (one-hot, as ``pred-const``) for the class after the argmax of the targets the message
  brought (the cluster's or the consensus' labels), or after its own argmax where the message brought none;
- ``pred-copy=V``: the predictions are replaced by client V's predictions of the same round, which V's ``leak`` entry
  published (``leak@V/R;pred-copy=V@A/R``: the attacker is assumed to know the victim's outputs). Both clients must
  run in one process (the in-process engine); the copy waits up to :data:`COPY_WAIT` s for V's reply and otherwise
  leaves the reply as it is, with a warning;
- ``leak``: not an attack: the client's reply is unchanged, its predictions are published for ``pred-copy``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from fedapps.client.worker import client_id_of
from fedapps.wire import protocol
from fedapps.wire.validation import MAX_METRICS

log = logging.getLogger("fedapps")

ENV = "FEDAPPS_FAULTS"
NODE_KEY = "faults"
CONTROL = ("drop", "raise", "late", "duplicate")
IDENTITY = ("spoof", "bad-id", "list-id")
METRIC_FAULTS = (
    "huge-n",
    "zero-n",
    "list-n",
    "no-eval-n",
    "acc-50",
    "n-1e9",
    "loss-huge",
    "time-huge",
    "list-huge",
    "eval-claim",
    "metric-flood",
)
FLOOD_METRICS = 1020  # metric-flood: extra list metrics (fewer where the reply's own would pass MAX_METRICS)
WIRE_FAULTS = ("f64-huge", "longdouble", "big-endian", "dtype-lie", "trailing-bytes")  # arrays of the wrong wire type
ARRAY_FAULTS = ("shape", "transpose", "undecodable", "int-arrays", "nan-arrays")
PREDICTION_FAULTS = ("pred-shape", "pred-huge", "pred-undecodable", "pred-dtype", "fingerprint")
# valid-looking replies that take over other clients' models (see the module docstring)
CAPTURE_ARRAY_FAULTS = ("scale", "one-hot-rows")
CAPTURE_PREDICTION_FAULTS = ("pred-const", "pred-flip", "pred-copy", "leak")
CAPTURE_FAULTS = CAPTURE_ARRAY_FAULTS + CAPTURE_PREDICTION_FAULTS
KINDS = CONTROL + IDENTITY + METRIC_FAULTS + ARRAY_FAULTS + WIRE_FAULTS + PREDICTION_FAULTS + CAPTURE_FAULTS
CONFIDENT_LOGIT = (
    1e4  # pred-const / pred-flip logits: +this on the chosen class, -this elsewhere (the validator's bound)
)
ROW_SCALE = 100.0  # one-hot-rows: the kept classifier row is multiplied by this
COPY_WAIT = 60.0  # seconds pred-copy waits for the victim's leaked predictions


class ReplyDropped(Exception):
    """Raised by the ``drop`` fault: the reply never reaches the server."""


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    arg: str | None
    clients: frozenset[int] | None  # None = every client
    rounds: frozenset[int] | None  # None = every round
    phase: str = protocol.MESSAGE_TYPE  # or "evaluate", or "*"

    def applies(self, client_id: int, server_round: int, phase: str) -> bool:
        return (
            (self.clients is None or client_id in self.clients)
            and (self.rounds is None or server_round in self.rounds)
            and self.phase in ("*", phase)
        )


def _ints(text: str, what: str, spec: str) -> frozenset[int] | None:
    if text.strip() in ("", "*"):
        return None
    try:
        return frozenset(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"fault spec '{spec}': {what} must be '*' or comma-separated integers, got '{text}'") from None


def parse_faults(spec: str) -> list[Fault]:
    """``KIND[=ARG]@CLIENTS[/ROUNDS[/PHASE]]`` entries separated by ';' (see the module docstring)."""
    out: list[Fault] = []
    for entry in (e.strip() for e in str(spec).split(";")):
        if not entry:
            continue
        head, _, where = entry.partition("@")
        kind, _, arg = head.strip().partition("=")
        if kind not in KINDS:
            raise ValueError(f"fault spec '{entry}': unknown kind '{kind}'; allowed: {', '.join(KINDS)}")
        parts = where.split("/") if where else ["*"]
        if len(parts) > 3:
            raise ValueError(f"fault spec '{entry}': expected KIND[=ARG]@CLIENTS[/ROUNDS[/PHASE]]")
        phase = parts[2].strip() if len(parts) > 2 else protocol.MESSAGE_TYPE
        if phase not in ("*", protocol.MESSAGE_TYPE, protocol.EVAL_MESSAGE_TYPE):
            raise ValueError(f"fault spec '{entry}': phase must be train, evaluate or *, got '{phase}'")
        out.append(
            Fault(
                kind,
                arg or None,
                _ints(parts[0], "CLIENTS", entry),
                _ints(parts[1], "ROUNDS", entry) if len(parts) > 1 else None,
                phase,
            )
        )
    return out


def faults_of(context: Context) -> list[Fault]:
    """The faults this node is asked to inject (node config ``faults``, else env ``FEDAPPS_FAULTS``; none)."""
    spec = context.node_config.get(NODE_KEY) if NODE_KEY in context.node_config else os.environ.get(ENV, "")
    return parse_faults(str(spec)) if spec else []


_DUPLICATES: set[int] = set()


def take_duplicate(reply: Message) -> bool:
    """Whether ``reply`` is to be delivered twice (asked once per reply, by the grid that delivers it)."""
    if id(reply) in _DUPLICATES:
        _DUPLICATES.discard(id(reply))
        return True
    return False


def faults_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The Flower client mod: a no-op unless this node is asked to inject faults."""
    faults = faults_of(context)
    if not faults:
        return call_next(msg, context)
    cid = client_id_of(context)
    rnd = _round_of(msg)
    active = [f for f in faults if f.applies(cid, rnd, str(msg.metadata.message_type))]
    if not active:
        return call_next(msg, context)
    kinds = {f.kind for f in active}
    log.warning("client %d, round %d: injecting faults %s", cid, rnd, sorted(kinds))
    if "raise" in kinds:
        raise InjectedFault(f"injected failure of client {cid} in round {rnd}")
    for f in active:
        if f.kind == "late":
            time.sleep(float(f.arg or 1.0))
    reply = call_next(msg, context)
    if "drop" in kinds:
        raise ReplyDropped(f"reply of client {cid} in round {rnd} dropped")
    for f in active:
        if f.kind not in CONTROL:
            corrupt(reply, f, cid, context, msg)
    if "duplicate" in kinds:
        _DUPLICATES.add(id(reply))
    return reply


# --------------------------------------------------------------------------- corruptions


def _arrays(reply: Message, record: str) -> dict[str, np.ndarray] | None:
    if record not in reply.content:
        return None
    return {k: v.numpy() for k, v in reply.content.array_records[record].items()}


def _part(reply: Message, kind: str, record: str) -> dict[str, np.ndarray] | None:
    """The reply's arrays (``protocol.ARRAYS``) or predictions (``protocol.PREDICTIONS``) that fault ``kind``
    corrupts; None, with a warning, when the reply does not carry them (it is then left as it is)."""
    part = _arrays(reply, record)
    if record == protocol.PREDICTIONS and part is not None and protocol.PREDICTION_ARRAY not in part:
        part = None
    if not part:
        log.warning("fault '%s': the reply carries no '%s' record; left as it is", kind, record)
        return None
    return part


def _put(reply: Message, record: str, arrays: dict) -> None:
    reply.content[record] = ArrayRecord(
        {k: v if isinstance(v, Array) else Array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    )


def _garbage(like: np.ndarray) -> Array:
    """Bytes that are no .npy file under the label (dtype, shape) of the array they replace."""
    return Array(
        dtype=str(like.dtype),
        shape=tuple(int(d) for d in like.shape),
        stype="numpy.ndarray",
        data=b"\x00garbage, not an .npy file",
    )


def corrupt(reply: Message, fault: Fault, cid: int, context: Context, msg: Message | None = None) -> None:
    """Apply one corruption to the reply in place (a reply without the part it corrupts is left as it is);
    ``msg``: the message the reply answers (what ``pred-flip`` reads its targets from)."""
    if reply.has_error():
        return
    kind = fault.kind
    if kind in CAPTURE_FAULTS:
        capture(reply, fault, cid, msg)
        return
    # Any: the faults below write values of the wrong type on purpose
    metrics: dict[str, Any] = dict(reply.content[protocol.METRICS]) if protocol.METRICS in reply.content else {}
    if kind in IDENTITY or kind in METRIC_FAULTS:
        if kind == "spoof":
            n = int(context.node_config.get("num-partitions", cid + 2))
            metrics[protocol.CLIENT_ID] = int(fault.arg) if fault.arg is not None else (cid + 1) % max(n, 2)
        elif kind == "bad-id":
            metrics[protocol.CLIENT_ID] = 10**6
        elif kind == "list-id":
            metrics[protocol.CLIENT_ID] = [cid]
        elif kind == "huge-n":
            metrics[protocol.NUM_EXAMPLES] = 10**12
        elif kind == "zero-n":
            metrics[protocol.NUM_EXAMPLES] = 0
        elif kind == "list-n":
            metrics[protocol.NUM_EXAMPLES] = [int(metrics.get(protocol.NUM_EXAMPLES, 1)), 1]
        elif kind == "no-eval-n":
            metrics = {k: v for k, v in metrics.items() if not k.endswith("-n")}
        elif kind == "acc-50":
            metrics.update({k: 50.0 for k in metrics if k.endswith("-acc")})
        elif kind == "n-1e9":
            metrics.update({k: 1e9 for k in metrics if k.endswith("-n")})
        elif kind == "loss-huge":
            evaluations = {k.rsplit("-", 1)[0] for k in metrics if k.endswith("-acc")}
            metrics.update(
                {k: -2e299 for k in metrics if k.endswith("-loss") and k.rsplit("-", 1)[0] not in evaluations}
            )
        elif kind == "time-huge":
            metrics.update({k: 1e12 for k in metrics if k.startswith("t-")})
        elif kind == "list-huge":
            metrics["junk-list"] = [0.5] * int(fault.arg or 10**5)
        elif kind == "eval-claim":
            for key in [k for k in metrics if k.endswith("-acc")]:
                tag = key[: -len("-acc")]
                claimed = float(fault.arg) if fault.arg is not None else float(metrics.get(f"{tag}-n", 0.0))
                metrics.update({key: 1.0, f"{tag}-n": claimed, f"{tag}-correct": claimed})
        elif kind == "metric-flood":
            values = [0.5] * int(fault.arg or 4096)
            count = min(FLOOD_METRICS, MAX_METRICS - len(metrics))  # within the validator's count of metrics
            metrics.update({f"flood-{i}": list(values) for i in range(count)})
        reply.content[protocol.METRICS] = MetricRecord(metrics)
        return
    if kind in ARRAY_FAULTS or kind in WIRE_FAULTS:
        arrays = _part(reply, kind, protocol.ARRAYS)
        if arrays is None:
            return
        first = next(iter(arrays))
        sent: dict[str, np.ndarray | Array] = dict(arrays)  # the arrays sent back, or wire Arrays a fault forged
        if kind == "shape":
            a = np.atleast_1d(arrays[first])
            sent[first] = np.concatenate([a, np.zeros((1, *a.shape[1:]), a.dtype)])
        elif kind == "transpose":
            two_d = [k for k, v in arrays.items() if v.ndim == 2 and v.shape[0] != v.shape[1]]
            key = two_d[0] if two_d else first
            sent[key] = np.ascontiguousarray(arrays[key].T if two_d else arrays[key][None])
        elif kind == "undecodable":
            sent[first] = _garbage(arrays[first])
        elif kind == "int-arrays":
            sent = {k: v.astype(np.int64) for k, v in arrays.items()}
        elif kind == "nan-arrays":
            sent[first] = np.full_like(arrays[first], np.nan, dtype=np.float32)
        elif kind in WIRE_FAULTS:
            sent = wire_fault(kind, arrays)
        _put(reply, protocol.ARRAYS, sent)
        return
    if kind == "fingerprint":
        info = dict(reply.content.config_records[protocol.INFO]) if protocol.INFO in reply.content else {}
        info[protocol.INFO_FINGERPRINT] = "0000000000000000"
        reply.content[protocol.INFO] = ConfigRecord(info)
        return
    preds = _part(reply, kind, protocol.PREDICTIONS)
    if preds is None:
        return
    p = preds[protocol.PREDICTION_ARRAY]
    sent_preds: dict[str, np.ndarray | Array] = dict(preds)  # the predictions sent back, or a forged wire Array
    if kind == "pred-shape":
        sent_preds[protocol.PREDICTION_ARRAY] = np.ascontiguousarray(p[:-1])
    elif kind == "pred-huge":
        if np.issubdtype(p.dtype, np.floating):
            sent_preds[protocol.PREDICTION_ARRAY] = np.full_like(p, 1e30, dtype=np.float32)
        else:
            sent_preds[protocol.PREDICTION_ARRAY] = np.full_like(p, np.iinfo(p.dtype).max)
    elif kind == "pred-undecodable":
        sent_preds[protocol.PREDICTION_ARRAY] = _garbage(p)
    elif kind == "pred-dtype":
        sent_preds[protocol.PREDICTION_ARRAY] = p.astype(
            np.float64 if np.issubdtype(p.dtype, np.floating) else np.uint64
        )
    _put(reply, protocol.PREDICTIONS, sent_preds)


def wire_fault(kind: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray | Array]:
    """The floating arrays of a reply re-sent in a wire type the message did not ask for (see the module
    docstring); integer arrays are left as they are."""
    floating = [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating)]
    out: dict[str, np.ndarray | Array] = dict(arrays)
    if not floating:
        return out
    if kind == "f64-huge":
        out.update({k: arrays[k].astype(np.float64) for k in floating})
        huge = np.array(out[floating[0]], copy=True)
        huge.reshape(-1)[:1] = 1e300
        out[floating[0]] = huge
    elif kind == "longdouble":
        out.update({k: arrays[k].astype(np.longdouble) for k in floating})
    elif kind == "big-endian":
        out.update({k: arrays[k].astype(np.dtype(np.float32).newbyteorder(">")) for k in floating})
    elif kind == "dtype-lie":
        a = np.ascontiguousarray(arrays[floating[0]], dtype=np.float64)
        out[floating[0]] = Array(dtype="float32", shape=tuple(a.shape), stype="numpy.ndarray", data=Array(a).data)
    elif kind == "trailing-bytes":
        wire = Array(np.ascontiguousarray(arrays[floating[0]]))
        out[floating[0]] = Array(
            dtype=wire.dtype, shape=tuple(wire.shape), stype=wire.stype, data=wire.data + b"\0" * 2**20
        )
    return out


# --------------------------------------------------------------------------- capture attacks

_BOARD: dict[tuple[int, int], np.ndarray] = {}  # (round, client) -> predictions a `leak` client published
_BOARD_LOCK = threading.Condition()


def clear_board() -> None:
    """Forget every leaked prediction (a driver running several federations in one process calls it between)."""
    with _BOARD_LOCK:
        _BOARD.clear()


def _request_of(msg: Message | None) -> protocol.Request | None:
    """The request of the message the reply answers (None without one, or when it is malformed: the worker refuses
    it itself)."""
    if msg is None:
        return None
    try:
        return protocol.request_of(msg)
    except protocol.MessageError:
        return None


def _round_of(msg: Message | None) -> int:
    request = _request_of(msg)
    return 0 if request is None else request.round


def capture(reply: Message, fault: Fault, cid: int, msg: Message | None) -> None:
    """Apply one capture attack (:data:`CAPTURE_FAULTS`) to the reply in place."""
    kind = fault.kind
    if kind in CAPTURE_ARRAY_FAULTS:
        arrays = _part(reply, kind, protocol.ARRAYS)
        if arrays is None:
            return
        if kind == "scale":
            arrays = scaled(arrays, float(fault.arg or 100.0))
        else:
            arrays = one_hot_rows(arrays, int(fault.arg or 0))
        _put(reply, protocol.ARRAYS, arrays)
        return
    preds = _part(reply, kind, protocol.PREDICTIONS)
    if preds is None:
        return
    p = preds[protocol.PREDICTION_ARRAY]
    rnd = _round_of(msg)
    if kind == "leak":
        with _BOARD_LOCK:
            _BOARD[(rnd, cid)] = np.array(p, copy=True)
            _BOARD_LOCK.notify_all()
        return
    if kind == "pred-copy":
        victim = int(fault.arg if fault.arg is not None else 0)
        with _BOARD_LOCK:
            found = _BOARD_LOCK.wait_for(lambda: (rnd, victim) in _BOARD, timeout=COPY_WAIT)
            copied = _BOARD.pop((rnd, victim), None) if found else None
        if copied is None or copied.shape != p.shape or copied.dtype != p.dtype:
            log.warning(
                "fault 'pred-copy': no leaked predictions of client %d in round %d that fit; left as it is", victim, rnd
            )
            return
        preds[protocol.PREDICTION_ARRAY] = copied
    else:
        request = _request_of(msg)
        output = request.public.predict_output if request is not None else "probs"
        if kind == "pred-const":
            labels = np.full(p.shape[0], int(fault.arg or 0), dtype=np.int64)
        else:
            labels = (reference_labels(p, msg) + 1) % num_classes_of(p, msg)
        preds[protocol.PREDICTION_ARRAY] = votes(labels, p, output, num_classes_of(p, msg))
    _put(reply, protocol.PREDICTIONS, preds)


def scaled(arrays: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """Every floating array multiplied by ``factor`` (in its own dtype); integer arrays as they are."""
    return {
        k: (v * v.dtype.type(factor)).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in arrays.items()
    }


def one_hot_rows(arrays: dict[str, np.ndarray], row: int) -> dict[str, np.ndarray]:
    """The last 2-D floating array (the classifier) with every row zero but ``row``, which is scaled by
    :data:`ROW_SCALE`; the other arrays as they are."""
    matrices = [k for k, v in arrays.items() if v.ndim == 2 and np.issubdtype(v.dtype, np.floating)]
    if not matrices:
        log.warning("fault 'one-hot-rows': no 2-D floating array; left as it is")
        return arrays
    key = matrices[-1]
    w = arrays[key]
    out = np.zeros_like(w)
    out[row % w.shape[0]] = w[row % w.shape[0]] * w.dtype.type(ROW_SCALE)
    return {**arrays, key: out}


def num_classes_of(p: np.ndarray, msg: Message | None) -> int:
    """The class count of a prediction array: its columns, or (hard labels) the message's ``data.num_classes``."""
    if p.ndim == 2:
        return int(p.shape[1])
    request = _request_of(msg)
    return int(request.setup.data.get("num_classes", 0) if request is not None else 0) or int(p.max()) + 1


def reference_labels(p: np.ndarray, msg: Message | None) -> np.ndarray:
    """Per row, the label the message's targets give (their argmax, or the hard label), where they cover the same
    rows as the predictions; else the reply's own argmax."""
    if msg is not None and protocol.TARGETS in msg.content and protocol.TARGET_ARRAY in msg.content[protocol.TARGETS]:
        t = msg.content.array_records[protocol.TARGETS][protocol.TARGET_ARRAY].numpy()
        labels = t.argmax(axis=-1) if t.ndim == 2 else t.astype(np.int64)
        if len(labels) == p.shape[0]:
            return labels.astype(np.int64)
    return (p.argmax(axis=-1) if p.ndim == 2 else p).astype(np.int64)


def votes(labels: np.ndarray, like: np.ndarray, output: str, num_classes: int) -> np.ndarray:
    """Predictions voting for ``labels`` (one per row) in the wire type of ``like``: hard labels, logits of
    ±:data:`CONFIDENT_LOGIT` (``output`` logits) or one-hot probabilities."""
    if not np.issubdtype(like.dtype, np.floating):
        return labels.astype(like.dtype)
    hot = np.zeros((len(labels), num_classes), dtype=np.float64)
    hot[np.arange(len(labels)), labels] = 1.0
    if output == "logits":
        hot = (2.0 * hot - 1.0) * CONFIDENT_LOGIT
    return hot.astype(like.dtype)
