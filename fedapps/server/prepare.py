"""A run's preparation, one call from the config file to what runs (:func:`prepare_run`): the config loaded
with its overrides, ``strategy.name`` and every ``strategy.params`` section checked against the strategy registry
(:func:`resolve`, ConfigError naming the key), the keys set but not read reported (:func:`report_ignored`) and the
config with the chosen strategy's params written out in full. The registry (name -> strategy class) is given by the
caller (``strategies.STRATEGIES``): the core names no algorithm."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedapps.config import (
    ConfigError,
    ExperimentConfig,
    did_you_mean,
    load_config,
    split_overrides,
    unused_settings,
    with_strategy_params,
)
from fedapps.data import DataError, check_spec, spec_info, unused_data_keys
from fedapps.importpath import is_import_path
from fedapps.models import check_model_names, check_user_model
from fedapps.server.strategy import PersonalisedStrategy, RunContext

Registry = Mapping[str, type[PersonalisedStrategy]]


@dataclass(frozen=True)
class PreparedRun:
    """A run's checked config (the chosen strategy's params written out in full: config.yaml) and its strategy."""

    cfg: ExperimentConfig
    strategy: ResolvedStrategy


def prepare_run(config_path: str | None, overrides: str | list[str], registry: Registry) -> PreparedRun:
    """Load the config (``overrides``: dotted ``key=value`` items), resolve its strategy in ``registry``, warn about
    every key set but not read, and return the config to run with its resolved strategy."""
    cfg = load_config(config_path, overrides)
    resolved = resolve(cfg, registry)
    report_ignored(cfg, split_overrides(overrides))
    return PreparedRun(resolved.config(cfg), resolved)


@dataclass(frozen=True)
class ResolvedStrategy:
    """The strategy class ``strategy.name`` names and its checked, typed params."""

    cls: type[PersonalisedStrategy]
    params: Any

    @property
    def name(self) -> str:
        return self.cls.name

    def config(self, cfg: ExperimentConfig) -> ExperimentConfig:
        """A copy of ``cfg`` with the chosen strategy's section written out in full (defaults filled in)."""
        return with_strategy_params(cfg, self.cls.name, dataclasses.asdict(self.params))

    def build(self, cfg: ExperimentConfig, context: RunContext | None = None) -> PersonalisedStrategy:
        """The strategy object for ``cfg``, with these params and the run's ``context`` (None: its defaults)."""
        return self.cls(cfg, self.params, context)


def resolve(cfg: ExperimentConfig, registry: Registry) -> ResolvedStrategy:
    """Check a loaded config's ``data`` section, model names, ``strategy.name`` and ``strategy.params``; raise
    ConfigError (or its DataError / ModelError) naming the key.

    Every section of ``strategy.params`` must be named after a known strategy and is checked against that
    strategy's ``Params`` (so a typo in a section not used by this run is still caught); only the chosen
    strategy's section is used, and its ``check_config`` hook runs against the whole config.
    """
    check_spec(dataclasses.asdict(cfg.data))
    check_model_names(cfg.model.name, list(cfg.model.per_client))
    check_user_models(cfg)
    name = cfg.strategy.name
    if name not in registry:
        raise ConfigError(
            f"'strategy.name' is '{name}', which is not known{did_you_mean(name, registry)}; allowed: "
            f"{', '.join(sorted(registry))}"
        )
    sections = cfg.strategy.params
    for key, section in sections.items():
        if key in registry:
            if key != name:
                registry[key].read_params(cfg)
            continue
        owners = [s for s, c in sorted(registry.items()) if key in {f.name for f in dataclasses.fields(c.Params)}]
        if owners or not isinstance(section, Mapping):
            owner = name if name in owners or not owners else owners[0]
            users = (
                f" ({', '.join(owners)} {'has' if len(owners) == 1 else 'have'} a parameter '{key}')" if owners else ""
            )
            raise ConfigError(
                f"'strategy.params.{key}': strategy params are namespaced by strategy, write "
                f"'strategy.params.<strategy>.{key}', e.g. 'strategy.params.{owner}.{key}'{users}; in YAML: "
                f"params: {{{owner}: {{{key}: ...}}}}"
            )
        raise ConfigError(
            f"'strategy.params.{key}' names no known strategy; its sections are named after "
            f"strategies: {', '.join(sorted(registry))}"
        )
    cls = registry[name]
    return ResolvedStrategy(cls, cls.params_from(cfg))


def check_user_models(cfg: ExperimentConfig) -> None:
    """Every user's model the config names (``model.name`` / ``model.per_client`` entries ``package.module:factory``)
    built once for the data's classes and input shape and run on a batch (ModelError naming the key otherwise). Under
    data.source 'nodes' before the nodes have described their data, only imported (``check_model_names``)."""
    named = [("model.name", cfg.model.name)] + [
        (f"model.per_client[{i}]", n) for i, n in enumerate(cfg.model.per_client)
    ]
    users = [(key, name) for key, name in named if is_import_path(name)]
    if not users:
        return
    try:
        num_classes, shape = spec_info(dataclasses.asdict(cfg.data))
    except DataError:
        return
    for key, name in users:
        check_user_model(name, num_classes, shape, key)


def ignored_settings(cfg: ExperimentConfig, overrides: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(key, why)`` for every key set, yet not read by this run: what the chosen model family ignores
    (``model.name`` where ``model.per_client`` names every client's architecture), what the data's source and
    partition ignore, and keys the rest of the config switches off. "Set": a value other than the key's default,
    or named in ``overrides``; a config's ``model.name`` that is one of its ``model.per_client`` is the documented
    default architecture, not a setting. Pure; :func:`report_ignored` logs them."""
    named = {str(item).partition("=")[0].strip().replace("-", "_") for item in split_overrides(list(overrides))}
    defaults = ExperimentConfig()
    out = [(key, why) for key, why in unused_settings(cfg, named)]
    m = cfg.model
    if m.per_client and ("model.name" in named or m.name not in m.per_client):
        owner = f"strategy '{cfg.strategy.name}' lets clients run different models"
        out.append(
            (
                "model.name",
                (
                    f"model.per_client {list(m.per_client)} gives every client its architecture "
                    f"({owner}); to run one architecture everywhere, list only it "
                    f"(--set model.per_client={m.name})"
                ),
            )
        )
    data = dataclasses.asdict(cfg.data)
    out += [
        (f"data.{key}", why)
        for key, why in unused_data_keys(
            data, dataclasses.asdict(defaults.data), {k.removeprefix("data.") for k in named if k.startswith("data.")}
        )
    ]
    return out


CONFIG_LOG = logging.getLogger("fedapps.config")  # warnings about the config itself (the same however often checked)


def report_ignored(cfg: ExperimentConfig, overrides: Sequence[str] = ()) -> list[str]:
    """Log one warning per key of :func:`ignored_settings` (naming the key, its value and why it has no effect);
    returns the messages."""
    messages = [f"'{key}' = {_value(cfg, key)!r} is ignored: {why}" for key, why in ignored_settings(cfg, overrides)]
    for message in messages:
        CONFIG_LOG.warning("%s", message)
    return messages


def _value(cfg: ExperimentConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
