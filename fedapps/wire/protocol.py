"""The message schema: every record, key and metric name of the wire, spelled here and nowhere else; a dataclass
per part of a message and per reply, encoded to and decoded from Flower's records here only; reply parsing; the
compact array transport.

A message to a client (:class:`Request`, its ``config`` ConfigRecord, plus records) says
  which operations to run   ``ops`` (names registered in :mod:`fedapps.client.clientops`, ``name:tag``) and ``round``;
  what every client needs   :class:`Setup`: the data spec ``data.*``, the model ``model.*``, the client's training
                            defaults ``client.*`` (clients need no config file);
  what to load              :class:`Load`: the ``arrays`` record (model parameters) is loaded into the client's own
                            model (``load-arrays``) or used apart by an operation (evaluated, trained, the anchor of a
                            training term); with ``arrays.multi`` it holds several models packed by :func:`pack_models`;
  whether the model is kept :class:`Keep`: ``persist-model`` (default yes) keeps the client's model in
                            ``Context.state`` after the message; ``save-model: false`` (evaluation-only messages) reads
                            the kept model but does not write it back;
  what to return            :class:`Return`: ``return-arrays`` sends back the private model (or the model an operation
                            chose to return) whole (``arrays.keys: state``), parameters only (``params``) or without
                            the head (``body``);
  how arrays travel         ``arrays.transport: float16`` (``strategy.transport``): the floating arrays of ``arrays`` /
                            ``eval-arrays`` travel as float16, and the client returns its arrays the same way
                            (:func:`encode_arrays`); each side casts them back to its model's dtype on receipt. Without
                            the key, arrays travel in their own dtype;
  what to evaluate          :class:`Evaluation`: the ``eval-arrays`` record holds a model sent for evaluation only
                            (``evaluate-received``, architecture ``received.model``), its bytes counted as evaluation
                            traffic apart from the algorithm's; WHEN each evaluation runs is its place in ``ops``;
  training settings         :class:`Training`: ``holdout-fraction`` keeps a fixed share of the training split out of
                            training; one :class:`Section` per operation section (``train.*``, ``distill.*``, a tagged
                            ``train:<tag>.*`` read over ``train.*``, an algorithm's own): optimiser overrides of
                            ``client.*``, ``train.freeze`` (head | body), ``distill.loss`` / ``.weighting``, and the
                            algorithms' own settings (``extra``, named by constants of the module that reads them);
  public-set settings       :class:`PublicSet`: ``public.fingerprint`` (the client refuses another U),
                            ``predict.output`` and ``predict.encoding``; the ``targets`` record (:class:`Targets`):
                            encoded pseudo-labels on U for ``distill``, optional row indices of U;
  bookkeeping               :class:`Bookkeeping`: ``state-dir`` / ``state-run``, where a client keeps its state (not
                            algorithm traffic: left out of the byte counts).
  differential privacy      :class:`Privacy`: ``privacy.*`` (docs/privacy.md), sent only under mode sample:
                            the client's training on its data runs as DP-SGD.
A reply (:class:`Reply` on the client, :class:`ClientReply` once parsed on the server) carries ``metrics``
(MetricRecord: ``client-id``, ``num-examples``, evaluation results, timings ``t-<tag>`` and ``t-total``, and
while privacy is on the client's ε so far, ``privacy-epsilon``), and
optionally ``arrays`` (the client's model) and ``predictions`` (encoded predictions on U), with ``info``
(:class:`ReplyInfo`: the client's architecture and U's fingerprint) and ``profile`` (:class:`MessageProfile`: where the
client's time on the message went, left out of the byte counts).

Unset fields (None) are not sent: a message carries exactly the keys its builder set, so that messages, byte counts
and results stay as they were whatever a default is. :meth:`Request.decode` refuses a malformed message with a
:class:`MessageError` naming the key.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedapps.config import CLIENT_SIDE_PRIVACY_MODES, TRANSPORTS

log = logging.getLogger("fedapps")

# record names
CONFIG = "config"
ARRAYS = "arrays"
TARGETS = "targets"
METRICS = "metrics"
PREDICTIONS = "predictions"
INFO = "info"
EVAL_ARRAYS = "eval-arrays"

# the settings of a message (its config record): fixed keys ...
OPS = "ops"  # the operations, in order
ROUND = "round"  # the server round
LOAD_ARRAYS = "load-arrays"  # Load.into_model
ARRAYS_MULTI = "arrays.multi"  # Load.multi
PERSIST_MODEL = "persist-model"  # Keep.persist
SAVE_MODEL = "save-model"  # Keep.save
RETURN_ARRAYS = "return-arrays"  # Return.arrays
ARRAYS_KEYS = "arrays.keys"  # Return.part
TRANSPORT_KEY = "arrays.transport"  # Request.transport
HOLDOUT_FRACTION = "holdout-fraction"  # Training.holdout_fraction
RECEIVED_MODEL = "received.model"  # Evaluation.received_model
STATE_DIR = "state-dir"  # Bookkeeping.state_dir
STATE_RUN = "state-run"  # Bookkeeping.state_run
MODEL_NAME = "model.name"  # ModelSpec.name
MODEL_SEED = "model.seed"  # ModelSpec.seed
MODEL_PER_CLIENT = "model.per_client"  # ModelSpec.per_client
# differential privacy (docs/privacy.md): the settings a message carries while privacy.mode is on (absent: off)
PRIVACY_MODE = "privacy.mode"  # Privacy.mode
PRIVACY_NOISE_MULTIPLIER = "privacy.noise_multiplier"  # Privacy.noise_multiplier
PRIVACY_MAX_GRAD_NORM = "privacy.max_grad_norm"  # Privacy.max_grad_norm
PRIVACY_DELTA = "privacy.delta"  # Privacy.delta
PRIVACY_EPSILON_BUDGET = "privacy.epsilon_budget"  # Privacy.epsilon_budget
PRIVACY_REPRODUCIBLE_NOISE = "privacy.reproducible_noise"  # Privacy.reproducible_noise
# the public set U on the wire: settings of a message, array names in its records, the reply's info entry
PUBLIC_FINGERPRINT = "public.fingerprint"  # config: the fingerprint of the server's U (the client refuses another)
PREDICT_OUTPUT = "predict.output"  # config: probs | logits, what ``predict`` returns
PREDICT_ENCODING = "predict.encoding"  # config: float32 | float16 | hard, how ``predict`` encodes it
PREDICTION_ARRAY = "predictions"  # the array of the reply's predictions record
TARGET_ARRAY = "targets"  # the server's targets on U in the message's targets record
DISTILL_INDICES = "distill-indices"  # ... with the rows of U they are for (absent: all of U)
PREDICT_INDICES = "predict-indices"  # ... and the rows of U to predict on (absent: all of U)
INFO_FINGERPRINT = "fingerprint"  # the reply's info entry: the fingerprint of the client's U
INFO_ARCH = "arch"  # ... and the architecture of the client's model

# ... and sections: ``<section>.<name>`` keys. data.* / client.* are the config's sections as they are; the
# operation sections (Training.sections) hold a Section each
DATA_SECTION = "data"
CLIENT_SECTION = "client"
TRAIN = "train"  # the settings of ``train`` (and the base of every tagged ``train:<tag>`` section)
DISTILL = "distill"  # the settings of ``distill``

# metric names every reply carries; an evaluation tagged <tag> reports <tag>-acc, <tag>-loss, <tag>-n, <tag>-correct
CLIENT_ID = "client-id"
NUM_EXAMPLES = "num-examples"
TOTAL_TIME = "t-total"  # seconds from the message's arrival to its reply
TIMING_PREFIX = "t-"  # t-<tag>: seconds of the operation tagged <tag>
PRIVACY_EPSILON = "privacy-epsilon"  # while privacy is on: the client's ε so far (at privacy.delta), in every reply
# the reply's ``profile`` record (:class:`MessageProfile`): where the client's time on the message went, in seconds
# per phase (measurement of the client's machine, not algorithm traffic: left out of the byte counts)
PROFILE = "profile"
PROFILE_DECODING = "decoding-seconds"  # the message's settings, arrays and targets decoded
PROFILE_DATA = "data-seconds"  # the client's data looked up (and, once per process, loaded and partitioned)
PROFILE_MODEL = "model-seconds"  # the private model restored (built or reused) and the received arrays loaded into it
PROFILE_TRAIN = "train-seconds"  # the training loops (train, distill)
PROFILE_EVALUATE = "evaluate-seconds"  # the evaluations
PROFILE_PREDICT = "predict-seconds"  # predictions on U
PROFILE_OTHER = "other-seconds"  # the rest of the operations' time (an algorithm's own steps between the loops)
PROFILE_KEEP = "keep-seconds"  # the private model kept for the next round (Context.state, the state directory)
PROFILE_ENCODING = "encoding-seconds"  # the reply's arrays and records encoded
PROFILE_WALL = "wall-seconds"  # from the message's arrival at the worker to its reply encoded (>= the phases' sum)
# the words that open a client's refusal to train past privacy.epsilon_budget (its error reply's reason): the
# server's records count the refusals by them
PRIVACY_REFUSED = "privacy budget exhausted"
EVAL_FIELDS = ("acc", "loss", "n", "correct")
# the two evaluations of the deployed-model protocol (docs/evaluation.md, fedapps.server.evaluation): the model client i
# would deploy after a round (``deployed-acc`` ...), and its model right after local training (``after-acc`` ...)
DEPLOYED_TAG = "deployed"
AFTER_TAG = "after"
# the evaluation operations a message may name (``op`` or ``op:tag``) -> the tag their metrics carry when the message
# names none. Filled by fedapps.client.clientops.client_op as each ``evaluate*`` operation is registered (the worker's,
# and an algorithm's own from its module), so that the reply validator knows which metrics a message asks for without
# reaching up into the client's registry.
EVALUATION_TAGS: dict[str, str] = {}

# every key of the wire (record, setting, array, metric and info names): tests/test_architecture.py checks that no
# other module spells one
KEYS = (
    CONFIG,
    ARRAYS,
    TARGETS,
    METRICS,
    PREDICTIONS,
    INFO,
    EVAL_ARRAYS,
    OPS,
    ROUND,
    LOAD_ARRAYS,
    ARRAYS_MULTI,
    PERSIST_MODEL,
    SAVE_MODEL,
    RETURN_ARRAYS,
    ARRAYS_KEYS,
    TRANSPORT_KEY,
    HOLDOUT_FRACTION,
    RECEIVED_MODEL,
    STATE_DIR,
    STATE_RUN,
    MODEL_NAME,
    MODEL_SEED,
    MODEL_PER_CLIENT,
    PUBLIC_FINGERPRINT,
    PREDICT_OUTPUT,
    PREDICT_ENCODING,
    PREDICTION_ARRAY,
    TARGET_ARRAY,
    DISTILL_INDICES,
    PREDICT_INDICES,
    INFO_FINGERPRINT,
    INFO_ARCH,
    CLIENT_ID,
    NUM_EXAMPLES,
    TOTAL_TIME,
    PRIVACY_MODE,
    PRIVACY_NOISE_MULTIPLIER,
    PRIVACY_MAX_GRAD_NORM,
    PRIVACY_DELTA,
    PRIVACY_EPSILON_BUDGET,
    PRIVACY_REPRODUCIBLE_NOISE,
    PRIVACY_EPSILON,
    PROFILE,
    PROFILE_DECODING,
    PROFILE_DATA,
    PROFILE_MODEL,
    PROFILE_TRAIN,
    PROFILE_EVALUATE,
    PROFILE_PREDICT,
    PROFILE_OTHER,
    PROFILE_KEEP,
    PROFILE_ENCODING,
    PROFILE_WALL,
)


def metric_name(tag: str, field: str) -> str:
    """The metric an operation tagged ``tag`` reports ``field`` in: ``metric_name('eval', 'acc') == 'eval-acc'``."""
    return f"{tag}-{field}"


def timing_name(tag: str) -> str:
    """The metric holding the seconds of the operation tagged ``tag``: ``timing_name('train') == 't-train'``."""
    return f"{TIMING_PREFIX}{tag}"


def companion_tag(name: str) -> str:
    """The tag of a companion evaluation ``name`` of the deployed model's (another model of the same round, measured
    on the same messages, e.g. FedNH's generic model): ``companion_tag('generic') == 'deployed.generic'``."""
    return f"{DEPLOYED_TAG}.{name}"


