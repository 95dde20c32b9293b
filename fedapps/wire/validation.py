"""Validation of untrusted client replies against what the server asked, in one place, before any strategy
sees them.

Before the server builds a round's messages, :meth:`ReplyValidator.expect` records per node an
:class:`Expectation` read off the draft of each message (:class:`fedapps.wire.protocol.Draft`, its request and
targets): the model arrays asked for (``Request.returns``: ``return-arrays`` with ``arrays.keys`` state |
params | body → names, shapes and dtypes of the server's own model), the predictions on U asked for (a ``predict``
op → rows, classes, ``Request.public``'s ``predict.output`` and ``predict.encoding``), U's fingerprint
(``public.fingerprint``) and the evaluations the ops produce (every ``evaluate*`` op → ``<tag>-acc``,
``-loss``, ``-n``, ``-correct``). :meth:`ReplyValidator.check` then accepts a reply only if

- it is not an error reply, carries a ``metrics`` record and no record but metrics/arrays/predictions/info/profile;
- its cost is within what its message asked for (:func:`reply_budget`), checked FIRST, on counts and lengths alone,
  before any value is read: each record's entries, the metric values (a number counts one, a list its length) at
  most :data:`MAX_METRICS` + :data:`METRIC_LISTS` full-length lists, and the reply's bytes
  (:func:`fedapps.wire.protocol.record_nbytes`) at most those of the arrays and predictions asked for (at their
  widest wire dtype, each with an .npy header) plus the metric and info budgets. So the worst reply that is
  accepted costs a bounded, small validation (bench/reply_cost.py), and a larger one is refused at once;
- every metric is a finite number or a list of finite numbers, at most :data:`MAX_METRICS` of them, a list no
  longer than the validator's ``max_list`` (its length is checked before any value is read); ``client-id`` and
  ``num-examples`` are integers; timings (``t-*``) in [0, :data:`MAX_SECONDS`], losses (``*-loss``) within
  ±:data:`LOSS_BOUND`, every other metric within ±:data:`METRIC_BOUND`;
- ``client-id`` is in ``[0, data.num_clients)`` and belongs to this node (identity, below);
- ``num-examples`` is positive and not above the client's training-set size where the server knows it
  (simulation: it builds the federation); where it cannot (deployment), the first value a client reports is
  bound and a later different value is rejected, and with an operator's node registry (``data.node_registry``,
  :class:`fedapps.data.nodes.NodeRegistry`) a value above the client's cap, or an id the registry does not list,
  is rejected too;
- every evaluation asked for is complete, no other is present: accuracy in [0, 1], loss finite and >= 0,
  counts integral and >= 0, ``correct <= n``, ``n`` <= the client's test-set size where the server knows it
  (simulation), and the accuracy equals ``correct / n``; where it cannot (deployment) ``n`` must EQUAL the size of
  the evaluation split the client described before round 1 (:func:`fedapps.flower.describe.bind_accepted`) or, for a
  client never described, the first size it reported, and must not exceed what the split rules give for its bound
  ``num-examples`` (:func:`max_eval_count`; with a node registry, hence for the registry's cap): every evaluation
  of a client reads the same split, so one client's weight in a sample-weighted headline is its bound share;
- arrays (strict wire types, :func:`wire_label`): exactly the expected names; each labelled (Flower's ``Array``
  ``dtype`` / ``shape`` / ``stype``) with exactly the dtype the message asked for — the model's own, byte order
  included (float32, or the integer type of an integer buffer), or float16 where ``arrays.transport: float16``
  (an array beyond float16's range may come in the model's dtype, as :func:`fedapps.wire.protocol.encode_arrays`
  sends it) — and the expected shape; its byte length that of such an array; these are checked BEFORE any
  byte is decoded, then the .npy header must say the same; after decoding, float16 is cast up to the model's
  dtype and every value must be finite in that dtype;
- predictions: the same wire checks (float32 / float16 scores as ``predict.encoding`` says, hard labels in
  :func:`fedapps.wire.pseudolabels.label_dtype`), then probabilities on the simplex (entries >= -1e-3, rows summing
  to 1 within 1e-2), logits within ``|x| <= 1e4``, hard labels in [0, classes);
- ``profile`` (where the client's time went, :class:`fedapps.wire.protocol.MessageProfile`): known phases only, each
  in [0, :data:`MAX_SECONDS`] seconds;
- ``info``: at most :data:`INFO_MAX_KEYS` entries of at most :data:`INFO_MAX_SIZE` characters / items each;
- U's fingerprint (``info["fingerprint"]``) equals the server's wherever the message named one;
- it is the node's only reply in this round's phase, to a message the server sent it.

Identity is bound to the node: the node ↔ client-id pairing is fixed on the first accepted reply. A reply
claiming an id bound to another node, a node changing its id, or an id no node has yet but that several
nodes claim in the same batch, is rejected; so no reply can touch another client's state. (A node that
claims a free id on first contact before its owner ever replies does get it: the server has no other
source of identity in deployment. docs/reliability.md says so.)

ANY exception while validating a reply becomes a rejection with its reason; :meth:`check` never raises.

Each reply is checked once, here: the strategies receive the accepted replies only and do not check them again
(a reply the algorithm cannot use for a reason of its own is recorded by the strategy's ``skip_reply``). The
predictions of every pseudo-label strategy (COSMOS, FedMD, FedCT, COMET) pass the one prediction check,
:func:`prediction_problem`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply, Draft, ReplyError, short

log = logging.getLogger("fedapps")

PROB_TOLERANCE = 1e-2  # |row sum − 1| of probability predictions (float16 on the wire rounds to ~1e-3)
PROB_NEGATIVE = 1e-3  # smallest entry allowed in a probability row: −this
LOGIT_BOUND = 1e4  # |logit| above this is no model's output: it would take over a mean consensus
ACC_TOLERANCE = 1e-6  # |acc − correct/n|
RECORDS = (protocol.METRICS, protocol.ARRAYS, protocol.PREDICTIONS, protocol.INFO, protocol.PROFILE)
# metric ranges: a reply outside them is rejected (rounds.csv averages train losses and sums timings)
MAX_METRICS = 1024  # metrics in one reply (a client sends a few dozen)
MAX_SECONDS = 7 * 24 * 3600.0  # a timing (t-<op>, t-total) in [0, one week]
LOSS_BOUND = 1e9  # |loss| (ops.evaluate reports a non-finite evaluation loss as 1e9)
METRIC_BOUND = 1e15  # |value| of every other metric (client-id and num-examples are checked on their own)
LIST_FLOOR = 4096  # a list metric may hold max(this, clients, classes + 1) values (per class or per client lists)
LIST_UNKNOWN = 65536  # ... or this many where the classes are not known yet (the describe phase)
METRIC_LISTS = 4  # list metrics at full length in one reply (the most any operation sends: describe's 3)
ARRAY_SLACK = 64  # arrays beyond those asked for that the cost check lets through to the exact name check's message
INFO_MAX_KEYS = 16  # entries of a reply's info record (arch, fingerprint)
INFO_MAX_SIZE = 1024  # characters (or items) of one info entry
NPY_MAX_HEADER = 10000  # bytes of an .npy header (numpy's own limit when it reads one)


@dataclass(frozen=True)
class ArraySpec:
    """One expected array: its shape and dtype (from the server's own model)."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class PredictionSpec:
    """Expected predictions on U: rows (None = unknown to the server), classes, output and wire encoding."""

    rows: int | None
    classes: int
    output: str = "probs"  # probs | logits
    encoding: str = "float32"  # float32 | float16 | hard


@dataclass
class Expectation:
    """What the server asked one node for in one message."""

    node_id: int
    phase: str = protocol.MESSAGE_TYPE
    arrays: dict[str, ArraySpec] | None = None  # None: no arrays asked for (a reply carrying some is rejected)
    predictions: PredictionSpec | None = None
    fingerprint: str | None = None
    eval_tags: tuple[str, ...] = ()
    transport: str = "float32"  # arrays.transport of the message: float16 lets floating arrays come as float16


@dataclass
class Rejection:
    """A reply not used, and why (a row of rejections.csv)."""

    round: int
    phase: str
    node_id: int | None
    client_id: int | None
    reason: str

    def row(self) -> dict[str, Any]:
        """The row of rejections.csv: the fields by name, an unknown node or client as ''."""
        return {k: "" if v is None else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class Outcome:
    """One batch of replies checked: the accepted ones, the rejections and how many expected nodes never replied."""

    accepted: list[ClientReply] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    missing: int = 0


# --------------------------------------------------------------------------- error replies

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CLASS_FORMAT = re.compile(r"^<class '([\w.()]+)'>:<'(.*)'>$", re.S)  # Flower: str(type(ex)) + ":<'" + str(ex) + "'>"
_RAY_MESSAGE = "Exception ClientAppException occurred. Message: "  # Flower's Ray actor re-raises with this prefix
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Fault)): (.*)$", re.M)


