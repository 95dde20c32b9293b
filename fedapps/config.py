"""Experiment configuration: one YAML file plus dotted overrides -> one validated, typed config.

Every key is checked here, once, on the server; clients receive the parts they need inside messages.
A bad value raises :class:`ConfigError` naming the key, the value and what is allowed.

This module knows no strategy: ``strategy.params`` stays plain data here (one mapping per strategy name);
the registry in ``strategies`` resolves ``strategy.name`` and checks the params (``strategies.resolve``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

APP_DIR = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """An invalid experiment configuration; the message names the key and the fix."""


OPTIMIZERS = ("sgd", "adam")
AGGREGATION_RULES = ("mean", "median", "trimmed-mean")
REGISTRY_FILE = "nodes.csv"  # the node registry (data.node_registry) fedapps deploy node-key writes beside the keys
TRANSPORTS = ("float32", "float16")  # strategy.transport (the encodings live in fedapps.wire.protocol)
DEVICES = ("auto", "cpu", "cuda")
# tracking name -> the module its sink needs (fedapps.reporting.tracking writes; both come with
# pip install -e ".[tracking]")
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}
# data.source hf:<name>: a Hugging Face dataset (Hub id or local folder) through flwr-datasets (fedapps.data.hf); the
# modules it needs come with the optional extra "hf"
HF_SOURCE_PREFIX = "hf:"
HF_MODULES = ("flwr_datasets", "datasets")
# privacy.mode (docs/privacy.md): off, DP-SGD on every client's local training (sample), or the server's client-level DP
# of the pseudo-label exchange (client); each mode's modules come with the optional extra "privacy"
# (pip install -e ".[privacy]")
PRIVACY_MODES = ("off", "sample", "client")
PRIVACY_MODULES = {"sample": ("opacus",), "client": ("dp_accounting",)}
# the modes whose settings travel to the clients in every message (they add the noise); under "client" the server
# adds it and the messages carry no privacy settings
CLIENT_SIDE_PRIVACY_MODES = ("sample",)


HELP = "fedapps.help"  # field metadata: the key's help (docs/reference/configuration.md is generated from it)
CHOICES = "fedapps.choices"  # field metadata: allowed values, a tuple or the dotted name of the registry holding them
FORMS = "fedapps.forms"  # field metadata: the other forms a value may take besides the choices (e.g. hf:<name>)


def setting(
    default: Any,
    help: str,  # noqa: A002
    choices: tuple[str, ...] | str | None = None,
    forms: tuple[str, ...] = (),
) -> Any:
    """A config key: its default, its help (the one source of the generated configuration reference) and, for a
    fixed set of values, what is allowed: a tuple, or the dotted name of the registry that holds them (this module
    imports no registry; the checks themselves are in :func:`validate` and the registries), and ``forms``, the
    patterns a value may follow besides them (shown in the reference)."""
    meta = {HELP: help, CHOICES: choices, FORMS: forms}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # a fresh copy per config
    return field(default=default, metadata=meta)


@dataclass
class StrategyConfig:
    """Which strategy runs, how clients are sampled, and the strategy's own parameters."""

    name: str = setting(
        "fedavg",
        "the strategy that runs: one module of strategies/ each (docs/algorithms/index.md)",
        "strategies.STRATEGIES",
    )
    fraction: float = setting(1.0, "fraction of the connected clients sampled each round, in (0, 1]")
    min_clients: int = setting(
        1, "never sample fewer clients than this (when that many are connected); at most data.num_clients"
    )
    timeout: float = setting(
        600.0, "seconds to wait for one round's replies; late or failed clients are logged and skipped"
    )
    expected_clients: int = setting(
        0,
        "before round 1 the server waits until this many client nodes are connected "
        "(0: data.num_clients, the whole federation): a deployment started before all "
        "its SuperNodes waits instead of starting with whoever is there",
    )
    connect_timeout: float = setting(
        300.0, "seconds to wait for them; then the run fails, saying how many came and what to do"
    )
    aggregation: str = setting(
        "mean",
        "how parameter-averaging strategies combine client arrays (fedapps/server/robust.py); "
        "the other strategies accept only mean",
        AGGREGATION_RULES,
    )
    trim_fraction: float = setting(
        0.1, "trimmed-mean: share of the lowest and of the highest values dropped per coordinate, in [0, 0.5)"
    )
    max_weight_share: float = setting(
        1.0,
        "mean: cap on any client's normalised weight, in (0, 1]; 1 = no cap (with "
        "data.source nodes and no data.node_registry at most min(0.5, 2/cohort): "
        "the nodes' sizes are their own claims)",
    )
    clip_update_norm: float = setting(
        0.0,
        "clip each client's update (its arrays minus the model the round sent it) "
        "to this L2 norm before they are combined, >= 0; 0 = no clipping "
        "(parameter-averaging strategies, fedapps/server/robust.py)",
    )
    transport: str = setting(
        "float32",
        "how model arrays travel between server and clients, both ways "
        "(fedapps/wire/protocol.py): float32 as the models hold them, or float16 (floating "
        "arrays halved; parameter-sharing strategies only)",
        TRANSPORTS,
    )
    params: dict[str, Any] = setting(
        {},
        "each strategy's own parameters, one section per strategy: "
        "strategy.params.<strategy>.<key>; the chosen strategy reads its section "
        "(missing keys: their defaults), the other sections are checked and ignored",
    )