def companion_name(tag: str) -> str | None:
    """``'deployed.generic'`` -> ``'generic'``; None for a tag that is not a companion evaluation's."""
    prefix = DEPLOYED_TAG + "."
    if not tag.startswith(prefix) or tag == prefix:
        return None
    return tag[len(prefix) :]


def train_section(tag: str) -> str:
    """The settings section of the tagged training ``train:<tag>`` (read over ``train.*``)."""
    return f"{TRAIN}:{tag}"


MESSAGE_TYPE = "train"  # every round message is one Flower "train" message
EVAL_MESSAGE_TYPE = "evaluate"  # evaluation-only messages (the deployed models after the last round)
QUERY_MESSAGE_TYPE = "query"  # before round 1: describe the node's data, or identify which client a node is


def flatten(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """{'lr': 0.1} -> {'prefix.lr': 0.1}; None values are dropped (ConfigRecord has no null)."""
    return {f"{prefix}.{k}": v for k, v in values.items() if v is not None}


# data-spec keys a message carries only when set (a spec without them means their defaults, see
# fedapps.data.SPEC_DEFAULTS); the server's own files (U: data.public_path, the node registry) never go to a client
CLIENT_SPEC_OPTIONAL = {"num_classes": 0, "input_shape": []}
SERVER_ONLY_SPEC_KEYS = ("public_path", "node_registry")


def data_spec_for_clients(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The data spec as messages carry it: without the server's own paths, and without the keys of data.source
    'nodes' while unset (so that messages of every other source stay as they were)."""
    return {
        k: v
        for k, v in spec.items()
        if k not in SERVER_ONLY_SPEC_KEYS and not (k in CLIENT_SPEC_OPTIONAL and v == CLIENT_SPEC_OPTIONAL[k])
    }


# ====================================================================== the message: one dataclass per part


class MessageError(ValueError):
    """A message (or one of its records) that does not follow the schema; the text names the key and the problem."""


@dataclass(frozen=True)
class ModelSpec:
    """The client's model (``model.*``): its architecture, the seed of its initialisation, and (model-agnostic
    strategies) one architecture per client, client i taking entry i mod len. None / empty: not sent."""

    name: str | None = None
    seed: int | None = None
    per_client: tuple[str, ...] = ()


@dataclass(frozen=True)
class Setup:
    """What every message carries so that a client needs no config file: the data spec (``data.*``, as
    :func:`data_spec_for_clients` leaves it), the model (``model.*``) and the client's training defaults and device
    (``client.*``: the fields of :class:`fedapps.config.ClientConfig`)."""

    data: Mapping[str, Any] = field(default_factory=dict)
    model: ModelSpec = ModelSpec()
    client: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    """What the message's ``arrays`` record is for: loaded into the client's own model (``load-arrays``; else an
    operation uses it apart), and whether it packs several models (``arrays.multi``). None: not sent (= no)."""

    into_model: bool | None = None
    multi: bool | None = None


@dataclass(frozen=True)
class Keep:
    """Whether the client keeps its private model: ``persist-model`` (read the kept model and keep it afterwards)
    and ``save-model`` (write it back; an evaluation-only message reads it only). None: not sent (= yes)."""

    persist: bool | None = None
    save: bool | None = None

    @property
    def persists(self) -> bool:
        return self.persist is not False

    @property
    def saves(self) -> bool:
        return self.persists and self.save is not False


@dataclass(frozen=True)
class Return:
    """What goes back besides the metrics: the model's arrays (``return-arrays``; None: not sent = no) and which
    part of it (``arrays.keys``: state | params | body, see :func:`fedapps.models.state_part`; None: state)."""

    arrays: bool | None = None
    part: str | None = None

    @property
    def which(self) -> str:
        return self.part or "state"


@dataclass(frozen=True)
class Evaluation:
    """What an ``evaluate-received`` operation evaluates: the ``eval-arrays`` record's model, of architecture
    ``received.model`` (None: not sent, the client's own architecture)."""

    received_model: str | None = None


# Section's optimiser fields: fedapps.config.OptimSettings's (tests check that the two agree)
OPTIMISER_FIELDS = (
    "epochs",
    "batch_size",
    "lr",
    "optimizer",
    "momentum",
    "weight_decay",
    "drop_last",
    "clip_norm",
    "mixed_precision",
)


@dataclass(frozen=True)
class Section:
    """The settings of one operation section ``<section>.*`` (``train``, ``distill``, ``train:<tag>``, an
    algorithm's own): overrides of the ``client.*`` optimiser settings (None: the client's), the generic operations'
    own settings (``freeze``: head | body | none for ``train``; ``loss`` and ``weighting`` for ``distill``), and
    ``extra``: settings read by an algorithm's registered client code, named by constants of its module."""

    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    optimizer: str | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    drop_last: bool | None = None
    clip_norm: float | None = None
    mixed_precision: bool | None = None
    freeze: str | None = None
    loss: str | None = None
    weighting: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def optimiser(self) -> dict[str, Any]:
        """The optimiser settings this section overrides (those set)."""
        return {k: getattr(self, k) for k in OPTIMISER_FIELDS if getattr(self, k) is not None}

    def over(self, base: Section) -> Section:
        """This section's settings over ``base``'s (a tagged ``train:<tag>`` section over ``train``)."""
        changes = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extra" and getattr(self, f.name) is not None
        }
        return dataclasses.replace(base, **changes, extra={**base.extra, **self.extra})


@dataclass(frozen=True)
class Training:
    """Training settings: ``holdout-fraction`` (a fixed share of the training split kept out of training, for the
    operations that score on it; None: not sent = 0) and the operation sections by name."""

    holdout_fraction: float | None = None
    sections: Mapping[str, Section] = field(default_factory=dict)

    def section(self, name: str) -> Section:
        """The settings of section ``name`` (an empty Section when the message has none)."""
        return self.sections.get(name, Section())


@dataclass(frozen=True)
class PublicSet:
    """The public set U: its fingerprint (the client refuses another U), and what ``predict`` returns (``output``:
    probs | logits) and how it encodes it (``encoding``: float32 | float16 | hard). None: not sent."""

    fingerprint: str | None = None
    output: str | None = None
    encoding: str | None = None

    @property
    def predict_output(self) -> str:
        return self.output or "probs"

    @property
    def predict_encoding(self) -> str:
        return self.encoding or "float32"


@dataclass(frozen=True)
class Bookkeeping:
    """Where a client keeps its private model on disk across a resumption (see :mod:`fedapps.client.worker`): the
    run folder's ``state-dir`` and the run's token ``state-run``. None: not sent (the client keeps it in memory)."""

    state_dir: str | None = None
    state_run: str | None = None


@dataclass(frozen=True)
class Privacy:
    """Sample-level differential privacy of the client's training (``privacy.*``, docs/privacy.md; the fields of the
    server's :class:`fedapps.config.PrivacyConfig` that DP-SGD reads): sent, all of them, only under mode ``sample``
    (the server's client-level mode ``client`` sends none), so that a message without it trains as it always did.
    ``mode`` (sample), σ = ``noise_multiplier`` > 0, C = ``max_grad_norm`` > 0,
    ``delta`` in (0, 1), ``epsilon_budget`` (0: none), ``reproducible_noise`` (noise drawn from the run's seed)."""

    mode: str
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    epsilon_budget: float = 0.0
    reproducible_noise: bool = False

    def encode(self) -> dict[str, Any]:
        """The ``privacy.*`` settings."""
        return {
            PRIVACY_MODE: self.mode,
            PRIVACY_NOISE_MULTIPLIER: self.noise_multiplier,
            PRIVACY_MAX_GRAD_NORM: self.max_grad_norm,
            PRIVACY_DELTA: self.delta,
            PRIVACY_EPSILON_BUDGET: self.epsilon_budget,
            PRIVACY_REPRODUCIBLE_NOISE: self.reproducible_noise,
        }

    @classmethod
    def decode(cls, fixed: Mapping[str, Any]) -> Privacy | None:
        """The privacy settings among a message's typed fixed settings (None: the message has none); MessageError for
        settings without ``privacy.mode`` or a required value, a mode other than sample, values out of range."""
        present = [k for k in _PRIVACY_TYPES if k in fixed]
        if not present:
            return None
        mode = fixed.get(PRIVACY_MODE)
        if mode is None:
            raise MessageError(f"the message has '{present[0]}' but no '{PRIVACY_MODE}'")
        if mode not in CLIENT_SIDE_PRIVACY_MODES:
            raise MessageError(
                f"'{PRIVACY_MODE}' must be one of {', '.join(CLIENT_SIDE_PRIVACY_MODES)} (a message carries "
                f"privacy settings only while a mode the clients apply is on), got {_short(mode)}"
            )
        lacking = [k for k in (PRIVACY_NOISE_MULTIPLIER, PRIVACY_MAX_GRAD_NORM, PRIVACY_DELTA) if k not in fixed]
        if lacking:
            raise MessageError(f"'{PRIVACY_MODE}' {mode!r} without '{lacking[0]}' in the message")
        out = cls(
            mode,
            float(fixed[PRIVACY_NOISE_MULTIPLIER]),
            float(fixed[PRIVACY_MAX_GRAD_NORM]),
            float(fixed[PRIVACY_DELTA]),
            float(fixed.get(PRIVACY_EPSILON_BUDGET, 0.0)),
            bool(fixed.get(PRIVACY_REPRODUCIBLE_NOISE, False)),
        )
        if not (out.noise_multiplier > 0 and out.max_grad_norm > 0 and 0 < out.delta < 1 and out.epsilon_budget >= 0):
            raise MessageError(f"the message's privacy settings are out of range: {out}")
        return out


@dataclass(frozen=True)
class Request:
    """The settings of one message (its ``config`` record): which operations to run, in order, and everything they
    need (see the module docstring). :meth:`encode` / :meth:`decode` are the only translation to and from keys."""

    ops: tuple[str, ...]
    round: int
    setup: Setup = Setup()
    load: Load = Load()
    keep: Keep = Keep()
    returns: Return = Return()
    transport: str | None = None  # arrays.transport; None: not sent, the arrays travel in their own dtype
    evaluation: Evaluation = Evaluation()
    training: Training = Training()
    public: PublicSet = PublicSet()
    bookkeeping: Bookkeeping = Bookkeeping()
    privacy: Privacy | None = None  # None: not sent, privacy off

    @property
    def array_transport(self) -> str:
        """How the message's arrays travel and the reply's must: ``transport``, float32 when not sent."""
        return self.transport or "float32"

    def encode(self) -> ConfigRecord:
        """The config record of this request: exactly the keys of the fields that are set. Made once per request and
        shared by every message built from it (a round's messages to many nodes; Flower checks each entry of a new
        record, ~0.3 ms a message): no code modifies a built message's record in place (:func:`with_request` puts in
        another)."""
        encoded = self.__dict__.get("_encoded")
        if encoded is None:
            encoded = self._encode()
            object.__setattr__(self, "_encoded", encoded)  # a cache beside the frozen fields (not compared, not copied)
        return encoded

    def _encode(self) -> ConfigRecord:
        s = self.setup
        out: dict[str, Any] = {OPS: [str(op) for op in self.ops], ROUND: int(self.round)}
        out.update(flatten(DATA_SECTION, s.data))
        out.update(_present({MODEL_NAME: s.model.name, MODEL_SEED: s.model.seed}))
        if s.model.per_client:
            out[MODEL_PER_CLIENT] = list(s.model.per_client)
        out.update(flatten(CLIENT_SECTION, s.client))
        if self.privacy is not None:
            out.update(self.privacy.encode())
        out.update(
            _present(
                {
                    STATE_DIR: self.bookkeeping.state_dir,
                    STATE_RUN: self.bookkeeping.state_run,
                    LOAD_ARRAYS: self.load.into_model,
                    ARRAYS_MULTI: self.load.multi,
                    RETURN_ARRAYS: self.returns.arrays,
                    ARRAYS_KEYS: self.returns.part,
                    PERSIST_MODEL: self.keep.persist,
                    SAVE_MODEL: self.keep.save,
                    TRANSPORT_KEY: self.transport,
                    HOLDOUT_FRACTION: self.training.holdout_fraction,
                    RECEIVED_MODEL: self.evaluation.received_model,
                    PUBLIC_FINGERPRINT: self.public.fingerprint,
                    PREDICT_OUTPUT: self.public.output,
                    PREDICT_ENCODING: self.public.encoding,
                }
            )
        )
        for name, settings in self.training.sections.items():
            if not name or "." in name or name in _RESERVED_PREFIXES:
                raise ValueError(f"'{name}' cannot name a settings section (reserved or not a plain name)")
            out.update(
                flatten(
                    name, {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "extra"}
                )
            )
            out.update(flatten(name, settings.extra))
        return ConfigRecord(out)

    @classmethod
    def decode(cls, config: Any) -> Request:
        """The request a config record holds; MessageError (naming the key) for anything the schema does not allow:
        a missing ``ops`` / ``round``, a value of the wrong type, an unknown array transport, an unknown key."""
        if not isinstance(config, (ConfigRecord, dict)):  # a dict: the same settings before they are a record
            raise MessageError(f"the message's '{CONFIG}' record must be a ConfigRecord, got {type(config).__name__}")
        values = dict(config)
        for key in (OPS, ROUND):
            if key not in values:
                raise MessageError(f"the message's settings lack '{key}'")
        ops = values.pop(OPS)
        if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
            raise MessageError(f"'{OPS}' must be a list of operation names, got {_short(ops)}")
        rnd = _typed(values, ROUND, int)
        fixed = {key: _typed(values, key, kind) for key, kind in _FIXED.items() if key in values}
        transport = fixed.get(TRANSPORT_KEY)
        if transport is not None and transport not in TRANSPORTS:
            raise MessageError(
                f"unknown {TRANSPORT_KEY} '{transport}'; allowed: {', '.join(TRANSPORTS)} (server and "
                "client versions differ?)"
            )
        per_client = values.pop(MODEL_PER_CLIENT, [])
        if not isinstance(per_client, list) or not all(isinstance(a, str) for a in per_client):
            raise MessageError(f"'{MODEL_PER_CLIENT}' must be a list of architecture names, got {_short(per_client)}")
        data: dict[str, Any] = {}
        client: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            prefix, dot, name = key.partition(".")
            if not (prefix and dot and name) or prefix in _RESERVED_PREFIXES:
                raise MessageError(f"unknown message setting {_short(key, 60)} (server and client versions differ?)")
            if prefix == DATA_SECTION:
                data[name] = value
            elif prefix == CLIENT_SECTION:
                client[name] = value
            else:
                sections.setdefault(prefix, {})[name] = value
        return cls(
            ops=tuple(ops),
            round=rnd,
            setup=Setup(
                data=data,
                model=ModelSpec(fixed.get(MODEL_NAME), fixed.get(MODEL_SEED), tuple(per_client)),
                client=client,
            ),
            load=Load(fixed.get(LOAD_ARRAYS), fixed.get(ARRAYS_MULTI)),
            keep=Keep(fixed.get(PERSIST_MODEL), fixed.get(SAVE_MODEL)),
            returns=Return(fixed.get(RETURN_ARRAYS), fixed.get(ARRAYS_KEYS)),
            transport=transport,
            evaluation=Evaluation(fixed.get(RECEIVED_MODEL)),
            training=Training(
                fixed.get(HOLDOUT_FRACTION), {name: _section(name, entries) for name, entries in sections.items()}
            ),
            public=PublicSet(fixed.get(PUBLIC_FINGERPRINT), fixed.get(PREDICT_OUTPUT), fixed.get(PREDICT_ENCODING)),
            bookkeeping=Bookkeeping(fixed.get(STATE_DIR), fixed.get(STATE_RUN)),
            privacy=Privacy.decode(fixed),
        )


_NUMBER = (int, float)
# the type of every fixed setting but ops and model.per_client (decoded apart); each is popped when decoded
_FIXED: dict[str, Any] = {
    MODEL_NAME: str,
    MODEL_SEED: int,
    STATE_DIR: str,
    STATE_RUN: str,
    LOAD_ARRAYS: bool,
    ARRAYS_MULTI: bool,
    RETURN_ARRAYS: bool,
    ARRAYS_KEYS: str,
    PERSIST_MODEL: bool,
    SAVE_MODEL: bool,
    TRANSPORT_KEY: str,
    HOLDOUT_FRACTION: _NUMBER,
    RECEIVED_MODEL: str,
    PUBLIC_FINGERPRINT: str,
    PREDICT_OUTPUT: str,
    PREDICT_ENCODING: str,
}
_PRIVACY_TYPES: dict[str, Any] = {
    PRIVACY_MODE: str,
    PRIVACY_NOISE_MULTIPLIER: _NUMBER,
    PRIVACY_MAX_GRAD_NORM: _NUMBER,
    PRIVACY_DELTA: _NUMBER,
    PRIVACY_EPSILON_BUDGET: _NUMBER,
    PRIVACY_REPRODUCIBLE_NOISE: bool,
}
_FIXED.update(_PRIVACY_TYPES)
# the prefixes of fixed dotted settings: no section may take their name (model.*, arrays.*, public.*, received.*,
# predict.*), so that an unknown key under one of them is refused rather than read as a section's
_RESERVED_PREFIXES = frozenset(k.partition(".")[0] for k in (*_FIXED, MODEL_PER_CLIENT) if "." in k)
_SECTION_TYPES: dict[str, Any] = {
    "epochs": int,
    "batch_size": int,
    "lr": _NUMBER,
    "optimizer": str,
    "momentum": _NUMBER,
    "weight_decay": _NUMBER,
    "drop_last": bool,
    "clip_norm": _NUMBER,
    "mixed_precision": bool,
    "freeze": str,
    "loss": str,
    "weighting": str,
}


def _present(values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries that are set (not None), in order."""
    return {k: v for k, v in values.items() if v is not None}


_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false", _NUMBER: "a number"}


def _typed(values: dict[str, Any], key: str, kind: Any, shown: str | None = None) -> Any:
    """``values.pop(key)`` if it is of ``kind`` (a bool is no number); MessageError naming ``shown`` (default
    ``key``) otherwise."""
    value = values.pop(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise MessageError(f"message setting '{shown or key}' must be {_KIND_NAMES[kind]}, got {_short(value)}")
    return value


def _section(name: str, entries: Mapping[str, Any]) -> Section:
    """The Section ``<name>.*`` from its entries (by setting name); the settings it does not type go to ``extra``."""
    extra = dict(entries)
    typed = {k: _typed(extra, k, kind, f"{name}.{k}") for k, kind in _SECTION_TYPES.items() if k in extra}
    return Section(**typed, extra=extra)


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut to ``limit`` characters (a hostile value may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def build_message(
    node_id: int,
    request: Request,
    message_type: str = MESSAGE_TYPE,
    arrays: ArrayRecord | None = None,
    targets: ArrayRecord | None = None,
    eval_arrays: ArrayRecord | None = None,
) -> Message:
    """One message for one node: the request's settings (:meth:`Request.encode`), and the optional model arrays,
    targets record (:meth:`Targets.encode`) and model sent for evaluation only."""
    content = RecordDict({CONFIG: request.encode()})
    if arrays is not None:
        content[ARRAYS] = arrays
    if targets is not None:
        content[TARGETS] = targets
    if eval_arrays is not None:
        content[EVAL_ARRAYS] = eval_arrays
    return Message(content=content, dst_node_id=node_id, message_type=message_type, group_id=str(request.round))


def request_of(msg: Message) -> Request:
    """The request a message carries (:meth:`Request.decode`; MessageError when it has no config record)."""
    if CONFIG not in msg.content:
        raise MessageError(f"the message has no '{CONFIG}' record")
    return Request.decode(msg.content[CONFIG])


class RequestMemo:
    """The requests of a batch of messages (a round's), decoded once per distinct settings record and rewritten once
    per distinct change: a round's messages to many nodes share one record (:meth:`Request.encode`). Keyed by the
    records' identity, so it lives only while the batch does (one call)."""

    def __init__(self) -> None:
        self._decoded: dict[int, tuple[Any, Request]] = {}
        self._replaced: dict[tuple[int, tuple[tuple[str, Any], ...]], tuple[Request, Request]] = {}

    def of(self, msg: Message) -> Request:
        """The message's request (:func:`request_of`)."""
        record = msg.content[CONFIG] if CONFIG in msg.content else None
        found = self._decoded.get(id(record))
        if found is None or found[0] is not record:
            found = (record, request_of(msg))
            self._decoded[id(record)] = found
        return found[1]

    def replaced(self, request: Request, **changes: Any) -> Request:
        """``dataclasses.replace(request, **changes)``, the same object for the same request and changes (so that the
        messages given it share one encoded record)."""
        key = (id(request), tuple(sorted(changes.items())))
        found = self._replaced.get(key)
        if found is None or found[0] is not request:
            found = (request, dataclasses.replace(request, **changes))
            self._replaced[key] = found
        return found[1]


def with_request(msg: Message, request: Request) -> Message:
    """``msg`` with its settings replaced by ``request`` (its other records and its metadata as they were)."""
    msg.content[CONFIG] = request.encode()
    return msg


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
            raise MessageError(f"the '{TARGETS}' record holds unknown array(s) {[_short(k, 40) for k in unknown[:3]]}")
        if DISTILL_INDICES in record and TARGET_ARRAY not in record:
            raise MessageError(f"the '{TARGETS}' record has '{DISTILL_INDICES}' but no '{TARGET_ARRAY}'")
        out = {k: npy_values(record[k]) for k in (TARGET_ARRAY, DISTILL_INDICES, PREDICT_INDICES) if k in record}
        for k in (DISTILL_INDICES, PREDICT_INDICES):
            rows = out.get(k)
            if rows is not None and (rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer)):
                raise MessageError(f"'{k}' must be a vector of row indices of U, got {rows.dtype} {rows.shape}")
        return cls(out.get(TARGET_ARRAY), out.get(DISTILL_INDICES), out.get(PREDICT_INDICES))


# ====================================================================== the reply


@dataclass(frozen=True)
class ReplyInfo:
    """The reply's ``info`` record: the architecture of the client's model and the fingerprint of its U."""

    arch: str | None = None
    fingerprint: str | None = None

    def encode(self) -> ConfigRecord:
        return ConfigRecord(_present({INFO_ARCH: self.arch, INFO_FINGERPRINT: self.fingerprint}))

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> ReplyInfo:
        """The info a record holds (entries it does not know are ignored: the reply validator bounds them)."""
        arch, fingerprint = record.get(INFO_ARCH), record.get(INFO_FINGERPRINT)
        for key, value in ((INFO_ARCH, arch), (INFO_FINGERPRINT, fingerprint)):
            if value is not None and not isinstance(value, str):
                raise MessageError(f"'{INFO}' entry '{key}' must be a string, got {_short(value)}")
        return cls(arch, fingerprint)


@dataclass(frozen=True)
class MessageProfile:
    """The reply's ``profile`` record: seconds of the client's time on one message, per phase (each phase measured
    exclusively: a model built inside an evaluation counts as ``model``, not ``evaluate``), and ``wall``, from the
    message's arrival at the worker to its reply encoded. The phases sum to at most ``wall``; what is left of it is
    the worker's own glue. What the framework spends beyond ``wall`` (transport, queues, the ClientApp's start) is
    not the client's to measure (bench/message_profile.py)."""

    decoding: float = 0.0
    data: float = 0.0
    model: float = 0.0
    train: float = 0.0
    evaluate: float = 0.0
    predict: float = 0.0
    other: float = 0.0
    keep: float = 0.0
    encoding: float = 0.0
    wall: float = 0.0

    def phases(self) -> dict[str, float]:
        """Seconds per phase (every field but ``wall``), in the order of the fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "wall"}

    def encode(self) -> MetricRecord:
        return MetricRecord({PROFILE_FIELDS[name]: float(getattr(self, name)) for name in PROFILE_FIELDS})

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> MessageProfile:
        """The profile a record holds; MessageError on an entry it does not know or a value that is not a finite,
        non-negative number."""
        fields = {key: name for name, key in PROFILE_FIELDS.items()}
        values: dict[str, float] = {}
        for key, value in record.items():
            if key not in fields:
                raise MessageError(f"'{PROFILE}' has an unknown entry {_short(key)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < math.inf:
                raise MessageError(
                    f"'{PROFILE}' entry '{key}' must be a finite number of seconds >= 0, got {_short(value)}"
                )
            values[fields[key]] = float(value)
        return cls(**values)


# MessageProfile's fields -> their entries in the profile record
PROFILE_FIELDS = {
    "decoding": PROFILE_DECODING,
    "data": PROFILE_DATA,
    "model": PROFILE_MODEL,
    "train": PROFILE_TRAIN,
    "evaluate": PROFILE_EVALUATE,
    "predict": PROFILE_PREDICT,
    "other": PROFILE_OTHER,
    "keep": PROFILE_KEEP,
    "encoding": PROFILE_ENCODING,
    "wall": PROFILE_WALL,
}


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


BOOKKEEPING_KEYS = frozenset({STATE_DIR, STATE_RUN})  # where a client keeps its state: not algorithm traffic


def eval_nbytes(content: RecordDict) -> int:
    """Bytes of the model a message carries for evaluation only (its ``eval-arrays`` record; 0 without)."""
    if EVAL_ARRAYS not in content:
        return 0
    return sum(len(a.data) for a in content.array_records[EVAL_ARRAYS].values())


def record_nbytes(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: array buffers plus an estimate for metrics/configs (bookkeeping keys,
    which depend on the run folder's path, are left out so that byte counts compare across folders; so is a reply's
    ``profile``, a measurement of the client's machine, not algorithm traffic)."""
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


def parse_reply(msg: Message, expect_arrays: bool = False, expect_predictions: bool = False) -> ClientReply:
    """Validate a reply (error flag, keys, finite numbers) and unpack it; raise ReplyError if unusable."""
    if msg.has_error():
        raise ReplyError(f"client error {msg.error.code}: {msg.error.reason}")
    content = msg.content
    if METRICS not in content:
        raise ReplyError("reply without a 'metrics' record")
    metrics: dict[str, Any] = dict(content.metric_records[METRICS])
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
        arrays = {k: from_wire(v, np.float32) for k, v in record_values(content.array_records[ARRAYS]).items()}
        for k, a in arrays.items():  # finite as float32, the models' dtype (1e300 is finite only in float64)
            if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a.astype(np.float32))):
                raise ReplyError(f"array '{k}' has non-finite values (as float32)")
    elif expect_arrays:
        raise ReplyError("reply lacks the model arrays it was asked for")
    predictions = None
    if PREDICTIONS in content:
        predictions = record_values(content.array_records[PREDICTIONS])
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
        profile=profile_of(content),
    )


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