def error_reason(reason: str) -> str:
    """An error reply's reason as a reader wants it: ``ExceptionClass: message``. Flower 1.42 sends
    ``<class 'mod.Class'>:<'message'>`` from a SuperNode, and from the Ray simulation the whole remote traceback
    (with terminal colour codes) ending in ``... Message: <message>'>``; both are cut down to the client's own
    exception and message. Any other text is returned as it is."""
    text = _ANSI.sub("", reason).strip()
    if _RAY_MESSAGE in text:
        message = text.rsplit(_RAY_MESSAGE, 1)[1]
        message = message[:-2] if message.endswith("'>") else message
        first = message.splitlines()[0] if message else ""
        names = [
            m.group(1)
            for m in _EXCEPTION_LINE.finditer(text)
            if first and m.group(2).startswith(first) and not m.group(1).endswith("ClientAppException")
        ]
        return f"{names[0].rsplit('.', 1)[-1]}: {message}" if names else message
    match = _CLASS_FORMAT.match(text)
    if match:
        return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
    return text


# --------------------------------------------------------------------------- expectations from messages


def eval_tags_of(ops: Iterable[str]) -> tuple[str, ...]:
    """The evaluation tags the ops produce: every ``evaluate*`` op (tagged ``op:tag`` or its default tag)."""
    tags: list[str] = []
    for op in ops:
        base, _, tag = str(op).partition(":")
        if not base.startswith("evaluate"):
            continue
        tag = tag or protocol.EVALUATION_TAGS.get(base, base)
        if tag not in tags:
            tags.append(tag)
    return tuple(tags)


def expectation_for(
    draft: Draft,
    model_part: Callable[[str], Mapping[str, np.ndarray]] | None,
    public_size: int | None,
    num_classes: int | None,
) -> Expectation:
    """What the message of ``draft`` asks its node for (see the module docstring)."""
    request = draft.request
    ops = list(request.ops)
    exp = Expectation(
        node_id=int(draft.node),
        phase=draft.message_type,
        fingerprint=request.public.fingerprint,
        eval_tags=eval_tags_of(ops),
        transport=request.array_transport,
    )
    if request.returns.arrays:
        if model_part is not None:
            exp.arrays = {
                k: ArraySpec(tuple(np.shape(v)), np.asarray(v).dtype)
                for k, v in model_part(request.returns.which).items()
            }
    if any(o.partition(":")[0] == "predict" for o in ops):
        rows = public_size
        targets = draft.targets
        if targets is not None and protocol.PREDICT_INDICES in targets:
            rows = int(targets[protocol.PREDICT_INDICES].shape[0])
        exp.predictions = PredictionSpec(
            rows=rows,
            classes=int(num_classes or 0),
            output=request.public.predict_output,
            encoding=request.public.predict_encoding,
        )
    return exp


# --------------------------------------------------------------------------- the cost of one reply


@dataclass(frozen=True)
class ReplyBudget:
    """The most a reply may carry for what its message asked (:func:`reply_budget`); :func:`check_cost` holds a reply
    to it before any of its values is read."""

    values: int  # metric values: a number counts one, a list its length
    nbytes: int | None  # protocol.record_nbytes of the reply (None: not bounded, predictions of unknown rows)
    entries: Mapping[str, int]  # record -> most entries it may hold


