"""A message to a client: its settings (:class:`Request`, the ``config`` ConfigRecord), one dataclass per part,
each field declaring its key and kind once (:func:`fedapps.wire.keys.wire`): :meth:`Request.encode`,
:meth:`Request.decode` and the table of fixed settings (:data:`SETTINGS`) are derived from those declarations. A message
before it is built, and the message built from it, are :mod:`fedapps.wire.message`'s.

A message (:class:`Request` plus records) says
  which operations to run   ``ops`` (names registered in :mod:`fedapps.client.clientops`, ``name:tag``) and ``round``;
  what every client needs   :class:`Setup`: the data spec ``data.*``, the model ``model.*``, the client's training
                            defaults ``client.*`` (clients need no config file);
  what to load              :class:`Load`: the ``arrays`` record (model parameters) is loaded into the client's own
                            model (``load-arrays``) or used apart by an operation (evaluated, trained, the anchor of a
                            training term); with ``arrays.multi`` it holds several models packed by ``pack_models``;
  whether the model is kept :class:`Keep`: ``persist-model`` (default yes) keeps the client's model in
                            ``Context.state`` after the message; ``save-model: false`` (evaluation-only messages) reads
                            the kept model but does not write it back;
  what to return            :class:`Return`: ``return-arrays`` sends back the private model (or the model an operation
                            chose to return) whole (``arrays.keys: state``), parameters only (``params``) or without
                            the head (``body``);
  how arrays travel         ``arrays.transport: float16`` (``strategy.transport``): the floating arrays of ``arrays`` /
                            ``eval-arrays`` travel as float16, and the client returns its arrays the same way
                            (:func:`fedapps.wire.arrays.encode_arrays`); each side casts them back to its model's dtype
                            on receipt. Without the key, arrays travel in their own dtype;
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
                            algorithm traffic: left out of the byte counts);
  differential privacy      :class:`Privacy`: ``privacy.*`` (docs/privacy.md), sent only under mode sample:
                            the client's training on its data runs as DP-SGD.

Unset fields (None) are not sent: a message carries exactly the keys its builder set, so that messages, byte counts
and results stay as they were whatever a default is. :meth:`Request.decode` refuses a malformed message with a
:class:`MessageError` naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord

from fedapps.config import CLIENT_SIDE_PRIVACY_MODES, TRANSPORTS
from fedapps.wire.keys import (
    BOOL,
    CLIENT_SECTION,
    CONFIG,
    DATA_SECTION,
    INT,
    NUMBER,
    STR,
    Kind,
    MessageError,
    key_of,
    names,
    setting,
    short,
    wire,
)


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


def part(cls: type, optional: bool = False) -> Any:
    """A field holding a part of the request (its fields' keys are the request's): ``optional``: None, not sent."""
    return field(default=None if optional else cls(), metadata={"part": cls, "optional": optional})


def section(name: str) -> Any:
    """A field holding a config section as it is (``<name>.*``)."""
    return field(default_factory=dict, metadata={"section": name})


# ====================================================================== the parts of a request


@dataclass(frozen=True)
class ModelSpec:
    """The client's model (``model.*``): its architecture, the seed of its initialisation, and (model-agnostic
    strategies) one architecture per client, client i taking entry i mod len. None / empty: not sent."""

    name: str | None = wire("model.name", STR)
    seed: int | None = wire("model.seed", INT)
    per_client: tuple[str, ...] = wire("model.per_client", names("architecture names"), ())


@dataclass(frozen=True)
class Setup:
    """What every message carries so that a client needs no config file: the data spec (``data.*``, as
    :func:`data_spec_for_clients` leaves it), the model (``model.*``) and the client's training defaults and device
    (``client.*``: the fields of :class:`fedapps.config.ClientConfig`)."""

    data: Mapping[str, Any] = section(DATA_SECTION)
    model: ModelSpec = part(ModelSpec)
    client: Mapping[str, Any] = section(CLIENT_SECTION)


@dataclass(frozen=True)
class Load:
    """What the message's ``arrays`` record is for: loaded into the client's own model (``load-arrays``; else an
    operation uses it apart), and whether it packs several models (``arrays.multi``). None: not sent (= no)."""

    into_model: bool | None = wire("load-arrays", BOOL)
    multi: bool | None = wire("arrays.multi", BOOL)


@dataclass(frozen=True)
class Keep:
    """Whether the client keeps its private model: ``persist-model`` (read the kept model and keep it afterwards)
    and ``save-model`` (write it back; an evaluation-only message reads it only). None: not sent (= yes)."""

    persist: bool | None = wire("persist-model", BOOL)
    save: bool | None = wire("save-model", BOOL)

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

    arrays: bool | None = wire("return-arrays", BOOL)
    part: str | None = wire("arrays.keys", STR)

    @property
    def which(self) -> str:
        return self.part or "state"


@dataclass(frozen=True)
class Evaluation:
    """What an ``evaluate-received`` operation evaluates: the ``eval-arrays`` record's model, of architecture
    ``received.model`` (None: not sent, the client's own architecture)."""

    received_model: str | None = wire("received.model", STR)


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

    epochs: int | None = setting(INT)
    batch_size: int | None = setting(INT)
    lr: float | None = setting(NUMBER)
    optimizer: str | None = setting(STR)
    momentum: float | None = setting(NUMBER)
    weight_decay: float | None = setting(NUMBER)
    drop_last: bool | None = setting(BOOL)
    clip_norm: float | None = setting(NUMBER)
    mixed_precision: bool | None = setting(BOOL)
    freeze: str | None = setting(STR)
    loss: str | None = setting(STR)
    weighting: str | None = setting(STR)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def optimiser(self) -> dict[str, Any]:
        """The optimiser settings this section overrides (those set)."""
        return {k: getattr(self, k) for k in OPTIMISER_FIELDS if getattr(self, k) is not None}

    def over(self, base: Section) -> Section:
        """This section's settings over ``base``'s (a tagged ``train:<tag>`` section over ``train``)."""
        changes = {f.name: getattr(self, f.name) for f in _SECTION_FIELDS if getattr(self, f.name) is not None}
        return dataclasses.replace(base, **changes, extra={**base.extra, **self.extra})

    def encode(self, name: str) -> dict[str, Any]:
        """The section's settings as ``<name>.*`` keys: its typed fields, then ``extra``."""
        return {**flatten(name, {f.name: getattr(self, f.name) for f in _SECTION_FIELDS}), **flatten(name, self.extra)}

    @classmethod
    def decode(cls, name: str, entries: Mapping[str, Any]) -> Section:
        """The Section ``<name>.*`` from its entries (by setting name); the settings it does not type go to
        ``extra``."""
        extra = dict(entries)
        typed = {
            f.name: f.metadata["kind"].read(extra.pop(f.name), f"{name}.{f.name}")
            for f in _SECTION_FIELDS
            if f.name in extra
        }
        return cls(**typed, extra=extra)


_SECTION_FIELDS = tuple(f for f in dataclasses.fields(Section) if "kind" in f.metadata)


@dataclass(frozen=True)
class Training:
    """Training settings: ``holdout-fraction`` (a fixed share of the training split kept out of training, for the
    operations that score on it; None: not sent = 0) and the operation sections by name."""

    holdout_fraction: float | None = wire("holdout-fraction", NUMBER)
    sections: Mapping[str, Section] = field(default_factory=dict, metadata={"sections": True})

    def section(self, name: str) -> Section:
        """The settings of section ``name`` (an empty Section when the message has none)."""
        return self.sections.get(name, Section())


@dataclass(frozen=True)
class PublicSet:
    """The public set U: its fingerprint (the client refuses another U), and what ``predict`` returns (``output``:
    probs | logits) and how it encodes it (``encoding``: float32 | float16 | hard). None: not sent."""

    fingerprint: str | None = wire("public.fingerprint", STR)
    output: str | None = wire("predict.output", STR)
    encoding: str | None = wire("predict.encoding", STR)

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

    state_dir: str | None = wire("state-dir", STR)
    state_run: str | None = wire("state-run", STR)


@dataclass(frozen=True)
class Privacy:
    """Sample-level differential privacy of the client's training (``privacy.*``, docs/privacy.md; the fields of the
    server's :class:`fedapps.config.PrivacyConfig` that DP-SGD reads): sent, all of them, only under mode ``sample``
    (the server's client-level mode ``client`` sends none), so that a message without it trains as it always did.
    ``mode`` (sample), σ = ``noise_multiplier`` > 0, C = ``max_grad_norm`` > 0,
    ``delta`` in (0, 1), ``epsilon_budget`` (0: none), ``reproducible_noise`` (noise drawn from the run's seed)."""

    mode: str = wire("privacy.mode", STR, dataclasses.MISSING, always=True)
    noise_multiplier: float = wire("privacy.noise_multiplier", NUMBER, dataclasses.MISSING, always=True)
    max_grad_norm: float = wire("privacy.max_grad_norm", NUMBER, dataclasses.MISSING, always=True)
    delta: float = wire("privacy.delta", NUMBER, dataclasses.MISSING, always=True)
    epsilon_budget: float = wire("privacy.epsilon_budget", NUMBER, 0.0, always=True)
    reproducible_noise: bool = wire("privacy.reproducible_noise", BOOL, False, always=True)

    @classmethod
    def decode(cls, fixed: Mapping[str, Any]) -> Privacy | None:
        """The privacy settings among a message's typed fixed settings (None: the message has none); MessageError for
        settings without ``privacy.mode`` or a required value, a mode other than sample, values out of range."""
        keys = {f.name: f.metadata["key"] for f in dataclasses.fields(cls)}
        present = [k for k in keys.values() if k in fixed]
        if not present:
            return None
        mode = fixed.get(keys["mode"])
        if mode is None:
            raise MessageError(f"the message has '{present[0]}' but no '{keys['mode']}'")
        if mode not in CLIENT_SIDE_PRIVACY_MODES:
            raise MessageError(
                f"'{keys['mode']}' must be one of {', '.join(CLIENT_SIDE_PRIVACY_MODES)} (a message carries "
                f"privacy settings only while a mode the clients apply is on), got {short(mode)}"
            )
        required = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        lacking = [keys[f.name] for f in required if keys[f.name] not in fixed]
        if lacking:
            raise MessageError(f"'{keys['mode']}' {mode!r} without '{lacking[0]}' in the message")
        out = cls(**{name: fixed[k] for name, k in keys.items() if k in fixed})
        out = dataclasses.replace(
            out,
            noise_multiplier=float(out.noise_multiplier),
            max_grad_norm=float(out.max_grad_norm),
            delta=float(out.delta),
            epsilon_budget=float(out.epsilon_budget),
        )
        if not (out.noise_multiplier > 0 and out.max_grad_norm > 0 and 0 < out.delta < 1 and out.epsilon_budget >= 0):
            raise MessageError(f"the message's privacy settings are out of range: {out}")
        return out


@dataclass(frozen=True)
class Request:
    """The settings of one message (its ``config`` record): which operations to run, in order, and everything they
    need (see the module docstring). :meth:`encode` / :meth:`decode` are the only translation to and from keys."""

    ops: tuple[str, ...] = wire("ops", names("operation names"), dataclasses.MISSING, always=True)
    round: int = wire("round", INT, dataclasses.MISSING, always=True)
    setup: Setup = part(Setup)
    load: Load = part(Load)
    keep: Keep = part(Keep)
    returns: Return = part(Return)
    # arrays.transport; None: not sent, the arrays travel in their own dtype
    transport: str | None = wire("arrays.transport", STR)
    evaluation: Evaluation = part(Evaluation)
    training: Training = part(Training)
    public: PublicSet = part(PublicSet)
    bookkeeping: Bookkeeping = part(Bookkeeping)
    privacy: Privacy | None = part(Privacy, optional=True)  # None: not sent, privacy off

    @property
    def array_transport(self) -> str:
        """How the message's arrays travel and the reply's must: ``transport``, float32 when not sent."""
        return self.transport or "float32"

    def encode(self) -> ConfigRecord:
        """The config record of this request: exactly the keys of the fields that are set, in the order of the
        fields (:func:`build_messages` makes one per distinct request of a batch and shares it)."""
        out: dict[str, Any] = {}
        _encode_part(self, out)
        return ConfigRecord(out)

    @classmethod
    def decode(cls, config: Any) -> Request:
        """The request a config record holds; MessageError (naming the key) for anything the schema does not allow:
        a missing ``ops`` / ``round``, a value of the wrong type, an unknown array transport, an unknown key."""
        if not isinstance(config, (ConfigRecord, dict)):  # a dict: the same settings before they are a record
            raise MessageError(f"the message's '{CONFIG}' record must be a ConfigRecord, got {type(config).__name__}")
        values = dict(config)
        for required in (OPS, ROUND):
            if required not in values:
                raise MessageError(f"the message's settings lack '{required}'")
        fixed = {k: kind.read(values.pop(k), k) for k, kind in SETTINGS.items() if k in values}
        transport = fixed.get(TRANSPORT_KEY)
        if transport is not None and transport not in TRANSPORTS:
            raise MessageError(
                f"unknown {TRANSPORT_KEY} '{transport}'; allowed: {', '.join(TRANSPORTS)} (server and "
                "client versions differ?)"
            )
        sections: dict[str, dict[str, Any]] = {}
        for k, value in values.items():
            prefix, dot, name = k.partition(".")
            if not (prefix and dot and name) or prefix in RESERVED_PREFIXES:
                raise MessageError(f"unknown message setting '{short(k, 60)}' (server and client versions differ?)")
            sections.setdefault(prefix, {})[name] = value
        return _decode_part(cls, fixed, sections)


def _encode_part(obj: Any, out: dict[str, Any]) -> None:
    """The keys of a part (and of its parts), in the order of its fields: a keyed field unless it holds its default
    (or ``always``), a section as it is, the operation sections each under its name."""
    for f in dataclasses.fields(obj):
        value, m = getattr(obj, f.name), f.metadata
        if "key" in m:
            if m["always"] or value != f.default:
                out[m["key"]] = m["kind"].encode(value)
        elif "part" in m:
            if value is not None:
                _encode_part(value, out)
        elif "section" in m:
            out.update(flatten(m["section"], value))
        elif "sections" in m:
            for name, settings in value.items():
                if not name or "." in name or name in RESERVED_PREFIXES:
                    raise ValueError(f"'{name}' cannot name a settings section (reserved or not a plain name)")
                out.update(settings.encode(name))


def _decode_part(cls: type, fixed: Mapping[str, Any], sections: dict[str, dict[str, Any]]) -> Any:
    """A part from the typed fixed settings and the sections (by prefix; the config sections are taken out of
    ``sections`` as they are read, what is left are the operation sections)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        m = f.metadata
        if "key" in m:
            if m["key"] in fixed:
                values[f.name] = fixed[m["key"]]
        elif "part" in m:
            values[f.name] = m["part"].decode(fixed) if m["optional"] else _decode_part(m["part"], fixed, sections)
        elif "section" in m:
            values[f.name] = sections.pop(m["section"], {})
        elif "sections" in m:
            values[f.name] = {name: Section.decode(name, entries) for name, entries in sections.items()}
    return cls(**values)


def _settings(cls: type) -> dict[str, Kind]:
    """The keyed fields of a part and of its parts: key -> kind."""
    out: dict[str, Kind] = {}
    for f in dataclasses.fields(cls):
        if "key" in f.metadata:
            out[f.metadata["key"]] = f.metadata["kind"]
        elif "part" in f.metadata:
            out.update(_settings(f.metadata["part"]))
    return out


SETTINGS = _settings(Request)  # every fixed setting of a message: key -> kind, derived from the fields
# the prefixes of fixed dotted settings: no section may take their name (model.*, arrays.*, public.*, received.*,
# predict.*, privacy.*), so that an unknown key under one of them is refused rather than read as a section's
RESERVED_PREFIXES = frozenset(k.partition(".")[0] for k in SETTINGS if "." in k)
# the keys other modules name
OPS = key_of(Request, "ops")
ROUND = key_of(Request, "round")
TRANSPORT_KEY = key_of(Request, "transport")
LOAD_ARRAYS = key_of(Load, "into_model")
ARRAYS_KEYS = key_of(Return, "part")
HOLDOUT_FRACTION = key_of(Training, "holdout_fraction")
STATE_DIR = key_of(Bookkeeping, "state_dir")
PRIVACY_MODE = key_of(Privacy, "mode")
PRIVACY_MAX_GRAD_NORM = key_of(Privacy, "max_grad_norm")
PRIVACY_EPSILON_BUDGET = key_of(Privacy, "epsilon_budget")
BOOKKEEPING_KEYS = frozenset(_settings(Bookkeeping))  # where a client keeps its state: not algorithm traffic
