"""The config checks every strategy gets from what its class declares (:func:`check_declared`: a public set U, a
classifier head, one architecture for all, the privacy modes it supports, robust aggregation, the transport), and
its typed params read from ``strategy.params.<name>`` (:func:`read_params`). A strategy's own checks are its
``check_config`` (:class:`fedapps.server.strategy.PersonalisedStrategy`), which calls these first."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedapps.config import ConfigError, ExperimentConfig, exceeds_clients
from fedapps.data import NODES, DataError, spec_info
from fedapps.importpath import is_import_path
from fedapps.models import ModelError, check_user_model
from fedapps.params import parse_params
from fedapps.server.client_privacy import CLIENT_MODE, gaussian_epsilon

if TYPE_CHECKING:  # annotations only: the strategy contract calls these
    from fedapps.server.strategy import PersonalisedStrategy

    Strategy = type[PersonalisedStrategy]


def read_params(cls: Strategy, cfg: ExperimentConfig) -> Any:
    """Typed params from ``strategy.params.<name>`` (no section: all defaults), each declared rule checked; a moved
    parameter (``cls.moved_params``) or a section for a strategy without parameters refused, naming the fix."""
    key = f"strategy.params.{cls.name}"
    section = cfg.strategy.params.get(cls.name)
    for old, new in cls.moved_params.items():
        if isinstance(section, Mapping) and old in section:
            raise ConfigError(
                f"'{key}.{old}' is now the top-level key '{new}' (one setting for every strategy): remove "
                f"'{key}.{old}' and write '{new}: {section[old]}' at the top of the config "
                f"(or --set {new}={section[old]})"
            )
    if section and not dataclasses.fields(cls.Params):
        raise ConfigError(
            f"strategy '{cls.name}' has no parameters; remove '{key}' "
            f"(it sets {', '.join(map(str, section)) if isinstance(section, Mapping) else section!r})"
        )
    return parse_params(cls.Params, section, key)


def at_most_clients(key: str, value: int, cfg: ExperimentConfig) -> None:
    """A count parameter ``key`` (e.g. K cluster models) must not exceed ``data.num_clients``."""
    if value > cfg.data.num_clients:
        raise ConfigError(
            exceeds_clients(key, value, cfg.data.num_clients, "there are not that many clients to share out")
        )


def check_declared(cls: Strategy, cfg: ExperimentConfig) -> None:
    """What the class declares, checked against the config: one architecture unless ``model_agnostic``, the
    classifier head a user's model must have (``needs_classifier``), the public set U (``needs_public_set``), the
    privacy modes (``sample_privacy_refused``, ``client_privacy_refused``), robust aggregation
    (``robust_aggregation``) and the transport (parameters only)."""
    if cfg.model.per_client and not cls.model_agnostic:
        raise ConfigError(
            f"'model.per_client' is set but strategy '{cls.name}' exchanges model parameters, "
            "so every client must run the same 'model.name'; remove model.per_client"
        )
    if cls.needs_classifier:
        check_classifier(cls.name, cls.needs_classifier, cfg)
    if cls.needs_public_set and cfg.data.source == NODES and not cfg.data.public_path:
        raise ConfigError(
            f"strategy '{cls.name}' needs a public set U, and with data.source 'nodes' U is a file: set "
            "'data.public_path' to the server's copy of U (an .npz with 'x'); every node names its "
            "own copy in node config public-path"
        )
    if cls.needs_public_set and cfg.data.source != NODES and cfg.data.public_fraction <= 0:
        raise ConfigError(f"strategy '{cls.name}' needs a public set U: set 'data.public_fraction' in (0, 1), e.g. 0.2")
    if cfg.privacy.mode == "sample" and cls.sample_privacy_refused:
        raise ConfigError(
            f"'privacy.mode: sample' cannot cover strategy '{cls.name}': "
            f"{cls.sample_privacy_refused}, so ε would not bound what its clients send "
            "(docs/privacy.md); run it with privacy.mode off, or choose another strategy"
        )
    if cfg.privacy.mode == CLIENT_MODE:
        check_client_privacy(cls, cfg)
    s = cfg.strategy
    robust = s.aggregation != "mean" or s.max_weight_share < 1.0 or s.clip_update_norm > 0
    if not cls.robust_aggregation and robust:
        raise ConfigError(
            f"'strategy.aggregation: {s.aggregation}' / 'strategy.max_weight_share: {s.max_weight_share}' "
            f"/ 'strategy.clip_update_norm: {s.clip_update_norm}' apply to the parameter-averaging "
            f"strategies only (fedavg, fedprox, ditto, fedper, fedrep, fedbabu, ifca, cfl), not to "
            f"'{cls.name}'; remove them (defaults: mean, 1.0, 0)"
        )
    if s.transport != "float32" and cls.model_agnostic:
        raise ConfigError(
            f"'strategy.transport: {s.transport}' applies to the strategies that exchange model "
            f"parameters; '{cls.name}' sends none (its clients may run different architectures). "
            "Remove it (default float32); the pseudo-label strategies set their own wire encoding "
            "in strategy.params.<name> (e.g. encoding, uplink_encoding)"
        )


def check_client_privacy(cls: Strategy, cfg: ExperimentConfig) -> None:
    """``privacy.mode: client``: this strategy supports it, and a budget allows at least one round's release."""
    if cls.client_privacy_refused:
        raise ConfigError(
            f"'privacy.mode: client' cannot cover strategy '{cls.name}': {cls.client_privacy_refused} "
            "(docs/privacy.md); run it with privacy.mode off or sample, or choose one of those strategies"
        )
    p = cfg.privacy
    first = gaussian_epsilon(p.noise_multiplier, 1, p.delta)
    if p.epsilon_budget > 0 and first > p.epsilon_budget:
        raise ConfigError(
            f"'privacy.epsilon_budget: {p.epsilon_budget:g}' does not allow a single round: one release with "
            f"privacy.noise_multiplier {p.noise_multiplier:g} costs ε = {first:.4g} at δ = {p.delta:g}; raise "
            "the budget or the noise multiplier"
        )


def check_classifier(strategy: str, needs: str, cfg: ExperimentConfig) -> None:
    """A user's model (``model.name: package.module:factory``) for a strategy that ``needs`` its classifier head:
    refused (ModelError naming the key and the reason) when it has none. The zoo's models all have one; under
    data.source 'nodes' the check waits for the nodes' classes and shape (the strategy's construction then refuses
    it)."""
    name = cfg.model.name
    if not is_import_path(name):
        return
    try:
        num_classes, shape = spec_info(dataclasses.asdict(cfg.data))
    except DataError:
        return
    why = check_user_model(name, num_classes, shape)
    if why:
        raise ModelError(
            f"strategy '{strategy}' {needs}, but the model of 'model.name' ({name}) {why}. Make a final "
            "nn.Linear(features, num_classes) its last registered nn.Linear, or choose a strategy that exchanges "
            "whole models (e.g. fedavg, fedprox, local, ditto, ifca, cfl)"
        )