def reply_budget(exp: Expectation, max_list: int) -> ReplyBudget:
    """What answering ``exp`` may cost at most: :data:`MAX_METRICS` numbers and :data:`METRIC_LISTS` lists of
    ``max_list`` values; the arrays and predictions asked for at their widest allowed wire dtype, each with an .npy
    header of at most :data:`NPY_MAX_HEADER` bytes; an info record at its limits (8 bytes a list item, as
    :func:`fedapps.wire.protocol.record_nbytes` counts)."""
    values = MAX_METRICS + METRIC_LISTS * int(max_list)
    nbytes: int | None = 8 * values + 8 * INFO_MAX_KEYS * INFO_MAX_SIZE
    for spec in (exp.arrays or {}).values():
        width = max(d.itemsize for d in array_dtypes(spec, exp.transport))
        nbytes = (nbytes or 0) + math.prod(spec.shape) * width + NPY_MAX_HEADER
    if exp.predictions is not None:
        p = exp.predictions
        if p.rows is None:
            nbytes = None
        elif nbytes is not None:
            cells = p.rows * (1 if p.encoding == "hard" else p.classes)
            nbytes += cells * prediction_dtype(p).itemsize + NPY_MAX_HEADER
    entries = {  # arrays and predictions: generous here (what costs is bounded by nbytes), exact in _record_names
        protocol.METRICS: MAX_METRICS,
        protocol.ARRAYS: 2 * len(exp.arrays or {}) + ARRAY_SLACK,
        protocol.PREDICTIONS: 1 + ARRAY_SLACK,
        protocol.INFO: INFO_MAX_KEYS,
        protocol.PROFILE: len(protocol.PROFILE_FIELDS),
    }
    return ReplyBudget(values, nbytes, entries)


def check_cost(content: Any, budget: ReplyBudget, max_list: int = LIST_UNKNOWN) -> None:
    """A reply within ``budget``, judged on counts and lengths alone (no value is read): each record's entries, each
    list metric's length (``max_list``), the metric values in all. ReplyError naming what is over and by how much.
    The first check of every reply: the expensive ones run only on what passes it (and :func:`check_bytes`)."""
    for name in content.keys():
        held, most = len(content[name]), budget.entries.get(name, 0)
        if held > most:
            raise ReplyError(f"'{name}' record holds {held} entries; at most {most} are expected for this request")
    if protocol.METRICS not in content:
        return
    metrics = content[protocol.METRICS]
    lengths = []
    for key, value in metrics.items():
        if isinstance(value, list) and len(value) > max_list:
            raise ReplyError(f"metric '{key}' is a list of {len(value)} values; at most {max_list} are expected")
        lengths.append(len(value) if isinstance(value, list) else 1)
    if sum(lengths) > budget.values:
        lists = sum(1 for v in metrics.values() if isinstance(v, list))
        raise ReplyError(
            f"reply carries {sum(lengths):,} metric values ({len(lengths)} metrics, {lists} of them lists); at most "
            f"{budget.values:,} are expected ({MAX_METRICS} numbers and {METRIC_LISTS} lists of {max_list}): refused "
            "before any value is read"
        )


def check_bytes(content: Any, budget: ReplyBudget) -> None:
    """The reply's bytes (:func:`fedapps.wire.protocol.record_nbytes`) within ``budget``: run after the arrays'
    labels and lengths were checked (each names its own fault) and before any value is read."""
    if budget.nbytes is None:
        return
    nbytes = protocol.record_nbytes(content)
    if nbytes > budget.nbytes:
        raise ReplyError(
            f"reply carries {nbytes:,} bytes; at most {budget.nbytes:,} are expected for what its message asked "
            "(the arrays and predictions asked for, metrics and info at their limits): refused before any value is "
            "read"
        )


# --------------------------------------------------------------------------- checks of one reply


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _integral(key: str, v: Any) -> int:
    if not _is_number(v) or not math.isfinite(float(v)) or float(v) != int(float(v)):
        raise ReplyError(f"metric '{key}' must be a whole number, got {v!r}")
    return int(float(v))


def metric_bound(key: str) -> tuple[float, float]:
    """The range a metric's values must lie in: timings [0, MAX_SECONDS], losses ±LOSS_BOUND, else ±METRIC_BOUND."""
    if key.startswith(protocol.TIMING_PREFIX):
        return 0.0, MAX_SECONDS
    if key.endswith("-loss"):
        return -LOSS_BOUND, LOSS_BOUND
    return -METRIC_BOUND, METRIC_BOUND


def check_metrics(metrics: Mapping[str, Any], max_list: int = LIST_UNKNOWN) -> None:
    """Every metric a finite number or a list of finite numbers, within its range (:func:`metric_bound`); at most
    :data:`MAX_METRICS` metrics and ``max_list`` values per list, both counted before any value is read.
    ``client-id`` and ``num-examples`` are only checked to be finite numbers here (their own checks follow)."""
    if len(metrics) > MAX_METRICS:
        raise ReplyError(f"reply carries {len(metrics)} metrics; at most {MAX_METRICS} are expected")
    for key, value in metrics.items():
        if isinstance(value, list) and len(value) > max_list:
            raise ReplyError(f"metric '{key}' is a list of {len(value)} values; at most {max_list} are expected")
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        low, high = metric_bound(key)
        ranged = key not in (protocol.CLIENT_ID, protocol.NUM_EXAMPLES)
        for v in values:
            if not _is_number(v):
                raise ReplyError(f"metric '{key}' must be a number or a list of numbers, got {type(v).__name__}")
            if not math.isfinite(float(v)):
                raise ReplyError(f"metric '{key}' is not finite: {short(value)}")
            if ranged and not low <= float(v) <= high:
                raise ReplyError(f"metric '{key}' = {short(value)} is outside [{low:g}, {high:g}]")


