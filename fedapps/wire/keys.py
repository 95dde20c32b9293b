"""How the wire declares its keys, and the names no field owns.

Every key is declared once: a field of the schema's dataclasses (:mod:`fedapps.wire.request`,
:mod:`fedapps.wire.reply`) by :func:`wire`, which gives its key and its :class:`Kind` (what the value must be, how it
is encoded and decoded); every other name (records, arrays, metrics, the reply's ``info`` entries) by :func:`key`.
Both list the key in :data:`KEYS`; the encoders, decoders and the table of fixed settings are derived from the fields.
Also here: the operation sections, the message types, the evaluation tags and the metric names built from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KEYS: list[str] = []  # every key of the wire, in the order declared (tests/test_architecture.py: spelled here only)


def key(name: str) -> str:
    """Declare a wire key: listed in :data:`KEYS`, returned as it is."""
    if name in KEYS:
        raise ValueError(f"wire key '{name}' is declared twice")
    KEYS.append(name)
    return name


class MessageError(ValueError):
    """A message (or one of its records) that does not follow the schema; the text names the key and the problem."""


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Kind:
    """The type of a value on the wire: ``name`` (what an error says it must be), ``accepts`` (checks a received
    value), ``encode`` (the field's value as sent) and ``decode`` (a received value as the field holds it)."""

    name: str
    accepts: Callable[[Any], bool]
    encode: Callable[[Any], Any] = _identity
    decode: Callable[[Any], Any] = _identity

    def read(self, value: Any, shown: str) -> Any:
        """``value`` decoded if it is of this kind; MessageError naming ``shown`` otherwise."""
        if not self.accepts(value):
            raise MessageError(f"message setting '{shown}' must be {self.name}, got {short(value)}")
        return self.decode(value)


def _scalar(*types: type) -> Callable[[Any], bool]:
    """Whether a value is of ``types`` (a bool is no number: it is accepted only where bool is one of them)."""
    return lambda v: isinstance(v, bool) == (bool in types) and isinstance(v, types)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


STR = Kind("a string", _scalar(str))
INT = Kind("an integer", _scalar(int), int)
BOOL = Kind("true or false", _scalar(bool))
NUMBER = Kind("a number", _scalar(int, float))


def names(what: str) -> Kind:
    """A list of strings on the wire, a tuple in the field: ``what`` they name (``a list of <what>``)."""
    return Kind(f"a list of {what}", _names, lambda v: [str(x) for x in v], tuple)


def wire(name: str, kind: Kind, default: Any = None, always: bool = False) -> Any:
    """A field of the schema: its key ``name`` on the wire (declared by :func:`key`) and its ``kind``. The field is
    sent unless it holds its ``default`` (``always``: sent whenever its part is)."""
    return dataclasses.field(default=default, metadata={"key": key(name), "kind": kind, "always": always})


def setting(kind: Kind) -> Any:
    """A field of a settings section (``<section>.<field name>``, unset: None): its kind."""
    return dataclasses.field(default=None, metadata={"kind": kind})


def key_of(cls: type, field_name: str) -> str:
    """The wire key the field ``field_name`` of the schema's dataclass ``cls`` declares."""
    return next(f.metadata["key"] for f in dataclasses.fields(cls) if f.name == field_name)


# record names
CONFIG = key("config")
ARRAYS = key("arrays")
TARGETS = key("targets")
METRICS = key("metrics")
PREDICTIONS = key("predictions")
INFO = key("info")
EVAL_ARRAYS = key("eval-arrays")
PROFILE = key("profile")  # the reply's MessageProfile (left out of the byte counts)

# array names: the reply's predictions record, the message's targets record (:class:`fedapps.wire.request.Targets`)
PREDICTION_ARRAY = PREDICTIONS  # the array of the reply's predictions record (the record's own name)
TARGET_ARRAY = TARGETS  # the server's targets on U in the message's targets record (the record's own name)
DISTILL_INDICES = key("distill-indices")  # ... with the rows of U they are for (absent: all of U)
PREDICT_INDICES = key("predict-indices")  # ... and the rows of U to predict on (absent: all of U)

# metric names every reply carries; an evaluation tagged <tag> reports <tag>-acc, <tag>-loss, <tag>-n, <tag>-correct
CLIENT_ID = key("client-id")
NUM_EXAMPLES = key("num-examples")
TOTAL_TIME = key("t-total")  # seconds from the message's arrival to its reply
PRIVACY_EPSILON = key("privacy-epsilon")  # while privacy is on: the client's ε so far (at privacy.delta), every reply
TIMING_PREFIX = "t-"  # t-<tag>: seconds of the operation tagged <tag>
EVAL_FIELDS = ("acc", "loss", "n", "correct")

# the words that open a client's refusal to train past privacy.epsilon_budget (its error reply's reason): the
# server's records count the refusals by them
PRIVACY_REFUSED = "privacy budget exhausted"

# settings sections: ``<section>.<name>`` keys. data.* / client.* are the config's sections as they are; the
# operation sections (Training.sections) hold a Section each
DATA_SECTION = "data"
CLIENT_SECTION = "client"
TRAIN = "train"  # the settings of ``train`` (and the base of every tagged ``train:<tag>`` section)
DISTILL = "distill"  # the settings of ``distill``

# the two evaluations of the deployed-model protocol (docs/evaluation.md, fedapps.server.evaluation): the model client i
# would deploy after a round (``deployed-acc`` ...), and its model right after local training (``after-acc`` ...)
DEPLOYED_TAG = "deployed"
AFTER_TAG = "after"
# the evaluation operations a message may name (``op`` or ``op:tag``) -> the tag their metrics carry when the message
# names none. Filled by fedapps.client.clientops.client_op as each ``evaluate*`` operation is registered (the worker's,
# and an algorithm's own from its module), so that the reply validator knows which metrics a message asks for without
# reaching up into the client's registry.
EVALUATION_TAGS: dict[str, str] = {}

MESSAGE_TYPE = "train"  # every round message is one Flower "train" message
EVAL_MESSAGE_TYPE = "evaluate"  # evaluation-only messages (the deployed models after the last round)
QUERY_MESSAGE_TYPE = "query"  # before round 1: describe the node's data, or identify which client a node is


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


def short(value: object, limit: int = 80) -> str:
    """A value for an error message (a printable string as it is, else its repr; a long list by its length), cut to
    ``limit`` characters: a hostile value may be huge."""
    if isinstance(value, str) and value.isprintable():
        text = value
    else:
        text = repr(value) if not isinstance(value, list) or len(value) <= 8 else f"[{len(value)} values]"
    return text if len(text) <= limit else text[:limit] + "..."