@dataclass
class DataConfig:
    """The data source and how it is split among clients (sent verbatim to every client)."""

    source: str = setting(
        "mnist5k",
        "the data set: a built-in source, nodes (each node brings its own data: "
        "docs/data.md), folder:<path> (your own images, one folder per class, optionally in train/ and test/: "
        "docs/data.md), hf:<Hub id or folder> (Flower Datasets, optional extra hf), or your own "
        "loader as package.module:loader, returning (images, labels) or a torch Dataset (docs/data.md)",
        "fedapps.data.sources.SOURCES",
        ("nodes", "folder:<path>", "hf:<name>", "package.module:loader"),
    )
    root: str = setting(
        "~/.cache/fedapps/data",
        "where torchvision sources live or download to, and where "
        "tiny-imagenet-200/ is; a leading ~ is expanded on each machine",
    )
    download: bool = setting(False, "let torchvision download missing files (needs internet)")
    partition: str = setting(
        "iid", "how the data is split among the clients (docs/data.md)", "fedapps.data.partition.PARTITIONS"
    )
    num_clients: int = setting(20, "number of clients (one simulated SuperNode each)")
    classes_per_client: int = setting(2, "pathological: classes per client")
    alpha: float = setting(0.1, "dirichlet, cosmos-groups: Dirichlet concentration")
    min_samples: int = setting(40, "dirichlet: redraw until every client has at least this many samples")
    groups: int = setting(
        5,
        "cosmos-groups: number of class groups; rotated, label-swap: number of client groups "
        "(rotated: 1, 2 or 4, group g turned by g·360/groups degrees)",
    )
    redistribute_fraction: float = setting(0.1, "cosmos-groups: share of each client's samples pooled and dealt to all")
    test_fraction: float = setting(0.25, "share of each client's data kept as its local test split")
    public_fraction: float = setting(
        0.0, "share of the data set held out as the unlabelled public set U (pseudo-label strategies)"
    )
    seed: int = setting(1, "partition seed (fixed across experiment seeds: every run sees the same partition)")
    synthetic_classes: int = setting(10, "synthetic: number of classes")
    synthetic_shape: list[int] = setting([3, 32, 32], "synthetic: image shape [C, H, W]")
    synthetic_samples: int = setting(2000, "synthetic: number of samples")
    validation_fraction: float = setting(
        0.15,
        "share of each client's train split held out as its validation split "
        "when evaluate_on is validation (stratified, seeded), in [0, 1)",
    )
    evaluate_on: str = setting(
        "test",
        "test: train on the whole train split, score on the test split (final runs); "
        "validation: train on the rest of the train split, score on the validation "
        "share, the test split never built (tuning: docs/evaluation.md)",
        "fedapps.data.federation.EVALUATION_SPLITS",
    )
    swap_pairs: int = setting(1, "label-swap: disjoint label pairs swapped (seeded) in every group but group 0")
    num_classes: int = setting(
        0,
        "data.source nodes only: number of classes (0: learnt from the nodes before round 1, "
        "then recorded in the run's config.yaml)",
    )
    input_shape: list[int] = setting(
        [], "data.source nodes only: input shape [C, H, W] ([]: learnt from the nodes before round 1, then recorded)"
    )
    public_path: str = setting("", "data.source nodes only: the server's copy of the public set U ('': none)")
    node_registry: str = setting(
        "",
        "data.source nodes only: the operator's registry of the nodes' data, a CSV "
        "client_id,max_num_examples (fedapps deploy node-key writes it next to the node "
        "keys): a reply claiming more examples than its client's cap is rejected "
        "(docs/deployment.md); '': none, and the weight cap of strategy.max_weight_share "
        "defaults to min(0.5, 2/cohort)",
    )


@dataclass
class ModelConfig:
    """The client model architecture (one for all, or a per-client list for model-agnostic strategies)."""

    name: str = setting(
        "cnn",
        "the client model: a zoo name (cnn is the papers' 4-layer CNN), or your own as "
        "package.module:factory, called as factory(num_classes, input_shape) and returning an nn.Module "
        "(docs/configuration.md)",
        "fedapps.models.MODEL_NAMES",
        ("package.module:factory",),
    )
    per_client: list[str] = setting(
        [],
        "model-agnostic strategies only: architectures cycled by client id, e.g. [cnn, mlp] (zoo names or "
        "package.module:factory)",
        "fedapps.models.MODEL_NAMES",
        ("package.module:factory",),
    )