def max_eval_count(train: int, share: float) -> int:
    """The most evaluation samples a node can hold beside ``train`` training samples under the data spec's split
    (:func:`fedapps.data.federation.split_node`): its evaluation split takes ``round(share · N)`` of its N samples
    (``share``: data.test_fraction, or data.validation_fraction of the train split under evaluate_on: validation),
    the training split the rest, so E = round(share · (train + E)) <= share · (train + E) + 1/2, i.e.
    E <= (share · train + 1/2) / (1 − share). (A tiny node that keeps one training sample holds fewer.)"""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"evaluation share {share} must be in [0, 1)")
    return int(math.floor((share * max(0, int(train)) + 0.5) / (1.0 - share) + 1e-9))


def evaluation_share(data_cfg: Any) -> float:
    """The share of a node's data its evaluation split takes (:func:`max_eval_count`): ``data.test_fraction``, or
    ``data.validation_fraction`` under ``data.evaluate_on: validation``."""
    if getattr(data_cfg, "evaluate_on", "test") == "validation":
        return float(data_cfg.validation_fraction)
    return float(data_cfg.test_fraction)


def check_evaluations(
    metrics: Mapping[str, Any],
    expected: Iterable[str],
    test_size: int | None,
    bound: int | None = None,
    cap: int | None = None,
    client: int | None = None,
) -> None:
    """The evaluations asked for are complete and plausible; no other evaluation is reported. ``test_size``: the
    client's evaluation-split size the server knows (simulation), an upper bound of every ``<tag>-n``; ``bound``: the
    size bound in deployment (described, or first reported), which every ``<tag>-n`` must equal; ``cap``: the most
    the split rules allow a client not yet bound (:func:`max_eval_count`), an upper bound. ``client``: for the
    messages."""
    expected = list(expected)
    present = {k.rsplit("-", 1)[0] for k in metrics if k.endswith(("-acc", "-n", "-correct"))}
    extra = sorted(present - set(expected))
    if extra:
        raise ReplyError(f"evaluation(s) {extra} were not asked for")
    for tag in expected:
        names = {f: protocol.metric_name(tag, f) for f in protocol.EVAL_FIELDS}
        lacking = [n for n in names.values() if n not in metrics]
        if lacking:
            raise ReplyError(f"evaluation '{tag}' lacks {lacking}")
        values = {f: metrics[n] for f, n in names.items()}
        for f, v in values.items():
            if not _is_number(v):
                raise ReplyError(f"metric '{names[f]}' must be a number, got {v!r}")
        acc, loss = float(values["acc"]), float(values["loss"])
        n, correct = _integral(names["n"], values["n"]), _integral(names["correct"], values["correct"])
        if not 0.0 <= acc <= 1.0:
            raise ReplyError(f"metric '{names['acc']}' = {acc} is not an accuracy in [0, 1]")
        if loss < 0:
            raise ReplyError(f"metric '{names['loss']}' = {loss} is negative")
        if n < 0 or correct < 0 or correct > n:
            raise ReplyError(f"counts '{names['correct']}' = {correct}, '{names['n']}' = {n}: need 0 <= correct <= n")
        if test_size is not None and n > test_size:
            raise ReplyError(f"metric '{names['n']}' = {n} exceeds the client's test-set size {test_size}")
        if bound is not None and n != bound:
            raise ReplyError(
                f"metric '{names['n']}' = {n} differs from the {bound} evaluation samples client {client} is bound "
                "to (described before round 1, or first reported): every evaluation reads the same split"
            )
        if cap is not None and n > cap:
            raise ReplyError(
                f"metric '{names['n']}' = {n} exceeds the {cap} evaluation samples the data split allows client "
                f"{client} beside its bound num-examples"
            )
        if n > 0 and abs(acc - correct / n) > ACC_TOLERANCE:
            raise ReplyError(f"metric '{names['acc']}' = {acc} disagrees with correct/n = {correct}/{n}")


def _label_shape(value: Any) -> tuple[int, ...] | None:
    """An Array's shape label as a tuple of ints (None when it is not one)."""
    try:
        shape = tuple(value)
    except TypeError:
        return None
    return shape if all(_is_int(d) and int(d) >= 0 for d in shape) else None