def pack_models(models: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """K state dicts -> one dict with keys 'm<k>.<name>' (several models in one message, ``arrays.multi``)."""
    return {f"m{k}.{name}": value for k, model in enumerate(models) for name, value in model.items()}


def arrays_record(arrays: Mapping[str, np.ndarray], transport: str = "float32") -> ArrayRecord:
    """Named numpy arrays -> ArrayRecord (order kept, shapes kept: a 0-d array such as BatchNorm's
    ``num_batches_tracked`` stays 0-d; ``np.ascontiguousarray`` would make it shape (1,)), floating arrays
    encoded for ``transport`` (:func:`encode_arrays`; float32: as they are), each by :func:`npy_array`."""
    return ArrayRecord({k: npy_array(v) for k, v in encode_arrays(arrays, transport).items()})


# ---------------------------------------------------------------------- .npy bytes, each header made and read once
# Flower's Array holds an array as the bytes np.save writes (an .npy header, then the values in C order). np.save and
# np.load format and parse that header on every call (np.load through ast.literal_eval): a model's arrays carry the
# same few headers every round, so each is made and read once here, and the values are copied in and out directly.
NPY_STYPE = "numpy.ndarray"  # Flower's serialisation type of .npy bytes (Array.from_numpy_ndarray's)
NPY_MAGIC = b"\x93NUMPY"
_NPY_CACHE_SIZE = 4096  # headers kept (each tens of bytes); past it the cache starts again
_npy_headers: dict[tuple[str, tuple[int, ...]], bytes] = {}  # (dtype.str, shape) -> the header np.save writes
_npy_layouts: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}  # header -> what it says, the offset


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _NPY_CACHE_SIZE:
        cache.clear()
    cache[key] = value


