"""Record and key names shared by the server and the generic client, message building, reply validation.

A message to a client carries:
  ``config``  (ConfigRecord) the operations to run in order (``ops``, names registered in
              :mod:`fedapps.client.clientops`), the round, and settings flattened as ``data.*``, ``model.*``,
              ``client.*``, ``train.*``, ``distill.*``, ``predict.*`` and the algorithms' own sections;
  ``arrays``  (ArrayRecord, optional) model parameters: loaded into the client's own model when
              ``load-arrays`` is true, or used apart by an operation (evaluated, trained, the anchor of a
              training term); with ``arrays.multi`` several models packed by :func:`pack_models`;
  ``targets`` (ArrayRecord, optional) encoded pseudo-labels on U for ``distill`` (+ optional row indices);
  ``eval-arrays`` (ArrayRecord, optional) a model sent for evaluation only (``evaluate-received``, architecture
              ``received.model``): its bytes are counted as evaluation traffic, apart from the algorithm's.
``return-arrays`` sends back the private model (or the model an operation chose to return) whole
(``arrays.keys: state``), parameters only (``params``) or without the head (``body``). ``train.freeze``
(head | body) keeps a part of the model fixed; a tagged ``train:<tag>`` op reads ``train:<tag>.*`` over
``train.*``; ``holdout-fraction`` keeps a fixed share of the training split out of training.
``arrays.transport: float16`` (``strategy.transport``): the floating arrays of ``arrays`` / ``eval-arrays`` travel
as float16, and the client returns its arrays the same way (:func:`encode_arrays`); each side casts them back to
its model's dtype on receipt. Without the key, arrays travel in their own dtype.
``persist-model`` (default true) keeps the client's model in ``Context.state`` after the message;
``save-model: false`` (evaluation-only messages) reads the kept model but does not write it back.
A reply carries ``metrics`` (MetricRecord: ``client-id``, ``num-examples``, evaluation results, timings),
and optionally ``arrays`` (the client's model) and ``predictions`` (encoded predictions on U) with ``info``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapps.config import TRANSPORTS

log = logging.getLogger("fedapps")

# record names
CONFIG = "config"
ARRAYS = "arrays"
TARGETS = "targets"
METRICS = "metrics"
PREDICTIONS = "predictions"
INFO = "info"
EVAL_ARRAYS = "eval-arrays"

# the public set U on the wire: settings of a message, array names in its records, the reply's info entry
PUBLIC_FINGERPRINT = "public.fingerprint"  # config: the fingerprint of the server's U (the client refuses another)
PREDICT_OUTPUT = "predict.output"  # config: probs | logits, what ``predict`` returns
PREDICT_ENCODING = "predict.encoding"  # config: float32 | float16 | hard, how ``predict`` encodes it
PREDICTION_ARRAY = "predictions"  # the array of the reply's predictions record
TARGET_ARRAY = "targets"  # the server's targets on U in the message's targets record
DISTILL_INDICES = "distill-indices"  # ... with the rows of U they are for (absent: all of U)
PREDICT_INDICES = "predict-indices"  # ... and the rows of U to predict on (absent: all of U)
INFO_FINGERPRINT = "fingerprint"  # the reply's info entry: the fingerprint of the client's U

# metric names every reply carries; an evaluation tagged <tag> reports <tag>-acc, <tag>-loss, <tag>-n, <tag>-correct
CLIENT_ID = "client-id"
NUM_EXAMPLES = "num-examples"
EVAL_FIELDS = ("acc", "loss", "n", "correct")
# the two evaluations of the deployed-model protocol (docs/evaluation.md, strategies.base): the model client i
# would deploy after a round (``deployed-acc`` ...), and its model right after local training (``after-acc`` ...)
DEPLOYED_TAG = "deployed"
AFTER_TAG = "after"
# the evaluation operations a message may name (``op`` or ``op:tag``) -> the tag their metrics carry when the message
# names none. Filled by fedapps.client.clientops.client_op as each ``evaluate*`` operation is registered (the worker's,
# and an algorithm's own from its module), so that the reply validator knows which metrics a message asks for without
# reaching up into the client's registry.
EVALUATION_TAGS: dict[str, str] = {}


def metric_name(tag: str, field: str) -> str:
    """The metric an operation tagged ``tag`` reports ``field`` in: ``metric_name('eval', 'acc') == 'eval-acc'``."""
    return f"{tag}-{field}"


def companion_tag(name: str) -> str:
    """The tag of a companion evaluation ``name`` of the deployed model's (another model of the same round, measured
    on the same messages, e.g. FedNH's generic model): ``companion_tag('generic') == 'deployed.generic'``."""
    return f"{DEPLOYED_TAG}.{name}"


def companion_name(tag: str) -> str | None:
    """``'deployed.generic'`` -> ``'generic'``; None for a tag that is not a companion evaluation's."""
    prefix = DEPLOYED_TAG + "."
    if not tag.startswith(prefix) or tag == prefix:
        return None
    return tag[len(prefix):]