@dataclass
class OptimSettings:
    """What a training loop needs besides the data and the loss: the ``client`` section's training keys, and the
    type of every message section that overrides them (``train.*``, ``distill.*``, ...) and of server-side loops."""

    epochs: int = setting(1, "local epochs per round")
    batch_size: int = setting(10, "minibatch size")
    lr: float = setting(0.05, "learning rate")
    optimizer: str = setting("sgd", "the local optimiser", OPTIMIZERS)
    momentum: float = setting(0.0, "SGD momentum")
    weight_decay: float = setting(0.0, "L2 weight decay")
    drop_last: bool = setting(True, "drop the last incomplete minibatch (as PFLlib's loaders do)")
    clip_norm: float = setting(0.0, "clip the gradient norm at this value during local training; 0 = no clipping")
    mixed_precision: bool = setting(False, "bf16 autocast of the forward pass on CUDA (refused with client.device cpu)")


@dataclass
class ClientConfig(OptimSettings):
    """Local training hyper-parameters, and where the client computes."""

    device: str = setting("auto", "where the client computes: auto (CUDA when present), cpu or cuda", DEVICES)


@dataclass
class PrivacyConfig:
    """Differential privacy of the clients' data (docs/privacy.md): under mode sample sent to every client (each adds
    its own noise); under mode client applied by the server to what it aggregates."""

    mode: str = setting(
        "off",
        "off; sample: DP-SGD on every client's local training (per-sample clipping, "
        "Gaussian noise, Opacus's RDP accountant over all of the client's steps of the run); "
        "client: the server's client-level DP of the pseudo-label exchange (cosmos, fedmd, "
        "fedct, comet: each client's predictions on U clipped, Gaussian noise on their "
        "sums or vote counts, an RDP accountant over the rounds); optional extra privacy",
        PRIVACY_MODES,
    )
    noise_multiplier: float = setting(
        1.0,
        "σ: the noise's standard deviation in units of the sensitivity (sample: "
        "privacy.max_grad_norm; client: privacy.clip_norm, or sqrt(rows of U) for votes), > 0",
    )
    max_grad_norm: float = setting(1.0, "C of mode sample: each sample's gradient is clipped to this L2 norm, > 0")
    clip_norm: float = setting(
        0.0,
        "C of mode client: each client's prediction matrix on U (rows × classes) is scaled "
        "down to this Frobenius norm before the server sums it; 0 = sqrt(rows), the largest "
        "norm of probabilities or one-hot labels (FedMD with scores=logits needs a value)",
    )
    delta: float = setting(
        1e-5,
        "δ of the (ε, δ) of each client, in (0, 1); below 1 / (a client's training samples), "
        "or 1 / (number of clients) in mode client, to mean something",
    )
    epsilon_budget: float = setting(
        0.0,
        "sample: a client refuses to train when its ε would pass this (its reply says so, "
        "the server leaves it out and records it); client: the run ends after the last round "
        "whose release keeps every client's ε within it; 0 = no budget",
    )
    reproducible_noise: bool = setting(
        False,
        "draw the noise (and sample's Poisson batches) from the run's seed (a repeatable "
        "experiment; NO protection against whoever knows the seed: the server under "
        "sample, whoever reads the config under client); false: from the operating "
        "system's entropy",
    )


@dataclass
class ExperimentConfig:
    """A whole experiment."""

    run_name: str = setting("", "results go to <output_dir>/<run_name>/; '': <strategy>-<source>-<partition>-s<seed>")
    seed: int = setting(0, "seed of model initialisation, client sampling and local shuffling")
    rounds: int = setting(20, "federated rounds")
    evaluate_every: int = setting(
        1,
        "measure the deployed models and the models after local training in rounds k, 2k, ... and always after "
        "the last round (1: every round); unmeasured rounds have empty accuracy cells",
    )
    output_dir: str = setting("results", "results root (relative paths resolve against the working directory)")
    min_measured_share: float = setting(
        0.5,
        "the run succeeds (exit 0, summary.json 'problems' empty) only if its "
        "headline was measured on at least this share of data.num_clients, in "
        "[0, 1] (0: on at least one client)",
    )
    tracking: list[str] = setting(
        [],
        'experiment trackers the run also writes to (optional extra tracking: pip install -e ".[tracking]")',
        tuple(TRACKERS),
    )
    tracking_dir: str = setting(
        "", "where the trackers write: '' inside the run folder, else one root for many runs (relative: to output_dir)"
    )
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def resolved_run_name(self) -> str:
        """The run name, or one derived from strategy, data and seed when none is given."""
        if self.run_name:
            return self.run_name
        d = self.data
        return f"{self.strategy.name}-{source_slug(d.source)}-{d.partition}-s{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (what config.yaml in the results folder holds)."""
        return dataclasses.asdict(self)