def npy_array(values: np.ndarray) -> Array:
    """An Array of ``values`` exactly as Flower's ``Array.from_numpy_ndarray`` makes it (the same .npy bytes, dtype,
    shape and stype; a non-C-contiguous array is copied to C order first, 0-d arrays stay 0-d); the header of each
    dtype and shape is taken from np.save once."""
    a = contiguous(values)
    key = (a.dtype.str, tuple(a.shape))
    header = _npy_headers.get(key)
    if header is None or a.dtype.hasobject:
        buffer = io.BytesIO()
        np.save(buffer, a, allow_pickle=False)
        data = buffer.getvalue()
        _remember(_npy_headers, key, data[: len(data) - a.nbytes])
    else:
        data = b"".join((header, a.data))
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype=NPY_STYPE, data=data)


def npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """What the .npy header at the start of ``data`` says — shape, Fortran order, dtype — and where the values start,
    as numpy's own reader parses it (headers up to its default 10,000 bytes); ValueError when it is no .npy header.
    Each distinct header is parsed once."""
    if len(data) < 10 or data[:6] != NPY_MAGIC:
        raise ValueError("the bytes do not start with an .npy header")
    start = 10 if data[6] == 1 else 12
    offset = start + int.from_bytes(data[8:start], "little")
    key = bytes(data[:offset])
    layout = _npy_layouts.get(key)
    if layout is None:
        fh = io.BytesIO(key)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if fh.tell() != offset:
            raise ValueError("the .npy header's length does not match its text")
        layout = (tuple(int(d) for d in shape), bool(fortran), dtype, offset)
        _remember(_npy_layouts, key, layout)
    return layout