# differential privacy (docs/privacy.md): the settings section a message carries while privacy.mode is on (absent:
# off), the metric in which every reply then reports its client's ε so far, and the words that open a client's
# refusal to train past privacy.epsilon_budget (its error reply's reason)
PRIVACY_SECTION = "privacy"
PRIVACY_EPSILON = "privacy-epsilon"
PRIVACY_REFUSED = "privacy budget exhausted"

MESSAGE_TYPE = "train"  # every round message is one Flower "train" message
EVAL_MESSAGE_TYPE = "evaluate"  # evaluation-only messages (the deployed models after the last round)
QUERY_MESSAGE_TYPE = "query"  # before round 1: describe the node's data, or identify which client a node is


def flatten(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """{'lr': 0.1} -> {'prefix.lr': 0.1}; None values are dropped (ConfigRecord has no null)."""
    return {f"{prefix}.{k}": v for k, v in values.items() if v is not None}


def section(config: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Inverse of :func:`flatten` for one prefix."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in config.items() if k.startswith(p)}


def build_message(
    node_id: int,
    server_round: int,
    ops: Iterable[str],
    config: Mapping[str, Any],
    arrays: ArrayRecord | None = None,
    targets: ArrayRecord | None = None,
    message_type: str = MESSAGE_TYPE,
    eval_arrays: ArrayRecord | None = None,
) -> Message:
    """One message for one node: operations, settings and optional arrays/targets/evaluation model."""
    cfg = ConfigRecord({"ops": [str(op) for op in ops], "round": int(server_round), **dict(config)})
    content = RecordDict({CONFIG: cfg})
    if arrays is not None:
        content[ARRAYS] = arrays
    if targets is not None:
        content[TARGETS] = targets
    if eval_arrays is not None:
        content[EVAL_ARRAYS] = eval_arrays
    return Message(content=content, dst_node_id=node_id, message_type=message_type, group_id=str(server_round))


# data-spec keys a message carries only when set (a spec without them means their defaults, see
# fedapps.data.SPEC_DEFAULTS); the server's own files (U: data.public_path, the node registry) never go to a client
CLIENT_SPEC_OPTIONAL = {"num_classes": 0, "input_shape": []}
SERVER_ONLY_SPEC_KEYS = ("public_path", "node_registry")


def data_spec_for_clients(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The data spec as messages carry it: without the server's own paths, and without the keys of data.source
    'nodes' while unset (so that messages of every other source stay as they were)."""
    return {k: v for k, v in spec.items()
            if k not in SERVER_ONLY_SPEC_KEYS and not (k in CLIENT_SPEC_OPTIONAL and v == CLIENT_SPEC_OPTIONAL[k])}


BOOKKEEPING_KEYS = frozenset({"state-dir", "state-run"})  # where a client keeps its state: not algorithm traffic


def eval_nbytes(content: RecordDict) -> int:
    """Bytes of the model a message carries for evaluation only (its ``eval-arrays`` record; 0 without)."""
    if EVAL_ARRAYS not in content:
        return 0
    return sum(len(a.data) for a in content[EVAL_ARRAYS].values())


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: array buffers plus an estimate for metrics/configs (bookkeeping keys,
    which depend on the run folder's path, are left out so that byte counts compare across folders)."""
    total = 0
    for rec in content.values():
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


class ReplyError(ValueError):
    """A reply that must not be used; the message says why."""


def parse_reply(msg: Message, expect_arrays: bool = False, expect_predictions: bool = False) -> ClientReply:
    """Validate a reply (error flag, keys, finite numbers) and unpack it; raise ReplyError if unusable."""
    if msg.has_error():
        raise ReplyError(f"client error {msg.error.code}: {msg.error.reason}")
    content = msg.content
    if METRICS not in content:
        raise ReplyError("reply without a 'metrics' record")
    metrics = dict(content[METRICS])
    for key in (CLIENT_ID, NUM_EXAMPLES):
        if key not in metrics:
            raise ReplyError(f"reply metrics lack '{key}'")
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ReplyError(f"metric '{key}' is not finite: {value}")
    num_examples = int(metrics[NUM_EXAMPLES])
    if num_examples < 0:
        raise ReplyError(f"negative num-examples {num_examples}")
    arrays = None
    if ARRAYS in content:
        arrays = {k: from_wire(v.numpy(), np.float32) for k, v in content[ARRAYS].items()}
        for k, a in arrays.items():  # finite as float32, the models' dtype (1e300 is finite only in float64)
            if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a.astype(np.float32))):
                raise ReplyError(f"array '{k}' has non-finite values (as float32)")
    elif expect_arrays:
        raise ReplyError("reply lacks the model arrays it was asked for")
    predictions = None
    if PREDICTIONS in content:
        predictions = {k: v.numpy() for k, v in content[PREDICTIONS].items()}
    elif expect_predictions:
        raise ReplyError("reply lacks the predictions it was asked for")
    info = dict(content[INFO]) if INFO in content else {}
    return ClientReply(
        node_id=msg.metadata.src_node_id,
        client_id=int(metrics[CLIENT_ID]),
        num_examples=num_examples,
        metrics=metrics,
        arrays=arrays,
        predictions=predictions,
        info=info,
        nbytes=record_nbytes(content),
    )


def parse_replies(
    replies: Iterable[Message], server_round: int, expect_arrays: bool = False, expect_predictions: bool = False
) -> list[ClientReply]:
    """Unpack every reply; drop (and log) the bad ones; never raise. The round loop uses the stricter
    :mod:`fedapps.wire.validation` (checked against what each message asked); this stays for direct callers."""
    good: list[ClientReply] = []
    for msg in replies:
        try:
            good.append(parse_reply(msg, expect_arrays, expect_predictions))
        except Exception as exc:  # noqa: BLE001 - a malformed reply of any kind is dropped, never a crash
            log.warning("round %d: dropped reply from node %s: %s", server_round, msg.metadata.src_node_id, exc)
    return good


def pack_models(models: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """K state dicts -> one dict with keys 'm<k>.<name>' (several models in one message, ``arrays.multi``)."""
    return {f"m{k}.{name}": value for k, model in enumerate(models) for name, value in model.items()}


def arrays_record(arrays: Mapping[str, np.ndarray], transport: str = "float32") -> ArrayRecord:
    """Named numpy arrays -> ArrayRecord (order kept, shapes kept: a 0-d array such as BatchNorm's
    ``num_batches_tracked`` stays 0-d; ``np.ascontiguousarray`` would make it shape (1,)), floating arrays
    encoded for ``transport`` (:func:`encode_arrays`; float32: as they are)."""
    return ArrayRecord({k: Array(contiguous(v)) for k, v in encode_arrays(arrays, transport).items()})


# ---------------------------------------------------------------------- compact transport (strategy.transport)
# A message whose model arrays travel compactly says so in its config (TRANSPORT_KEY); the client then returns
# its arrays the same way. float32: every array travels in its own dtype (no key is added: messages as before).
TRANSPORT_KEY = "arrays.transport"
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: beyond it a float16 cast gives inf


def check_transport(transport: str) -> None:
    """Refuse an unknown transport (a message from another version, or a typo in a direct call)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown array transport '{transport}'; allowed: {', '.join(TRANSPORTS)} "
                         "(config key strategy.transport)")


def encode_arrays(arrays: Mapping[str, np.ndarray], transport: str) -> dict[str, np.ndarray]:
    """Arrays as they travel: with ``float16`` every floating array wider than float16 is cast to float16;
    integer arrays (BatchNorm's ``num_batches_tracked``) are left alone. An array the cast would not keep
    finite (some |x| > 65504, or already non-finite) travels in its own dtype instead, with a warning naming
    it (the receiver's validation still rejects non-finite values). ``float32``: the arrays as they are."""
    check_transport(transport)
    if transport == "float32":
        return dict(arrays)
    out: dict[str, np.ndarray] = {}
    kept: list[str] = []
    for k, v in arrays.items():
        a = np.asarray(v)
        if a.dtype.kind == "f" and a.dtype.itemsize > 2:
            if a.size == 0 or (np.isfinite(a).all() and float(np.abs(a).max()) <= FLOAT16_MAX):
                a = a.astype(np.float16)
            else:
                kept.append(k)
        out[k] = a
    if kept:
        log.warning("transport float16: %d array(s) exceed float16's range (|x| > %g) or are not finite; sent in "
                    "their own dtype: %s", len(kept), FLOAT16_MAX, ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
    return out


def from_wire(value: np.ndarray, dtype: Any) -> np.ndarray:
    """A received array in the receiver's ``dtype``: a float16 array is cast up to a wider floating ``dtype`` (the
    model's); anything else is returned as it came."""
    a = np.asarray(value)
    target = np.dtype(dtype)
    if a.dtype == np.float16 and target.kind == "f" and target.itemsize > 2:
        return a.astype(target)
    return a


def transport_record(record: ArrayRecord, transport: str) -> ArrayRecord:
    """An ArrayRecord re-encoded for ``transport`` (the same record for float32)."""
    check_transport(transport)
    if transport == "float32":
        return record
    return arrays_record({k: v.numpy() for k, v in record.items()}, transport)


def contiguous(value: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape and dtype (0-d included)."""
    a = np.asarray(value)
    return a if a.flags.c_contiguous else a.copy(order="C")


def metrics_record(metrics: Mapping[str, Any]) -> MetricRecord:
    """Metrics dict -> MetricRecord (numpy scalars converted)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (list, tuple, np.ndarray)):
            vals = [x.item() if hasattr(x, "item") else x for x in v]
            out[k] = [float(x) for x in vals] if any(isinstance(x, float) for x in vals) else [int(x) for x in vals]
        elif isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        elif isinstance(v, (int, np.integer)):
            out[k] = int(v)
        else:
            out[k] = float(v)
    return MetricRecord(out)