def source_slug(source: str) -> str:
    """``data.source`` as a piece of a folder name: every character outside letters, digits, '.', '_' and '-' becomes
    '-' (``hf:ylecun/mnist`` -> ``hf-ylecun-mnist``); the built-in names are unchanged."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", source)


def check_hf_source(source: str) -> None:
    """``data.source: hf:<name>``: a non-empty name without spaces, and the optional extra "hf" installed."""
    name = source[len(HF_SOURCE_PREFIX) :]
    _check(
        bool(name.strip()) and name == name.strip() and not any(ch.isspace() for ch in name),
        f"'data.source' is {source!r}: after 'hf:' give a Hugging Face dataset id or a local folder without "
        "spaces, e.g. hf:ylecun/mnist or hf:/data/my-dataset",
    )
    missing = [m for m in HF_MODULES if importlib.util.find_spec(m) is None]
    _check(
        not missing,
        f"'data.source' is {source!r}, which is read through flwr-datasets, but "
        f"{', '.join(repr(m) for m in missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
        'install the optional extra with  pip install -e ".[hf]"  (in the app folder), or use a '
        "built-in source (docs/data.md)",
    )


# --------------------------------------------------------------------------- loading


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping may not repeat a key (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports unhashable keys
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key '{key}' (line {line}; first at line {seen[key]}): remove one of them",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """YAML text -> data, rejecting duplicate keys (yaml.YAMLError naming the key and its line)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass


def read_config_text(p: Path) -> str:
    """A config file's text: a binary file or one that is not UTF-8 is a ConfigError naming the file."""
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"config file {p}: cannot be read ({exc.strerror or exc}); pass a readable YAML file"
        ) from exc
    if b"\x00" in data:
        raise ConfigError(
            f"config file {p}: is a binary file, not YAML text; pass a YAML config (e.g. configs/default.yaml)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p}: is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "save it as UTF-8"
        ) from exc


def load_config(path: str | os.PathLike | None, overrides: list[str] | str | None = None) -> ExperimentConfig:
    """Read a YAML file (None: all defaults), apply ``key.sub=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        try:
            loaded = parse_yaml(read_config_text(p))
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        raw = loaded
    for item in split_overrides(overrides):
        apply_override(raw, item)
    return config_from_dict(raw)


def resolve_config_path(path: str | os.PathLike) -> Path:
    """An absolute path as is; a relative one against the working directory, then the app folder."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, APP_DIR / p]
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"config file '{path}' not found (looked at: {tried}); pass an existing YAML file")


def split_overrides(overrides: list[str] | str | None) -> list[str]:
    """Overrides as a list: a list stays, a string is split on whitespace."""
    if not overrides:
        return []
    if isinstance(overrides, str):
        return overrides.split()
    return [o for item in overrides for o in item.split()] if any(" " in o for o in overrides) else list(overrides)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, lists, booleans)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value (e.g. client.lr=0.01)")
    key, _, text = item.partition("=")
    key = key.strip().replace("-", "_")
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': value is not valid YAML: {exc}") from exc
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(raw: Mapping[str, Any]) -> ExperimentConfig:
    """Build and validate a config from a nested dict (unknown keys are errors)."""
    cfg = _build_dataclass(ExperimentConfig, raw, prefix="")
    cfg.data.root = data_root(cfg.data.root)
    validate(cfg)
    return cfg


def data_root(root: str) -> str:
    """``data.root`` as sent to the clients: a path starting with ``~`` is kept as written, so that every machine
    expands it to its OWN home (in deployment the config is loaded on the SuperLink host); any other relative path
    is made absolute where the config is loaded (clients may run in another working directory)."""
    return root if root.startswith("~") else str(Path(root).resolve())


