"""THE SWAP TEST: every shipped config with every registered strategy (``--set strategy.name=<s>``).

Each (config, strategy) pair is loaded with small overrides (digits, 3 clients, one round, the CNN; the
config's own partition, public set and per-client models are kept, and expensive strategy defaults are
shrunk through their own ``strategy.params.<s>.*`` sections). The resolver decides per pair:

- it accepts the pair: for ``configs/*.yaml`` the pair runs one round in-process and the summary must hold a
  numeric ``accuracy_mean``; for ``configs/paper/*.yaml`` (big models and torchvision data sets, shrunk to
  the same digits/CNN setting, so a run adds nothing a ``configs/`` run does not cover) resolution only,
  to keep the whole file within a few minutes on two cores;
- it refuses the pair (e.g. a pseudo-label strategy on a config without a public set, a parameter-exchanging
  strategy on a config with ``model.per_client``): the ConfigError must name a key of the config to set.

Under the overrides many pairs are the same experiment: ``configs/fedprox.yaml`` and ``configs/fedavg.yaml`` differ
only in their own strategy's section, which a third strategy never reads. Of the pairs of one strategy whose resolved
configs are equal (every field, that strategy's parameters included; the other strategies' sections aside), the
first config in sorted order runs the round; each other pair asserts that its resolved config equals that one's,
whose own test runs it (:func:`stand_in`: about 90 runs instead of about 320, the same claims).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import pytest

import server_app
from fedapps.config import ConfigError, ExperimentConfig, load_config
from fedapps.flower.inprocess import InProcessGrid
from strategies import STRATEGIES, resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
PAPER = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs" / "paper").glob("*.yaml"))
CLIENTS = 3

# smaller than the defaults/configs where a strategy's own settings make one round expensive
SHRINK = {
    "cosmos": ["server_model=cnn", "pretrain_epochs=1", "server_epochs=1", "distill_epochs=1"],
    "fedmd": ["pretrain_epochs=1", "distill_epochs=1", "pretrain_public_epochs=0"],
    "fedct": ["pretrain_epochs=1", "distill_epochs=1"],
    "comet": ["pretrain_epochs=1", "distill_epochs=1"],
    "fedrep": ["head_epochs=1"],
    "fedbabu": ["finetune_epochs=1"],
    "fednh": ["finetune_epochs=1"],
}


def overrides_for(config: str, strategy: str) -> list[str]:
    raw = load_config(config)  # the config as shipped: which partition it uses
    out = [
        f"strategy.name={strategy}",
        "rounds=1",
        "data.source=digits",
        f"data.num_clients={CLIENTS}",
        f"strategy.min_clients={CLIENTS}",
        "client.epochs=1",
        "model.name=cnn",
        "run_name=swap",
    ]
    if raw.data.partition == "pathological":  # digits has 10 classes (e.g. Tiny ImageNet's setting: 20 per client)
        out.append(f"data.classes_per_client={min(raw.data.classes_per_client, 10)}")
    if raw.data.partition == "cosmos-groups":
        out.append(f"data.groups={min(raw.data.groups, CLIENTS)}")
    if raw.model.per_client:  # keep the mix of architectures, but only small ones
        out.append(
            "model.per_client=["
            + ",".join("mlp" if i % 2 == 0 else "cnn" for i in range(len(raw.model.per_client)))
            + "]"
        )
    out += [f"strategy.params.{strategy}.{kv}" for kv in SHRINK.get(strategy, [])]
    return out


def names_a_config_key(message: str, cfg: ExperimentConfig) -> bool:
    """Whether the message names a settable key of this config (e.g. data.public_fraction, model.per_client)."""
    for key in re.findall(r"\b(?:strategy|data|model|client)\.[A-Za-z_][\w.]*\w", message):
        parts = key.split(".")
        if parts[:2] == ["strategy", "params"] and len(parts) == 4:
            cls = STRATEGIES.get(parts[2])
            if cls is not None and parts[3] in {f.name for f in dataclasses.fields(cls.Params)}:
                return True
        elif len(parts) == 2 and parts[1] in {f.name for f in dataclasses.fields(getattr(cfg, parts[0]))}:
            return True
    return False


def refusal(cfg: ExperimentConfig) -> str | None:
    """The resolver's ConfigError message for this config, or None if it accepts it."""
    try:
        resolve(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def experiment(cfg: ExperimentConfig, strategy: str) -> str:
    """The resolved config as a canonical string, less the sections of strategies other than ``strategy`` (read by
    no one in this run): two pairs with the same string run the same experiment."""
    d = dataclasses.asdict(cfg)
    d["strategy"]["params"] = {k: v for k, v in d["strategy"]["params"].items() if k == strategy}
    return json.dumps(d, sort_keys=True, default=str)


@functools.cache
def stand_in(config: str, strategy: str) -> str:
    """The first config (sorted) whose pair with ``strategy`` runs the same experiment as ``config``'s."""
    mine = experiment(load_config(config, overrides_for(config, strategy)), strategy)
    return next(c for c in CONFIGS if experiment(load_config(c, overrides_for(c, strategy)), strategy) == mine)


def test_stand_in_tells_different_experiments_apart():
    """The dedup of the grid below cannot merge pairs that differ: a partition, a model list or the strategy's own
    parameters make two configs different experiments, another strategy's section does not."""
    assert stand_in("configs/fedprox.yaml", "fedavg") == stand_in("configs/cwfedavg.yaml", "fedavg") == CONFIGS[0]
    assert stand_in("configs/fedprox.yaml", "fedprox") == "configs/fedprox.yaml"  # its own mu is read
    assert stand_in("configs/cwfedavg.yaml", "fedprox") == CONFIGS[0]
    assert stand_in("configs/fedavg.yaml", "fedprox") == "configs/fedavg.yaml"  # iid, the others pathological


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.heavy
def test_every_config_runs_or_refuses_every_strategy(config, strategy, tmp_path):
    overrides = overrides_for(config, strategy)
    cfg = load_config(config, overrides)
    message = refusal(cfg)
    if message is not None:
        assert names_a_config_key(message, cfg), f"{config} + {strategy}: the error names no key: {message}"
        with pytest.raises(ConfigError):  # the run refuses it too, before any round
            server_app.run_experiment(InProcessGrid(CLIENTS), config, " ".join(overrides), str(tmp_path))
        return
    twin = stand_in(config, strategy)
    if twin != config:  # the same experiment as (twin, strategy), whose test runs it
        assert experiment(load_config(twin, overrides_for(twin, strategy)), strategy) == experiment(cfg, strategy)
        assert refusal(load_config(twin, overrides_for(twin, strategy))) is None
        return
    summary = server_app.run_experiment(InProcessGrid(CLIENTS), config, " ".join(overrides), str(tmp_path))
    assert summary["strategy"] == strategy and summary["rounds"] == 1
    assert isinstance(summary["accuracy_mean"], float) and 0.0 <= summary["accuracy_mean"] <= 1.0


@pytest.mark.parametrize("config", PAPER)
def test_every_paper_config_resolves_or_refuses_every_strategy(config):
    for strategy in sorted(STRATEGIES):
        cfg = load_config(config, overrides_for(config, strategy))
        message = refusal(cfg)
        if message is not None:
            assert names_a_config_key(message, cfg), f"{config} + {strategy}: the error names no key: {message}"