def npy_values(array: Array) -> np.ndarray:
    """The values of an Array as Flower's ``Array.numpy()`` reads them (a writable array of the header's dtype and
    shape), the header parsed by :func:`npy_header`; anything but plain C-order .npy bytes of the right length is
    left to ``Array.numpy()`` (which reads or refuses it as before)."""
    data = array.data
    try:
        shape, fortran, dtype, offset = npy_header(data)
    except ValueError:
        return array.numpy()
    count = math.prod(shape)
    if array.stype != NPY_STYPE or fortran or dtype.hasobject or len(data) - offset != count * dtype.itemsize:
        return array.numpy()
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()


def record_values(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord's arrays by name (:func:`npy_values`), in the record's order."""
    return {k: npy_values(v) for k, v in record.items()}


# ---------------------------------------------------------------------- compact transport (strategy.transport)
# A message whose model arrays travel compactly says so in its config (TRANSPORT_KEY); the client then returns
# its arrays the same way. float32: every array travels in its own dtype (no key is added: messages as before).
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: beyond it a float16 cast gives inf


def check_transport(transport: str) -> None:
    """Refuse an unknown transport (a message from another version, or a typo in a direct call)."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"unknown array transport '{transport}'; allowed: {', '.join(TRANSPORTS)} (config key strategy.transport)"
        )


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
        log.warning(
            "transport float16: %d array(s) exceed float16's range (|x| > %g) or are not finite; sent in "
            "their own dtype: %s",
            len(kept),
            FLOAT16_MAX,
            ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""),
        )
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
    return arrays_record(record_values(record), transport)


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