def _params_sections(key: str, value: Any) -> dict[str, Any]:
    """``strategy.params`` as plain data: strategy name -> its mapping (keys with '-' read as '_').

    Which names are strategies, and what their keys mean, is the registry's business (strategies.resolve);
    values that are not mappings are kept as they are so that it can say what is wrong with them.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"'{key}' must be a mapping of strategy name -> parameters "
            f"(e.g. {key}.cwfedavg.wdr_lambda=10), got {value!r}"
        )
    out: dict[str, Any] = {}
    for name, section in value.items():
        if isinstance(section, Mapping):
            section = {str(k).replace("-", "_"): v for k, v in section.items()}
        out[str(name).replace("-", "_")] = {} if section is None else section
    return out


def _build_dataclass(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"unknown key '{prefix}{key}'{did_you_mean(key, known)}; allowed keys here: {', '.join(sorted(known))}"
            )
        f = known[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build_dataclass(type(default), value or {}, prefix=f"{prefix}{name}.")
        elif name == "params" and cls is StrategyConfig:
            kwargs[name] = _params_sections(f"{prefix}params", value)
        else:
            value = _yaml_bool_as_choice(value, f.metadata.get(CHOICES))
            kwargs[name] = _coerce(f"{prefix}{name}", value, default)
    return cls(**kwargs)


# The words YAML 1.1 (PyYAML) reads as booleans when unquoted: `privacy: {mode: off}` arrives as False.
YAML_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def _yaml_bool_as_choice(value: Any, choices: Any) -> Any:
    """A boolean where the setting's choices name exactly one of YAML's words for it: that choice (so an unquoted
    ``off`` reads as the choice ``off``). Anything else is returned as it came, for ``_coerce`` to judge."""
    if not isinstance(value, bool) or not isinstance(choices, tuple):
        return value
    words = [c for c in choices if isinstance(c, str) and c.lower() in YAML_BOOL_WORDS[value]]
    return words[0] if len(words) == 1 else value


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check a scalar/list against the type of its default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"'{key}' must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"'{key}' must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ConfigError(f"'{key}' must be finite, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"'{key}' must be a string, got {value!r}")
        return str(value)
    if isinstance(default, list):
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        return list(value)
    return value


# --------------------------------------------------------------------------- validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def did_you_mean(value: object, allowed: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` naming the allowed value(s) closest to a misspelt one; "" when none is close."""
    import difflib

    names = [str(a) for a in allowed]
    close = difflib.get_close_matches(str(value), names, n=2, cutoff=0.75)
    if not close:
        close = [n for n in names if str(value).lower() == n.lower()]
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _one_of(key: str, value: str, allowed: tuple[str, ...] | list[str]) -> None:
    hint = (
        " (YAML reads an unquoted on/off/yes/no/true/false as a boolean: quote the value)"
        if value in ("True", "False")
        else did_you_mean(value, allowed)
    )
    _check(value in allowed, f"'{key}' is '{value}', which is not known; allowed: {', '.join(allowed)}{hint}")


def validate(cfg: ExperimentConfig) -> None:
    """Raise ConfigError on the first invalid value (a pure check: ``cfg`` is not changed).

    What needs a registry is checked where the registry lives, by ``strategies.resolve``: ``strategy.name`` and
    ``strategy.params`` (the strategies), the ``data`` section (``fedapps.data.check_spec``, which clients run
    too) and the model names (``fedapps.models.check_model_names``)."""
    _check(cfg.rounds > 0, f"'rounds' must be a positive integer, got {cfg.rounds}")
    _check(
        cfg.evaluate_every >= 1,
        f"'evaluate_every' must be a positive integer (1: every round), got {cfg.evaluate_every}",
    )
    _check(cfg.seed >= 0, f"'seed' must be >= 0, got {cfg.seed}")
    _check(bool(cfg.output_dir), "'output_dir' must not be empty")
    check_run_name(cfg.run_name)
    check_tracking(cfg.tracking)

    s = cfg.strategy
    _check(bool(s.name), "'strategy.name' must not be empty")
    _check(0.0 < s.fraction <= 1.0, f"'strategy.fraction' must be in (0, 1], got {s.fraction}")
    _check(s.min_clients >= 1, f"'strategy.min_clients' must be >= 1, got {s.min_clients}")
    _check(s.timeout > 0, f"'strategy.timeout' must be > 0 seconds, got {s.timeout}")
    _check(
        s.expected_clients >= 0,
        f"'strategy.expected_clients' must be >= 0 (0: data.num_clients), got {s.expected_clients}",
    )
    _check(s.connect_timeout > 0, f"'strategy.connect_timeout' must be > 0 seconds, got {s.connect_timeout}")
    _one_of("strategy.aggregation", s.aggregation, AGGREGATION_RULES)
    _check(0.0 <= s.trim_fraction < 0.5, f"'strategy.trim_fraction' must be in [0, 0.5), got {s.trim_fraction}")
    _check(
        0.0 < s.max_weight_share <= 1.0,
        f"'strategy.max_weight_share' must be in (0, 1] (1 = no cap), got {s.max_weight_share}",
    )
    _check(
        s.clip_update_norm >= 0,
        f"'strategy.clip_update_norm' must be >= 0 (an L2 norm; 0 = no clipping), got {s.clip_update_norm}",
    )
    _check(
        0.0 <= cfg.min_measured_share <= 1.0,
        f"'min_measured_share' must be in [0, 1] (the share of data.num_clients the headline must be measured "
        f"on; 0: at least one client), got {cfg.min_measured_share}",
    )
    _one_of("strategy.transport", s.transport, TRANSPORTS)

    d = cfg.data  # the data section itself is checked once, by fedapps.data.check_spec (see strategies.resolve)
    if d.source.startswith(HF_SOURCE_PREFIX):  # early, before any data is read: the optional extra is installed
        check_hf_source(d.source)
    _check(d.num_clients > 0, f"'data.num_clients' must be a positive integer, got {d.num_clients}")
    _check(s.min_clients <= d.num_clients, exceeds_clients("strategy.min_clients", s.min_clients, d.num_clients))
    _check(
        s.expected_clients <= d.num_clients,
        exceeds_clients("strategy.expected_clients", s.expected_clients, d.num_clients),
    )
    check_trim(s, d.num_clients)

    c = cfg.client
    _check(c.epochs >= 0, f"'client.epochs' must be >= 0, got {c.epochs}")
    _check(c.batch_size > 0, f"'client.batch_size' must be a positive integer, got {c.batch_size}")
    _check(c.lr > 0, f"'client.lr' must be > 0, got {c.lr}")
    _one_of("client.optimizer", c.optimizer, OPTIMIZERS)
    _check(c.momentum >= 0, f"'client.momentum' must be >= 0, got {c.momentum}")
    _check(c.weight_decay >= 0, f"'client.weight_decay' must be >= 0, got {c.weight_decay}")
    _check(c.clip_norm >= 0, f"'client.clip_norm' must be >= 0 (0 = no clipping), got {c.clip_norm}")
    _one_of("client.device", c.device, DEVICES)
    _check(
        not (c.mixed_precision and c.device == "cpu"),
        "'client.mixed_precision: true' applies to CUDA devices only, but 'client.device' is 'cpu'; "
        "set client.device to 'auto' or 'cuda', or remove client.mixed_precision",
    )
    check_privacy(cfg.privacy, c)


