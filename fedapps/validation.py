"""Validation of untrusted client replies against what the server asked, in one place, before any strategy
sees them.

When the server builds a round's messages, :meth:`ReplyValidator.expect` records per node an
:class:`Expectation` read off the message itself: the model arrays asked for (``return-arrays`` with
``arrays.keys`` state | params | body → names, shapes and dtypes of the server's own model), the predictions
on U asked for (a ``predict`` op → rows, classes, ``predict.output`` and ``predict.encoding``), U's fingerprint
(``public.fingerprint``) and the evaluations the ops produce (every ``evaluate*`` op → ``<tag>-acc``,
``-loss``, ``-n``, ``-correct``). :meth:`ReplyValidator.check` then accepts a reply only if

- it is not an error reply, carries a ``metrics`` record and no record but metrics/arrays/predictions/info;
- every metric is a finite number or a list of finite numbers; ``client-id`` and ``num-examples`` are integers;
- ``client-id`` is in ``[0, data.num_clients)`` and belongs to this node (identity, below);
- ``num-examples`` is positive and not above the client's training-set size where the server knows it
  (simulation: it builds the federation); where it cannot (deployment), the first value a client reports is
  bound and a later different value is rejected;
- every evaluation asked for is complete, no other is present: accuracy in [0, 1], loss finite and >= 0,
  counts integral and >= 0, ``correct <= n``, ``n`` <= the client's test-set size where known, and the
  accuracy equals ``correct / n``;
- arrays: exactly the expected names and shapes, a floating dtype where the model's is floating (an
  integer dtype only where the model has an integer buffer of that shape), all decodable and finite; float16
  arrays (``strategy.transport: float16``) are then cast up to the model's dtype;
- predictions: decodable, of the expected shape; probabilities on the simplex (entries >= -1e-3, rows summing
  to 1 within 1e-2), logits within ``|x| <= 1e4``, hard labels of an unsigned type and in [0, classes);
- U's fingerprint (``info["fingerprint"]``) equals the server's wherever the message named one;
- it is the node's only reply in this round's phase, to a message the server sent it.

Identity is bound to the node: the node ↔ client-id pairing is fixed on the first accepted reply. A reply
claiming an id bound to another node, a node changing its id, or an id no node has yet but that several
nodes claim in the same batch, is rejected; so no reply can touch another client's state. (A node that
claims a free id on first contact before its owner ever replies does get it: the server has no other
source of identity in deployment. docs/reliability.md says so.)

ANY exception while validating a reply becomes a rejection with its reason; :meth:`check` never raises.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedapps import protocol
from fedapps.protocol import ClientReply, ReplyError

log = logging.getLogger("fedapps")

PROB_TOLERANCE = 1e-2  # |row sum − 1| of probability predictions (float16 on the wire rounds to ~1e-3)
PROB_NEGATIVE = 1e-3  # smallest entry allowed in a probability row: −this
LOGIT_BOUND = 1e4  # |logit| above this is no model's output: it would take over a mean consensus
ACC_TOLERANCE = 1e-6  # |acc − correct/n|
RECORDS = (protocol.METRICS, protocol.ARRAYS, protocol.PREDICTIONS, protocol.INFO)


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


@dataclass
class Rejection:
    """A reply not used, and why (a row of rejections.csv)."""

    round: int
    phase: str
    node_id: int | None
    client_id: int | None
    reason: str

    def row(self) -> dict[str, Any]:
        return {"round": self.round, "phase": self.phase, "node_id": "" if self.node_id is None else self.node_id,
                "client_id": "" if self.client_id is None else self.client_id, "reason": self.reason}


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
        names = [m.group(1) for m in _EXCEPTION_LINE.finditer(text) if first and m.group(2).startswith(first)
                 and not m.group(1).endswith("ClientAppException")]
        return f"{names[0].rsplit('.', 1)[-1]}: {message}" if names else message
    match = _CLASS_FORMAT.match(text)
    if match:
        return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
    return text


# --------------------------------------------------------------------------- expectations from messages


def eval_tags_of(ops: Iterable[str]) -> tuple[str, ...]:
    """The evaluation tags the ops produce: every ``evaluate*`` op (tagged ``op:tag`` or its default tag)."""
    from fedapps.clientops import OPERATIONS  # registry of the ops (core module)

    tags: list[str] = []
    for op in ops:
        base, _, tag = str(op).partition(":")
        if not base.startswith("evaluate"):
            continue
        found = OPERATIONS.get(base)
        tag = tag or (found.default_tag if found is not None else base)
        if tag not in tags:
            tags.append(tag)
    return tuple(tags)


def expectation_for(msg: Message, model_part: Callable[[str], Mapping[str, np.ndarray]] | None,
                    public_size: int | None, num_classes: int | None) -> Expectation:
    """What ``msg`` asks its node for (see the module docstring)."""
    config = dict(msg.content[protocol.CONFIG])
    ops = [str(o) for o in config.get("ops", [])]
    exp = Expectation(node_id=int(msg.metadata.dst_node_id), phase=str(msg.metadata.message_type),
                      fingerprint=config.get("public.fingerprint"), eval_tags=eval_tags_of(ops))
    if config.get("return-arrays", False):
        part = str(config.get("arrays.keys", "state"))
        if model_part is not None:
            exp.arrays = {k: ArraySpec(tuple(np.shape(v)), np.asarray(v).dtype) for k, v in model_part(part).items()}
    if any(o.partition(":")[0] == "predict" for o in ops):
        rows = public_size
        targets = msg.content.get(protocol.TARGETS) if protocol.TARGETS in msg.content else None
        if targets is not None and "predict-indices" in targets:
            rows = int(targets["predict-indices"].numpy().shape[0])
        exp.predictions = PredictionSpec(rows=rows, classes=int(num_classes or 0),
                                         output=str(config.get("predict.output", "probs")),
                                         encoding=str(config.get("predict.encoding", "float32")))
    return exp


# --------------------------------------------------------------------------- checks of one reply


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _integral(key: str, v: Any) -> int:
    if not _is_number(v) or not math.isfinite(float(v)) or float(v) != int(float(v)):
        raise ReplyError(f"metric '{key}' must be a whole number, got {v!r}")
    return int(float(v))


def check_metrics(metrics: Mapping[str, Any]) -> None:
    """Every metric a finite number or a list of finite numbers."""
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not _is_number(v):
                raise ReplyError(f"metric '{key}' must be a number or a list of numbers, got {type(v).__name__}")
            if not math.isfinite(float(v)):
                raise ReplyError(f"metric '{key}' is not finite: {value!r}")


def check_evaluations(metrics: Mapping[str, Any], expected: Iterable[str], test_size: int | None) -> None:
    """The evaluations asked for are complete and plausible; no other evaluation is reported."""
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
        if n > 0 and abs(acc - correct / n) > ACC_TOLERANCE:
            raise ReplyError(f"metric '{names['acc']}' = {acc} disagrees with correct/n = {correct}/{n}")


def decode_record(record: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(record, ArrayRecord):
        raise ReplyError(f"'{what}' must be an ArrayRecord, got {type(record).__name__}")
    out: dict[str, np.ndarray] = {}
    for k, v in record.items():
        try:
            out[k] = np.asarray(v.numpy())
        except Exception as exc:  # noqa: BLE001 - undecodable bytes of any kind
            raise ReplyError(f"{what} '{k}' cannot be decoded: {type(exc).__name__}: {exc}") from exc
    return out


def check_arrays(arrays: Mapping[str, np.ndarray], expected: Mapping[str, ArraySpec]) -> None:
    """Exactly the expected names and shapes, floating where the model is floating, finite."""
    if set(arrays) != set(expected):
        missing, unknown = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        raise ReplyError(f"arrays do not match the model: missing {missing[:3]}, unknown {unknown[:3]}")
    for k, spec in expected.items():
        a = arrays[k]
        if tuple(a.shape) != tuple(spec.shape):
            raise ReplyError(f"array '{k}' has shape {tuple(a.shape)}, expected {tuple(spec.shape)}")
        if np.issubdtype(spec.dtype, np.floating):
            if not np.issubdtype(a.dtype, np.floating):
                raise ReplyError(f"array '{k}' has dtype {a.dtype}, expected a floating dtype ({spec.dtype})")
            if not np.all(np.isfinite(a)):
                raise ReplyError(f"array '{k}' has non-finite values")
        elif a.dtype.kind != spec.dtype.kind:
            raise ReplyError(f"array '{k}' has dtype {a.dtype}, expected {spec.dtype}")


def prediction_problem(wire: np.ndarray, spec: PredictionSpec) -> str | None:
    """Why a prediction array does not answer ``spec`` (None if it does)."""
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


class ReplyValidator:
    """Checks each reply against the expectation recorded when its message was built; binds identities.

    ``train_sizes`` / ``test_sizes`` (per client id) are the bounds of ``num-examples`` / ``<tag>-n`` where the
    server knows them (simulation); None in deployment (then ``num-examples`` is bound on first report).
    ``model_part(part)`` gives the server's model arrays for 'state' | 'params' | 'body'.
    """

    def __init__(self, num_clients: int, train_sizes: Iterable[int] | None = None,
                 test_sizes: Iterable[int] | None = None,
                 model_part: Callable[[str], Mapping[str, np.ndarray]] | None = None,
                 public_size: int | None = None, num_classes: int | None = None) -> None:
        self.num_clients = int(num_clients)
        self.train_sizes = None if train_sizes is None else [int(v) for v in train_sizes]
        self.test_sizes = None if test_sizes is None else [int(v) for v in test_sizes]
        self._model_part = model_part
        self._parts: dict[str, dict[str, np.ndarray]] = {}
        self.public_size = public_size
        self.num_classes = num_classes
        self.expected: dict[str, dict[int, Expectation]] = {}  # phase -> node -> expectation
        self.node_client: dict[int, int] = {}  # bound on first accepted reply
        self.client_node: dict[int, int] = {}
        self.bound_examples: dict[int, int] = {}  # deployment: num-examples first reported per client

    @classmethod
    def from_config(cls, cfg: Any) -> "ReplyValidator":
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
            log.info("reply validation: client data sizes unknown to the server (%s); num-examples is bound on "
                     "first report", exc)

        def model_part(part: str) -> dict[str, np.ndarray]:
            model = build_model(cfg.model.name, num_classes, shape, seed=cfg.seed)
            return {k: v.detach().cpu().numpy() for k, v in state_part(model, part).items()}

        return cls(d.num_clients, train, test, model_part, public_size, num_classes)

    def model_part(self, part: str) -> dict[str, np.ndarray] | None:
        if self._model_part is None:
            return None
        if part not in self._parts:
            self._parts[part] = dict(self._model_part(part))
        return self._parts[part]

    # ------------------------------------------------------------------ expectations
    def expect(self, messages: Iterable[Message]) -> None:
        """Record what each message asks its node for (replaces the previous expectations of that phase)."""
        by_phase: dict[str, dict[int, Expectation]] = {}
        for msg in messages:
            exp = expectation_for(msg, self.model_part if self._model_part is not None else None,
                                  self.public_size, self.num_classes)
            by_phase.setdefault(exp.phase, {})[exp.node_id] = exp
        for phase, table in by_phase.items():
            self.expected[phase] = table

    # ------------------------------------------------------------------ one reply
    def parse(self, msg: Message, exp: Expectation) -> ClientReply:
        """The reply unpacked if it answers ``exp`` (identity is checked per batch); ReplyError otherwise."""
        if msg.has_error():
            raise ReplyError(f"client error {msg.error.code}: {error_reason(str(msg.error.reason))}")
        content = msg.content
        unknown = [k for k in content.keys() if k not in RECORDS]
        if unknown:
            raise ReplyError(f"unexpected record(s) {unknown}")
        if protocol.METRICS not in content or not isinstance(content[protocol.METRICS], MetricRecord):
            raise ReplyError("reply without a 'metrics' record")
        metrics = dict(content[protocol.METRICS])
        for key in (protocol.CLIENT_ID, protocol.NUM_EXAMPLES):
            if key not in metrics:
                raise ReplyError(f"reply metrics lack '{key}'")
            if not _is_int(metrics[key]):
                raise ReplyError(f"metric '{key}' must be an integer, got {metrics[key]!r}")
        check_metrics(metrics)
        cid, n = int(metrics[protocol.CLIENT_ID]), int(metrics[protocol.NUM_EXAMPLES])
        if not 0 <= cid < self.num_clients:
            raise ReplyError(f"client-id {cid} is outside the federation [0, {self.num_clients})")
        if n <= 0:
            raise ReplyError(f"num-examples {n} is not a positive integer")
        if self.train_sizes is not None and n > self.train_sizes[cid]:
            raise ReplyError(f"num-examples {n} exceeds client {cid}'s training-set size {self.train_sizes[cid]}")
        if self.train_sizes is None and cid in self.bound_examples and n != self.bound_examples[cid]:
            raise ReplyError(f"num-examples {n} differs from the {self.bound_examples[cid]} client {cid} first reported")
        check_evaluations(metrics, exp.eval_tags, None if self.test_sizes is None else self.test_sizes[cid])
        info: dict[str, Any] = {}
        if protocol.INFO in content:
            if not isinstance(content[protocol.INFO], ConfigRecord):
                raise ReplyError("'info' must be a ConfigRecord")
            info = dict(content[protocol.INFO])
        if exp.fingerprint is not None and info.get("fingerprint") != exp.fingerprint:
            raise ReplyError(f"public set mismatch: the reply's U has fingerprint {info.get('fingerprint')!r}, "
                             f"the server's {exp.fingerprint!r}")
        arrays = None
        if protocol.ARRAYS in content:
            if exp.arrays is None:
                raise ReplyError("reply carries model arrays that were not asked for")
            arrays = decode_record(content[protocol.ARRAYS], "array")
            check_arrays(arrays, exp.arrays)
            # float16 on the wire (strategy.transport) -> the server model's dtype before any strategy sees it
            arrays = {k: protocol.from_wire(a, exp.arrays[k].dtype) for k, a in arrays.items()}
        elif exp.arrays is not None:
            raise ReplyError("reply lacks the model arrays it was asked for")
        predictions = None
        if protocol.PREDICTIONS in content:
            if exp.predictions is None:
                raise ReplyError("reply carries predictions that were not asked for")
            predictions = decode_record(content[protocol.PREDICTIONS], "prediction")
            if set(predictions) != {"predictions"}:
                raise ReplyError(f"predictions record must hold exactly 'predictions', got {sorted(predictions)}")
            problem = prediction_problem(predictions["predictions"], exp.predictions)
            if problem:
                raise ReplyError(f"predictions unusable: {problem}")
        elif exp.predictions is not None:
            raise ReplyError("reply lacks the predictions it was asked for")
        return ClientReply(node_id=int(msg.metadata.src_node_id), client_id=cid, num_examples=n, metrics=metrics,
                           arrays=arrays, predictions=predictions, info=info, nbytes=protocol.record_nbytes(content))

    # ------------------------------------------------------------------ a batch
    def check(self, server_round: int, replies: Iterable[Message], phase: str | None = None) -> Outcome:
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
                reject(r.node_id, r.client_id, ph, f"node is bound to client {bound} but claims client-id {r.client_id}")
            elif owner is not None and owner != r.node_id:
                reject(r.node_id, r.client_id, ph, f"client-id {r.client_id} is bound to node {owner}")
            elif owner is None and len(claims[r.client_id]) > 1:
                reject(r.node_id, r.client_id, ph, f"client-id {r.client_id} is claimed by several nodes at once")
            else:
                self.node_client[r.node_id] = r.client_id
                self.client_node[r.client_id] = r.node_id
                if self.train_sizes is None:
                    self.bound_examples.setdefault(r.client_id, r.num_examples)
                out.accepted.append(r)
        for ph in phases or {phase or protocol.MESSAGE_TYPE}:
            asked = self.expected.get(ph, {})
            out.missing += sum(1 for n in asked if n not in seen)
        return out