def _shape_fits(shape: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(shape) == len(expected) and all(e is None or int(s) == e for s, e in zip(shape, expected))


def _shape_text(expected: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("any" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"


@dataclass(frozen=True)
class WireArray:
    """A received array whose label, byte length and .npy header were checked (:func:`wire_label`); its values are
    read by :meth:`decode`."""

    data: bytes
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def decode(self) -> np.ndarray:
        """The values, read with the checked dtype (no pickle, no conversion), as a writable copy."""
        count = math.prod(self.shape)
        flat = (
            np.frombuffer(self.data, self.dtype, count=count, offset=self.offset) if count else np.empty(0, self.dtype)
        )
        return flat.reshape(self.shape).copy()


def wire_label(
    value: Any, name: str, what: str, shape: tuple[int | None, ...], dtypes: Iterable[np.dtype]
) -> WireArray:
    """One received array, checked as it travels, no value read: a Flower ``Array`` of stype ``numpy.ndarray``
    labelled with one of ``dtypes`` (exactly: width and byte order) and ``shape`` (None: any length on that axis),
    whose byte length is that of such an array plus an .npy header; then the header itself must say the same dtype
    and shape (C order). ReplyError, naming ``what`` and ``name``, otherwise."""
    allowed = [np.dtype(d) for d in dtypes]
    if not isinstance(value, Array):
        raise ReplyError(f"{what} '{name}' is not an Array ({type(value).__name__})")
    if value.stype != "numpy.ndarray":
        raise ReplyError(f"{what} '{name}' has serialisation {short(value.stype)}, expected numpy.ndarray")
    label = str(value.dtype)
    dtype = next((d for d in allowed if str(d) == label), None)
    if dtype is None:
        raise ReplyError(
            f"{what} '{name}' has dtype {short(label, 40)}, expected {' or '.join(str(d) for d in allowed)}"
        )
    labelled = _label_shape(value.shape)
    if labelled is None or not _shape_fits(labelled, shape):
        raise ReplyError(f"{what} '{name}' has shape {short(value.shape, 60)}, expected {_shape_text(shape)}")
    data = value.data
    body = math.prod(labelled) * dtype.itemsize
    if not isinstance(data, (bytes, bytearray)) or not body < len(data) <= body + NPY_MAX_HEADER:
        size = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
        raise ReplyError(
            f"{what} '{name}' cannot be decoded: {size} bytes for a {dtype} array of shape "
            f"{labelled} ({body} bytes and an .npy header)"
        )
    try:
        head_shape, fortran, head_dtype, offset = protocol.npy_header(data)
    except Exception as exc:
        raise ReplyError(f"{what} '{name}' cannot be decoded: {type(exc).__name__}: {short(str(exc))}") from exc
    if head_dtype != dtype or tuple(head_shape) != labelled or fortran or offset + body != len(data):
        raise ReplyError(
            f"{what} '{name}' cannot be decoded: its bytes hold a {short(str(head_dtype), 40)} array of "
            f"shape {short(head_shape, 60)}{' (Fortran order)' if fortran else ''} in {len(data)} bytes, "
            f"labelled {dtype} {labelled}"
        )
    return WireArray(bytes(data), dtype, labelled, offset)


def array_dtypes(spec: ArraySpec, transport: str) -> list[np.dtype]:
    """The wire dtypes a model array may come in: the model's own; under ``float16`` transport a floating array
    wider than float16 comes as float16 (or, beyond float16's range, in the model's own dtype)."""
    own = np.dtype(spec.dtype)
    if transport == "float16" and own.kind == "f" and own.itemsize > 2:
        return [np.dtype(np.float16), own]
    return [own]


def prediction_dtype(spec: PredictionSpec) -> np.dtype:
    """The wire dtype of predictions: float32 / float16 scores, hard labels in the smallest unsigned type."""
    if spec.encoding == "hard":
        return pseudolabels.label_dtype(spec.classes)
    return np.dtype(np.float16 if spec.encoding == "float16" else np.float32)


def _record_names(record: Any, what: str, expected: Iterable[str]) -> list[str]:
    """A received ArrayRecord holds exactly the ``expected`` names (checked before any array is decoded)."""
    if not isinstance(record, ArrayRecord):
        raise ReplyError(f"'{what}' must be an ArrayRecord, got {type(record).__name__}")
    expected = list(expected)
    names = list(record.keys())
    if set(names) != set(expected) or len(names) != len(expected):
        missing, unknown = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        raise ReplyError(
            f"{what} do not match the request ({len(names)} given, {len(expected)} expected): missing "
            f"{missing[:3]}, unknown {[short(u, 40) for u in unknown[:3]]}"
        )
    return expected


def label_arrays(
    record: Any, expected: Mapping[str, ArraySpec], transport: str = "float32"
) -> dict[str, tuple[WireArray, ArraySpec]]:
    """The model arrays of a reply checked as they travel, no value read: names, then each array's wire type
    (:func:`wire_label`)."""
    return {
        k: (
            wire_label(record[k], k, "array", tuple(expected[k].shape), array_dtypes(expected[k], transport)),
            expected[k],
        )
        for k in _record_names(record, protocol.ARRAYS, expected)
    }


def decode_arrays(labelled: Mapping[str, tuple[WireArray, ArraySpec]]) -> dict[str, np.ndarray]:
    """Arrays checked by :func:`label_arrays`, decoded, cast to the model's dtype (float16 up) and checked finite."""
    out: dict[str, np.ndarray] = {}
    for k, (wire, spec) in labelled.items():
        a = protocol.from_wire(wire.decode(), spec.dtype)
        if a.dtype != spec.dtype:
            raise ReplyError(f"array '{k}' has dtype {a.dtype} after decoding, expected {spec.dtype}")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise ReplyError(f"array '{k}' has non-finite values (in {spec.dtype})")
        out[k] = a
    return out


def label_predictions(record: Any, spec: PredictionSpec) -> WireArray:
    """The predictions of a reply checked as they travel, no value read: the one array 'predictions', its wire
    type."""
    _record_names(record, protocol.PREDICTIONS, [protocol.PREDICTION_ARRAY])
    shape: tuple[int | None, ...] = (spec.rows,) if spec.encoding == "hard" else (spec.rows, spec.classes)
    name = protocol.PREDICTION_ARRAY
    return wire_label(record[name], name, "prediction", shape, [prediction_dtype(spec)])


def decode_predictions(wire: WireArray, spec: PredictionSpec) -> np.ndarray:
    """Predictions checked by :func:`label_predictions`, decoded and held to :func:`prediction_problem`."""
    values = wire.decode()
    problem = prediction_problem(values, spec)
    if problem:
        raise ReplyError(f"predictions unusable: {problem}")
    return values


def check_info(info: Mapping[str, Any]) -> None:
    """A reply's info record is small: at most INFO_MAX_KEYS entries of at most INFO_MAX_SIZE characters/items."""
    if len(info) > INFO_MAX_KEYS:
        raise ReplyError(f"'info' carries {len(info)} entries; at most {INFO_MAX_KEYS} are expected")
    for k, v in info.items():
        if isinstance(v, (str, bytes, list)) and len(v) > INFO_MAX_SIZE:
            raise ReplyError(
                f"'info' entry '{short(k, 40)}' holds {len(v)} characters or items; at most "
                f"{INFO_MAX_SIZE} are expected"
            )


def read_profile(content: Any) -> protocol.MessageProfile | None:
    """The reply's profile (None without one): only known phases, each a number of seconds in [0,
    :data:`MAX_SECONDS`] (rounds.csv sums them)."""
    profile = protocol.profile_of(content)
    if profile is not None:
        for name in protocol.PROFILE_FIELDS:
            seconds = getattr(profile, name)
            if seconds > MAX_SECONDS:
                raise ReplyError(f"profile phase '{name}' = {seconds:g} s is outside [0, {MAX_SECONDS:g}]")
    return profile


def prediction_problem(wire: np.ndarray, spec: PredictionSpec) -> str | None:
    """Why a prediction array does not answer ``spec`` (None if it does): the shape (rows × classes; rows for hard
    labels), hard labels of an unsigned type in [0, classes) (the abstain marker ``classes`` is the server's, never
    a client's), scores finite, logits within ±LOGIT_BOUND, probabilities on the simplex. The one prediction check."""
    m = spec.classes
    if spec.encoding == "hard":
        if wire.ndim != 1 or (spec.rows is not None and wire.shape[0] != spec.rows):
            return f"hard labels of shape {wire.shape}, expected ({spec.rows},)"
        if not np.issubdtype(wire.dtype, np.unsignedinteger):
            return f"hard labels of dtype {wire.dtype}, expected an unsigned integer type"
        if wire.size and int(wire.max()) >= m:
            return f"hard label {int(wire.max())} out of range [0, {m})"
        return None
    if wire.ndim != 2 or wire.shape[1] != m or (spec.rows is not None and wire.shape[0] != spec.rows):
        return f"scores of shape {wire.shape}, expected ({spec.rows}, {m})"
    if not np.issubdtype(wire.dtype, np.floating):
        return f"scores of dtype {wire.dtype}, expected a floating dtype ({spec.encoding})"
    values = wire.astype(np.float64)
    if not np.all(np.isfinite(values)):
        return "scores contain non-finite values"
    if spec.output == "logits":
        if wire.size and np.abs(values).max() > LOGIT_BOUND:
            return f"logits beyond ±{LOGIT_BOUND:g} (max |x| = {np.abs(values).max():.3g})"
        return None
    if wire.size and (values.min() < -PROB_NEGATIVE or np.abs(values.sum(axis=1) - 1).max() > PROB_TOLERANCE):
        return "not probability vectors (entries must be >= 0 and rows sum to 1)"
    return None


# --------------------------------------------------------------------------- the validator


def registry_of(data_cfg: Any) -> Any:
    """The operator's node registry of a data config (``data.node_registry`` under data.source 'nodes'; None
    without one). Read on the server, where the file is; a DataError names the key and the file's problem."""
    from fedapps.data import NODES
    from fedapps.data.nodes import read_registry

    if data_cfg.source != NODES or not getattr(data_cfg, "node_registry", ""):
        return None
    return read_registry(data_cfg.node_registry, data_cfg.num_clients)


class ReplyValidator:
    """Checks each reply against the expectation recorded when its message was built; binds identities.

    ``train_sizes`` / ``test_sizes`` (per client id) are the bounds of ``num-examples`` / ``<tag>-n`` where the
    server knows them (simulation); None in deployment: then ``bound_examples`` / ``bound_tests`` hold each client's
    ``num-examples`` and evaluation-split size as the describe phase reported them (:func:`fedapps.flower.describe.
    bind_accepted`) or, for a client never described, as its first accepted reply did, and a later reply must
    repeat them; ``eval_share`` (:func:`evaluation_share`) caps an evaluation size not yet bound by what the split
    rules give for the bound ``num-examples`` (:func:`max_eval_count`).
    ``model_part(part)`` gives the server's model arrays for 'state' | 'params' | 'body'. ``registry``: the
    operator's cap on each client's ``num-examples`` (deployment with a node registry).
    """

    def __init__(
        self,
        num_clients: int,
        train_sizes: Iterable[int] | None = None,
        test_sizes: Iterable[int] | None = None,
        model_part: Callable[[str], Mapping[str, np.ndarray]] | None = None,
        public_size: int | None = None,
        num_classes: int | None = None,
        registry: Any = None,
        eval_share: float | None = None,
    ) -> None:
        self.num_clients = int(num_clients)
        self.eval_share = eval_share
        self.registry = registry  # a fedapps.data.nodes.NodeRegistry, or None
        self.train_sizes = None if train_sizes is None else [int(v) for v in train_sizes]
        self.test_sizes = None if test_sizes is None else [int(v) for v in test_sizes]
        self._model_part = model_part
        self._parts: dict[str, dict[str, np.ndarray]] = {}
        self.public_size = public_size
        self.num_classes = num_classes
        # the longest list metric a reply may carry (per-class and per-client lists are the longest clients send)
        self.max_list = (
            max(LIST_FLOOR, self.num_clients, int(num_classes) + 1)
            if num_classes
            else max(LIST_UNKNOWN, self.num_clients)
        )
        self.expected: dict[str, dict[int, Expectation]] = {}  # phase -> node -> expectation
        self.node_client: dict[int, int] = {}  # bound on first accepted reply
        self.client_node: dict[int, int] = {}
        self.bound_examples: dict[int, int] = {}  # deployment: num-examples first reported per client
        self.bound_tests: dict[int, int] = {}  # deployment: evaluation-split size described (or first reported)

    @classmethod
    def from_config(cls, cfg: Any) -> ReplyValidator:
        """The validator for an experiment config: sizes and U from the federation where the server can build
        it (simulation), the model from ``model.name``."""
        from fedapps.data import NODES, get_federation, spec_info
        from fedapps.models import build_model, state_part

        d = cfg.data
        train = test = None
        public_size = None
        num_classes, shape = spec_info(dataclasses.asdict(d))  # a source's, or what the nodes described
        try:
            fed = get_federation(dataclasses.asdict(d))
            if d.source != NODES:  # under 'nodes' the server holds no client data: sizes are bound on first report
                train, test = fed.train_counts.sum(axis=1), fed.test_counts.sum(axis=1)
            public_size = None if fed.public_x is None else int(fed.public_x.shape[0])
        except Exception as exc:  # noqa: BLE001 - deployment: the data lives on the clients only
            log.info(
                "reply validation: client data sizes unknown to the server (%s); num-examples is bound on first report",
                exc,
            )

        def model_part(part: str) -> dict[str, np.ndarray]:
            model = build_model(cfg.model.name, num_classes, shape, seed=cfg.seed)
            return {k: v.detach().cpu().numpy() for k, v in state_part(model, part).items()}

        return cls(
            d.num_clients, train, test, model_part, public_size, num_classes, registry_of(d), evaluation_share(d)
        )

    def model_part(self, part: str) -> dict[str, np.ndarray]:
        """The model's arrays of ``part``, built once (only for a validator given ``model_part``)."""
        if self._model_part is None:
            raise ValueError("this validator was given no model_part")
        if part not in self._parts:
            self._parts[part] = dict(self._model_part(part))
        return self._parts[part]

    def forget_nodes(self, nodes: Iterable[int]) -> None:
        """Drop the node <-> client bindings of ``nodes`` (a resumed run whose nodes have new ids): the clients
        they served are free to be bound again, by their new node's first accepted reply."""
        for node in nodes:
            client = self.node_client.pop(int(node), None)
            if client is not None and self.client_node.get(client) == int(node):
                del self.client_node[client]

    # ------------------------------------------------------------------ expectations
    def expect(self, drafts: Iterable[Draft]) -> None:
        """Record what each message (its draft) asks its node for (replaces the previous expectations of that
        phase)."""
        by_phase: dict[str, dict[int, Expectation]] = {}
        for draft in drafts:
            exp = expectation_for(
                draft,
                self.model_part if self._model_part is not None else None,
                self.public_size,
                self.num_classes,
            )
            by_phase.setdefault(exp.phase, {})[exp.node_id] = exp
        for phase, table in by_phase.items():
            self.expected[phase] = table

    # ------------------------------------------------------------------ one reply
    def parse(self, msg: Message, exp: Expectation) -> ClientReply:
        """The reply unpacked if it answers ``exp`` (identity is checked per batch); ReplyError otherwise
        (:func:`parse_reply`, strict)."""
        return parse_reply(msg, exp=exp, validator=self)

    def check_values(self, metrics: Mapping[str, Any], exp: Expectation, cid: int, n: int) -> None:
        """A reply's client id, size and evaluations against the federation (strict mode of :func:`parse_reply`)."""
        if not 0 <= cid < self.num_clients:
            raise ReplyError(f"client-id {cid} is outside the federation [0, {self.num_clients})")
        if n <= 0:
            raise ReplyError(f"num-examples {n} is not a positive integer")
        if self.train_sizes is not None and n > self.train_sizes[cid]:
            raise ReplyError(f"num-examples {n} exceeds client {cid}'s training-set size {self.train_sizes[cid]}")
        if self.train_sizes is None and cid in self.bound_examples and n != self.bound_examples[cid]:
            raise ReplyError(
                f"num-examples {n} differs from the {self.bound_examples[cid]} client {cid} first reported"
            )
        if self.registry is not None:
            problem = self.registry.problem(cid, n)
            if problem:
                raise ReplyError(problem)
        if self.test_sizes is not None:
            check_evaluations(metrics, exp.eval_tags, self.test_sizes[cid])
        else:
            self.check_deployed_evaluations(metrics, exp.eval_tags, cid, n)

    def check_deployed_evaluations(self, metrics: Mapping[str, Any], tags: Iterable[str], cid: int, n: int) -> None:
        """Deployment (no test sizes known): the evaluations of ``tags`` plausible, each ``<tag>-n`` equal to client
        ``cid``'s bound evaluation size where one is bound, else to each other and within the split rules' cap for
        its bound (or this reply's) ``num-examples``."""
        tags = list(tags)
        bound = self.bound_tests.get(cid)
        cap = None
        if bound is None and self.eval_share is not None:
            cap = max_eval_count(self.bound_examples.get(cid, n), self.eval_share)
        check_evaluations(metrics, tags, None, bound=bound, cap=cap, client=cid)
        sizes = {protocol.metric_name(t, "n"): int(float(metrics[protocol.metric_name(t, "n")])) for t in tags}
        if len(set(sizes.values())) > 1:
            raise ReplyError(
                f"evaluations of one reply count different samples ({short(sizes, 120)}): every evaluation reads "
                "the same split"
            )

    # ------------------------------------------------------------------ a batch
    def validate_batch(self, server_round: int, replies: Iterable[Message], phase: str | None = None) -> Outcome:
        """Validate one phase's replies; never raises. ``phase`` defaults to each reply's message type."""
        out = Outcome()
        seen: set[int] = set()
        candidates: list[tuple[ClientReply, str]] = []
        phases: set[str] = set()
        try:
            replies = list(replies)
        except Exception as exc:  # noqa: BLE001
            out.rejections.append(Rejection(server_round, phase or "", None, None, f"replies unreadable: {exc}"))
            return out

        def reject(node: int | None, claimed: Any, ph: str, reason: str) -> None:
            cid = self.node_client.get(node) if node is not None else None
            if cid is None and _is_int(claimed) and 0 <= int(claimed) < self.num_clients:
                cid = int(claimed)
            out.rejections.append(Rejection(server_round, ph, node, cid, reason))
            log.warning("round %d: rejected reply of node %s (client %s): %s", server_round, node, cid, reason)

        for msg in replies:
            node, claimed, ph = None, None, phase or protocol.MESSAGE_TYPE
            try:
                node = int(msg.metadata.src_node_id)
                ph = phase or str(msg.metadata.message_type)
                phases.add(ph)
                if not msg.has_error() and protocol.METRICS in msg.content:
                    claimed = dict(msg.content[protocol.METRICS]).get(protocol.CLIENT_ID)
                exp = self.expected.get(ph, {}).get(node)
                if exp is None:
                    raise ReplyError(f"no '{ph}' message was sent to node {node} in this round")
                if node in seen:
                    raise ReplyError("duplicate reply: this node already replied in this round")
                seen.add(node)
                candidates.append((self.parse(msg, exp), ph))
            except Exception as exc:  # noqa: BLE001 - any failure is a rejection, never a crash
                reason = str(exc) if isinstance(exc, ReplyError) else f"{type(exc).__name__}: {exc}"
                reject(node, claimed, ph, reason)
        # identity: bound pairs must hold; a free id claimed by several nodes in this batch goes to none of them
        claims: dict[int, set[int]] = {}
        for r, _ in candidates:
            claims.setdefault(r.client_id, set()).add(r.node_id)
        for r, ph in candidates:
            bound = self.node_client.get(r.node_id)
            owner = self.client_node.get(r.client_id)
            if bound is not None and bound != r.client_id:
                reject(
                    r.node_id, r.client_id, ph, f"node is bound to client {bound} but claims client-id {r.client_id}"
                )
            elif owner is not None and owner != r.node_id:
                reject(r.node_id, r.client_id, ph, f"client-id {r.client_id} is bound to node {owner}")
            elif owner is None and len(claims[r.client_id]) > 1:
                reject(r.node_id, r.client_id, ph, f"client-id {r.client_id} is claimed by several nodes at once")
            else:
                self.node_client[r.node_id] = r.client_id
                self.client_node[r.client_id] = r.node_id
                if self.train_sizes is None:
                    self.bound_examples.setdefault(r.client_id, r.num_examples)
                if self.test_sizes is None:  # a client never described: its first evaluation size binds
                    expected = self.expected.get(ph, {}).get(r.node_id)
                    tags = expected.eval_tags if expected is not None else ()
                    if tags:
                        first = protocol.metric_name(tags[0], "n")
                        self.bound_tests.setdefault(r.client_id, int(float(r.metrics[first])))
                out.accepted.append(r)
        for ph in phases or {phase or protocol.MESSAGE_TYPE}:
            asked = self.expected.get(ph, {})
            out.missing += sum(1 for n in asked if n not in seen)
        return out


# --------------------------------------------------------------------------- the reply parser


def parse_reply(
    msg: Message,
    expect_arrays: bool = False,
    expect_predictions: bool = False,
    exp: Expectation | None = None,
    validator: ReplyValidator | None = None,
) -> ClientReply:
    """The one reply parser: ``msg`` unpacked into a :class:`ClientReply`, or ReplyError saying why it cannot be used.

    Strict (``exp`` and ``validator`` given, the round loop's :meth:`ReplyValidator.parse`): every check of the module
    docstring but identity, which is checked per batch — no record beyond the known ones, the cost within what the
    message asked for before any value is read, arrays and predictions exactly as asked, the values in range, the
    client's size and evaluations plausible, U's fingerprint the server's.

    Lenient (tools and tests reading replies of their own runs): what any reply must be — no error, a ``metrics``
    record with integer ``client-id`` and ``num-examples`` >= 0, metrics in range, arrays finite as float32 (float16
    cast up) and, where ``expect_arrays`` / ``expect_predictions``, present; arrays and predictions of any name and
    shape."""
    if msg.has_error():
        raise ReplyError(f"client error {msg.error.code}: {error_reason(str(msg.error.reason))}")
    strict = exp is not None and validator is not None
    max_list = validator.max_list if validator is not None else LIST_UNKNOWN
    content = msg.content
    if strict:
        unknown = [k for k in content.keys() if k not in RECORDS]
        if unknown:
            raise ReplyError(f"unexpected record(s) {unknown}")
    if protocol.METRICS not in content or not isinstance(content[protocol.METRICS], MetricRecord):
        raise ReplyError("reply without a 'metrics' record")
    arrays_in = predictions_in = None
    if exp is not None and validator is not None:
        # the cost first, on counts, lengths and labels alone: nothing is read or decoded before it passes
        budget = reply_budget(exp, max_list)
        check_cost(content, budget, max_list)
        if protocol.ARRAYS in content:
            if exp.arrays is None:
                raise ReplyError("reply carries model arrays that were not asked for")
            arrays_in = label_arrays(content[protocol.ARRAYS], exp.arrays, exp.transport)
        elif exp.arrays is not None:
            raise ReplyError("reply lacks the model arrays it was asked for")
        if protocol.PREDICTIONS in content:
            if exp.predictions is None:
                raise ReplyError("reply carries predictions that were not asked for")
            predictions_in = label_predictions(content[protocol.PREDICTIONS], exp.predictions)
        elif exp.predictions is not None:
            raise ReplyError("reply lacks the predictions it was asked for")
        check_bytes(content, budget)
    elif protocol.ARRAYS not in content and expect_arrays:
        raise ReplyError("reply lacks the model arrays it was asked for")
    elif protocol.PREDICTIONS not in content and expect_predictions:
        raise ReplyError("reply lacks the predictions it was asked for")
    # then the values
    metrics: dict[str, Any] = dict(content.metric_records[protocol.METRICS])
    for key in (protocol.CLIENT_ID, protocol.NUM_EXAMPLES):
        if key not in metrics:
            raise ReplyError(f"reply metrics lack '{key}'")
        if not _is_int(metrics[key]):
            raise ReplyError(f"metric '{key}' must be an integer, got {metrics[key]!r}")
    check_metrics(metrics, max_list)
    cid, n = int(metrics[protocol.CLIENT_ID]), int(metrics[protocol.NUM_EXAMPLES])
    if exp is not None and validator is not None:
        validator.check_values(metrics, exp, cid, n)
    elif n < 0:
        raise ReplyError(f"negative num-examples {n}")
    info: dict[str, Any] = {}
    if protocol.INFO in content:
        if not isinstance(content[protocol.INFO], ConfigRecord):
            raise ReplyError("'info' must be a ConfigRecord")
        info = dict(content.config_records[protocol.INFO])
        check_info(info)
    fingerprint = info.get(protocol.INFO_FINGERPRINT)
    if exp is not None and exp.fingerprint is not None and fingerprint != exp.fingerprint:
        raise ReplyError(
            f"public set mismatch: the reply's U has fingerprint {fingerprint!r}, the server's {exp.fingerprint!r}"
        )
    if arrays_in is not None:
        arrays = decode_arrays(arrays_in)
    elif not strict and protocol.ARRAYS in content:
        arrays = {}
        for k, v in protocol.record_values(content.array_records[protocol.ARRAYS]).items():
            arrays[k] = a = protocol.from_wire(v, np.float32)
            # finite as float32, the models' dtype (1e300 is finite only in float64)
            if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a.astype(np.float32))):
                raise ReplyError(f"array '{k}' has non-finite values (as float32)")
    else:
        arrays = None
    predictions = None
    if predictions_in is not None and exp is not None and exp.predictions is not None:
        predictions = {protocol.PREDICTION_ARRAY: decode_predictions(predictions_in, exp.predictions)}
    elif not strict and protocol.PREDICTIONS in content:
        predictions = protocol.record_values(content.array_records[protocol.PREDICTIONS])
    return ClientReply(
        node_id=int(msg.metadata.src_node_id),
        client_id=cid,
        num_examples=n,
        metrics=metrics,
        arrays=arrays,
        predictions=predictions,
        info=info,
        nbytes=protocol.record_nbytes(content),
        profile=read_profile(content),
    )