def check_privacy(p: PrivacyConfig, client: ClientConfig) -> None:
    """The ``privacy`` section: a known mode, σ and the C's in range, δ in (0, 1), a budget >= 0; with a mode on, its
    optional extra installed, and under ``sample`` no bf16 autocast (the per-sample gradients are computed in
    float32)."""
    _one_of("privacy.mode", p.mode, PRIVACY_MODES)
    _check(
        p.noise_multiplier > 0,
        f"'privacy.noise_multiplier' must be > 0 (σ, in units of privacy.max_grad_norm), got {p.noise_multiplier}",
    )
    _check(p.max_grad_norm > 0, f"'privacy.max_grad_norm' must be > 0 (C, an L2 norm), got {p.max_grad_norm}")
    _check(
        p.clip_norm >= 0, f"'privacy.clip_norm' must be >= 0 (C, a Frobenius norm; 0 = sqrt(rows)), got {p.clip_norm}"
    )
    _check(0.0 < p.delta < 1.0, f"'privacy.delta' must be in (0, 1), got {p.delta}")
    _check(p.epsilon_budget >= 0, f"'privacy.epsilon_budget' must be >= 0 (0 = no budget), got {p.epsilon_budget}")
    if p.mode == "off":
        return
    missing = [m for m in PRIVACY_MODULES[p.mode] if importlib.util.find_spec(m) is None]
    _check(
        not missing,
        f"'privacy.mode' is '{p.mode}', which needs {', '.join(repr(m) for m in missing)}: install "
        'the optional extra with  pip install -e ".[privacy]"  (in the app folder)',
    )
    _check(
        not (client.mixed_precision and p.mode == "sample"),
        f"'privacy.mode: {p.mode}' computes per-sample gradients in float32; remove "
        "client.mixed_precision (bf16 autocast)",
    )


def cohort_size(connected: int, fraction: float, min_clients: int) -> int:
    """Clients sampled per round out of ``connected``: ceil(fraction·N), at least min_clients, at most N."""
    return min(connected, max(min_clients, math.ceil(fraction * connected)))


def trimmed_per_side(trim_fraction: float, k: int) -> int:
    """How many of k values per coordinate a trimmed mean drops at each end: floor(trim_fraction·k)."""
    return int(trim_fraction * k)


def smallest_trim(k: int) -> float:
    """The smallest fraction (in thousandths) that trims one of k values at each end; 0.5 or more when none can."""
    fraction = math.ceil(1000 / k) / 1000
    while trimmed_per_side(fraction, k) < 1:
        fraction = round(fraction + 0.001, 3)
    return fraction


def check_trim(s: StrategyConfig, num_clients: int) -> None:
    """``strategy.aggregation: trimmed-mean`` must trim at least one client at each end at the round's cohort size
    (a fraction that trims none is the plain unweighted mean: a robust setting that silently does nothing). An
    error, not a silent round-up: the fraction the user asked for is what config.yaml records as having run."""
    if s.aggregation != "trimmed-mean":
        return
    k = cohort_size(num_clients, s.fraction, s.min_clients)
    if trimmed_per_side(s.trim_fraction, k) >= 1:
        return
    cohort = f"the cohort of {k} clients per round (data.num_clients={num_clients}, strategy.fraction={s.fraction:g})"
    smallest = smallest_trim(k)
    if smallest >= 0.5:
        raise ConfigError(
            f"'strategy.aggregation: trimmed-mean' cannot trim any client from {cohort}: trimming one "
            "at each end needs at least 3 clients per round; use strategy.aggregation=median, or sample "
            "more clients per round"
        )
    raise ConfigError(
        f"'strategy.trim_fraction: {s.trim_fraction:g}' trims no client from {cohort} "
        f"(floor({s.trim_fraction:g}·{k}) = 0: the plain unweighted mean); set strategy.trim_fraction to "
        f"at least {smallest:g} (trims {trimmed_per_side(smallest, k)} at each end), or use "
        "strategy.aggregation=median"
    )


