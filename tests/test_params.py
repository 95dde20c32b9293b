"""Declared strategy parameters (fedapps.params) and their resolution by the registry (strategies.resolve)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from fedapps.config import ConfigError, config_from_dict, dump_yaml, load_config
from fedapps.params import param, parse_params
from strategies import STRATEGIES, resolve

PREFIX = "strategy.params.demo"


@dataclass
class Demo:
    lr: float = param(1e-3, gt=0)
    epochs: int = param(1, ge=0)
    share: float = param(0.5, gt=0, lt=1)
    cap: float = param(1.0, le=2)
    below: float = param(0.0, lt=3)
    prob: float = param(0.3, ge=0, le=1)
    mode: str = param("mean", choices=("mean", "median"))
    model: str = param("cnn", choices=lambda: ("cnn", "mlp"))  # a registry, read when checked
    kind: str = param("bias", choices=("bias", "true"), normalise=lambda v: str(v).lower())
    flag: bool = True


@pytest.mark.parametrize(
    "key, bad, boundary, needle",
    [
        ("lr", 0, 1e-9, "must be > 0"),
        ("epochs", -1, 0, "must be >= 0"),
        ("share", 1, 0.999, "must be in (0, 1)"),
        ("share", 0, 0.001, "must be in (0, 1)"),
        ("cap", 2.5, 2, "must be <= 2"),
        ("below", 3, 2.99, "must be < 3"),
        ("prob", 1.01, 1, "must be in [0, 1]"),
        ("prob", -0.01, 0, "must be in [0, 1]"),
        ("mode", "vote", "median", "allowed: mean, median"),
        ("model", "resnet99", "mlp", "allowed: cnn, mlp"),
    ],
)
def test_each_constraint_rejects_with_the_full_key_and_accepts_the_boundary(key, bad, boundary, needle):
    with pytest.raises(ConfigError) as exc:
        parse_params(Demo, {key: bad}, PREFIX)
    assert f"'{PREFIX}.{key}'" in str(exc.value) and needle in str(exc.value) and str(bad) in str(exc.value)
    assert getattr(parse_params(Demo, {key: boundary}, PREFIX), key) == boundary


def test_defaults_types_and_normalisers():
    assert parse_params(Demo, None, PREFIX) == Demo()
    assert parse_params(Demo, {"kind": True}, PREFIX).kind == "true"  # YAML's bare true, lower-cased
    assert parse_params(Demo, {"kind": "BIAS"}, PREFIX).kind == "bias"
    assert parse_params(Demo, {"epochs": 3.0}, PREFIX).epochs == 3
    with pytest.raises(ConfigError, match=r"'strategy\.params\.demo\.epochs' must be an integer"):
        parse_params(Demo, {"epochs": "many"}, PREFIX)
    with pytest.raises(ConfigError, match=r"'strategy\.params\.demo\.flag' must be true or false"):
        parse_params(Demo, {"flag": "yes"}, PREFIX)


def test_unknown_key_in_a_section_names_it_and_the_allowed_keys():
    with pytest.raises(ConfigError) as exc:
        parse_params(Demo, {"lrr": 1}, PREFIX)
    assert "strategy.params.demo.lrr" in str(exc.value) and "lr" in str(exc.value)
    with pytest.raises(ConfigError, match=r"unknown key 'strategy\.params\.cosmos\.kmeans'"):
        resolve(config_from_dict({"strategy": {"name": "cosmos", "params": {"cosmos": {"kmeans": 3}}}}))


def test_real_params_name_the_full_key():
    cfg = config_from_dict(
        {"strategy": {"name": "cosmos", "params": {"cosmos": {"distill_lr": 0}}}, "data": {"public_fraction": 0.2}}
    )
    with pytest.raises(
        ConfigError,
        match=r"'strategy\.params\.cosmos\.distill_lr' must be > 0 "
        r"\(learning rate of the client distillation\), got 0",
    ):
        resolve(cfg)


def test_unknown_strategy_section_lists_the_known_strategies():
    with pytest.raises(ConfigError) as exc:
        resolve(config_from_dict({"strategy": {"name": "fedavg", "params": {"cosmoss": {"b0": 1}}}}))
    msg = str(exc.value)
    assert "strategy.params.cosmoss" in msg and all(name in msg for name in STRATEGIES)


def test_flat_old_style_key_says_params_are_namespaced_and_shows_the_fix():
    with pytest.raises(ConfigError) as exc:
        resolve(load_config("configs/cwfedavg.yaml", ["strategy.name=fedavg", "strategy.params.layers=output"]))
    msg = str(exc.value)
    assert (
        "namespaced" in msg and "strategy.params.<strategy>.layers" in msg and "strategy.params.cwfedavg.layers" in msg
    )
    # a flat key no strategy knows, with a scalar value, gets the same hint
    with pytest.raises(ConfigError, match="namespaced"):
        resolve(config_from_dict({"strategy": {"name": "fedavg", "params": {"nonsense": 1}}}))


def test_section_for_a_strategy_without_parameters():
    with pytest.raises(ConfigError, match="strategy 'fedavg' has no parameters"):
        resolve(config_from_dict({"strategy": {"name": "local", "params": {"fedavg": {"lr": 1}}}}))
    resolve(config_from_dict({"strategy": {"name": "fedavg", "params": {"fedavg": {}}}}))  # empty is fine


def test_other_sections_are_checked_but_ignored():
    resolved = resolve(load_config("configs/cwfedavg.yaml", ["strategy.name=fedavg"]))  # the cwfedavg section stays
    assert resolved.name == "fedavg"
    with pytest.raises(ConfigError, match=r"strategy\.params\.cwfedavg\.wdr_lambda"):
        resolve(
            load_config("configs/cwfedavg.yaml", ["strategy.name=fedavg", "strategy.params.cwfedavg.wdr_lambda=-1"])
        )


def test_override_sets_one_strategys_value():
    cfg = load_config(
        "configs/cwfedavg.yaml", ["strategy.params.cwfedavg.wdr_lambda=10", "strategy.params.cosmos.b0=0.3"]
    )
    assert resolve(cfg).params.wdr_lambda == 10.0
    assert cfg.strategy.params["cosmos"] == {"b0": 0.3}


def test_inherited_strategies_read_their_own_section():
    # fedrep and fedbabu extend fedper; each has its own Params and section
    cfg = load_config("configs/fedrep.yaml", ["strategy.params.fedbabu.finetune_epochs=3"])
    assert resolve(cfg).params.head_epochs == 5
    cfg = load_config("configs/fedrep.yaml", ["strategy.name=fedbabu", "strategy.params.fedbabu.finetune_epochs=3"])
    assert resolve(cfg).params.finetune_epochs == 3
    with pytest.raises(ConfigError, match="has no parameters"):
        resolve(load_config("configs/fedrep.yaml", ["strategy.name=fedper", "strategy.params.fedper.head_epochs=1"]))


def test_every_strategy_declares_its_params_with_defaults_that_pass():
    for name, cls in STRATEGIES.items():
        assert dataclasses.is_dataclass(cls.Params), name
        assert parse_params(cls.Params, None, f"strategy.params.{name}") == cls.Params()


def test_resolve_does_not_change_the_config_and_the_dump_fills_defaults():
    cfg = load_config("configs/ifca.yaml")
    before = dataclasses.replace(cfg)
    resolved = resolve(cfg)
    assert cfg == before and cfg.strategy.params == {"ifca": {"clusters": 2}}
    dumped = yaml.safe_load(dump_yaml(resolved.config(cfg)))
    assert dumped["strategy"]["params"]["ifca"] == dataclasses.asdict(resolved.params)
    cosmos = resolve(
        load_config("configs/cwfedavg.yaml", ["strategy.name=cosmos", "data.public_fraction=0.2", "model.name=cnn"])
    )
    full = yaml.safe_load(dump_yaml(cosmos.config(load_config("configs/cwfedavg.yaml"))))["strategy"]["params"]
    assert full["cosmos"]["server_model"] == "vgg16" and full["cwfedavg"]["layers"] == "output"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["strategy.params.ifca.clusters=99"], "data.num_clients"),
        (["strategy.params.ifca.clusters=0"], "'strategy.params.ifca.clusters' must be >= 1"),
    ],
)
def test_cross_config_checks_run_in_the_hook(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        resolve(load_config("configs/ifca.yaml", overrides))
    assert needle in str(exc.value)