def exceeds_clients(
    key: str, value: int, num_clients: int, why: str = "a run cannot wait for more clients than the federation has"
) -> str:
    """The error of a count ``key`` above ``data.num_clients``, naming both ways out as overrides."""
    return (
        f"'{key}' ({value}) exceeds 'data.num_clients' ({num_clients}): {why}; lower it "
        f"(--set {key}={num_clients}) or raise the clients (--set data.num_clients={value})"
    )


def unused_settings(cfg: ExperimentConfig, named: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """``(key, why)`` for each key outside ``data`` that is set (a value other than its default, or a dotted key in
    ``named``: the overrides) but has no effect under the rest of the config (e.g. ``strategy.trim_fraction`` with
    ``strategy.aggregation: mean``). Knows no strategy: ``strategies.ignored_settings`` adds the rest."""
    defaults = ExperimentConfig()

    def is_set(key: str, value: Any, default: Any) -> bool:
        return key in named or value != default

    out: list[tuple[str, str]] = []
    s, ds = cfg.strategy, defaults.strategy
    if is_set("strategy.trim_fraction", s.trim_fraction, ds.trim_fraction) and s.aggregation != "trimmed-mean":
        out.append(
            (
                "strategy.trim_fraction",
                (f"only strategy.aggregation 'trimmed-mean' trims; this run aggregates by '{s.aggregation}'"),
            )
        )
    if is_set("strategy.max_weight_share", s.max_weight_share, ds.max_weight_share) and s.aggregation != "mean":
        out.append(
            (
                "strategy.max_weight_share",
                (f"the cap applies to strategy.aggregation 'mean'; '{s.aggregation}' weighs every client equally"),
            )
        )
    if is_set("tracking_dir", cfg.tracking_dir, defaults.tracking_dir) and not cfg.tracking:
        out.append(("tracking_dir", "no tracker is on ('tracking' is empty)"))
    other_mode = {"max_grad_norm": "client", "clip_norm": "sample"}  # each mode's own C
    for f in fields(PrivacyConfig):
        key = f"privacy.{f.name}"
        if f.name == "mode" or not is_set(key, getattr(cfg.privacy, f.name), getattr(defaults.privacy, f.name)):
            continue
        if cfg.privacy.mode == "off":
            out.append((key, "privacy.mode is 'off'"))
        elif other_mode.get(f.name) == cfg.privacy.mode:
            out.append((key, f"privacy.mode '{cfg.privacy.mode}' does not use it"))
    c = cfg.client
    if is_set("client.momentum", c.momentum, defaults.client.momentum) and c.optimizer != "sgd":
        out.append(("client.momentum", f"only client.optimizer 'sgd' uses it; the optimizer is '{c.optimizer}'"))
    return out


def check_tracking(names: list[Any]) -> None:
    """``tracking``: known tracker names, each once, whose packages are installed (they are an optional extra)."""
    for name in names:
        _check(
            isinstance(name, str),
            f"'tracking' must be a list of tracker names ({', '.join(TRACKERS)}), got the item {name!r}",
        )
        _one_of("tracking", name, tuple(TRACKERS))
    _check(len(set(names)) == len(names), f"'tracking' lists a tracker twice ({names}); name each once")
    missing = [name for name in names if importlib.util.find_spec(TRACKERS[name]) is None]
    modules = ", ".join(repr(TRACKERS[name]) for name in missing)
    whose = "its package is" if len(missing) == 1 else "their packages are"
    _check(
        not missing,
        f"'tracking' lists {', '.join(missing)}, but {whose} not installed (no module {modules}): "
        'install the optional extra with  pip install -e ".[tracking]"  (in the app folder), '
        "or remove it from 'tracking'",
    )


def check_run_name(name: str) -> None:
    """``run_name`` names one folder inside the output folder: no path, no '..', not blank ('' = derived)."""
    if name == "":
        return
    fix = "use a plain folder name such as 'fedavg-test' (letters, digits, '-', '_', '.')"
    if not name.strip():
        raise ConfigError(f"'run_name' is blank ({name!r}); leave it out to derive one, or {fix}")
    if name != name.strip():
        raise ConfigError(f"'run_name' {name!r} starts or ends with spaces; {fix}")
    if any(sep in name for sep in ("/", "\\", os.sep)) or os.path.isabs(name) or (os.altsep and os.altsep in name):
        raise ConfigError(
            f"'run_name' {name!r} contains a path separator; it must stay inside the output folder: {fix}"
        )
    if name in (".", "..") or set(name) == {"."}:
        raise ConfigError(f"'run_name' {name!r} would leave the run folder inside the output folder; {fix}")
    if "\x00" in name or any(ord(ch) < 32 for ch in name):
        raise ConfigError(f"'run_name' {name!r} contains control characters; {fix}")


# where a run is written and how its outcome is judged, not what it computes
HASH_EXCLUDED = ("run_name", "output_dir", "tracking", "tracking_dir", "min_measured_share")
# keys added after results were recorded: left out of the hash (and of a resumed run's comparison) while at these
# defaults, so that a config that does not use them keeps the hash it had before they existed
LATER_KEYS: dict[tuple[str, str], Any] = {
    ("data", "num_classes"): 0,
    ("data", "input_shape"): [],
    ("data", "public_path"): "",
    ("strategy", "expected_clients"): 0,
    ("strategy", "connect_timeout"): 300.0,
    ("strategy", "transport"): "float32",
    ("strategy", "clip_update_norm"): 0.0,
    ("data", "node_registry"): "",
    ("privacy", "clip_norm"): 0.0,
}


# a strategy's parameters added after results were recorded, whose default is what the strategy did before they
# existed: (strategy, parameter) -> default, left out like LATER_KEYS while at it
LATER_PARAMS: dict[tuple[str, str], Any] = {
    ("cosmos", "recluster_every"): 0,
    ("cosmos", "architectures"): "ignore",
}


# top-level keys added after results were recorded: left out like LATER_KEYS while at these defaults
LATER_TOP_KEYS: dict[str, Any] = {"evaluate_every": 1}
# keys that moved to another place after results were recorded: (old dotted path, new top-level key). A dump made
# before the move is read as if it held the new key (resuming compares like with like); the hash writes the value
# back at its old place wherever that section exists, so that runs recorded before the move keep their hash.
MOVED_KEYS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("strategy", "params", "cosmos", "eval_every"), "evaluate_every"),  # COSMOS's own before it served every strategy
)


def _section(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The nested dict at ``path`` in a dump, or None."""
    node: Any = data
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def with_moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A dump (nested dict) with every :data:`MOVED_KEYS` value found at its old place moved to its new key (a copy;
    a dump that holds the new key keeps it)."""
    out = copy.deepcopy(data)
    for (*parent, old), new in MOVED_KEYS:
        section = _section(out, tuple(parent))
        if section is not None and old in section:
            value = section.pop(old)
            out.setdefault(new, value)
    return out


# whole sections added after results were recorded: left out, like LATER_KEYS, while every key holds its default
LATER_SECTIONS: dict[str, Any] = {"privacy": dataclasses.asdict(PrivacyConfig())}


def without_later_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A dumped config (nested dict) without the :data:`LATER_KEYS` that hold their default and the
    :data:`LATER_SECTIONS` that hold theirs (a copy)."""
    out = with_moved_keys(data)
    for key, default in LATER_TOP_KEYS.items():
        if key in out and out[key] == default:
            del out[key]
    for section, default in LATER_SECTIONS.items():  # first: a later key of such a section is in its default
        # a section dumped before one of its keys existed lacks it: a missing key held its (later) default
        if isinstance(out.get(section), dict) and {**default, **out[section]} == default:
            del out[section]
    for (section, key), default in LATER_KEYS.items():
        if isinstance(out.get(section), dict) and key in out[section] and out[section][key] == default:
            del out[section][key]
    for (name, key), default in LATER_PARAMS.items():
        params = _section(out, ("strategy", "params", name))
        if params is not None and key in params and params[key] == default:
            del params[key]
    return out


def config_hash(cfg: ExperimentConfig) -> str:
    """sha256 of the config as dumped (every section, strategy params included), without ``run_name``, ``output_dir``,
    ``tracking``, ``tracking_dir`` and ``data.root`` (where things are written and read): two runs with the same hash
    compute the same thing. Pass the RESOLVED config (``strategies.resolve(cfg).config(cfg)``, what config.yaml holds)
    so that filled-in defaults count."""
    data = {k: v for k, v in without_later_defaults(cfg.to_dict()).items() if k not in HASH_EXCLUDED}
    for (*parent, old), new in MOVED_KEYS:  # written back where it was before it moved (see MOVED_KEYS)
        section = _section(data, tuple(parent))
        if section is not None:
            section[old] = data.pop(new, LATER_TOP_KEYS.get(new))
    data["data"] = {k: v for k, v in data["data"].items() if k != "root"}  # where the files are, not what is computed
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def with_strategy_params(cfg: ExperimentConfig, name: str, values: Mapping[str, Any]) -> ExperimentConfig:
    """A copy of ``cfg`` whose ``strategy.params.<name>`` section is ``values`` (``cfg`` is not changed)."""
    params = {**cfg.strategy.params, name: dict(values)}
    return dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, params=params))


def dump_yaml(cfg: ExperimentConfig) -> str:
    """The config as YAML (the ServerApp dumps it with the chosen strategy's section filled in)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
