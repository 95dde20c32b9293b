"""Config loading, overrides and the error messages for bad input."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from fedapps.config import ConfigError, ExperimentConfig, config_from_dict, load_config, validate


def test_defaults_and_overrides(tiny_config):
    cfg = load_config(
        tiny_config(), ["client.lr=0.01", "rounds=7", "model.per_client=[cnn,mlp]", "strategy.name=local"]
    )
    assert cfg.client.lr == 0.01 and cfg.rounds == 7
    assert cfg.model.per_client == ["cnn", "mlp"]
    assert cfg.resolved_run_name() == "local-digits-iid-s0"


def test_default_yaml_is_valid():
    cfg = load_config("configs/default.yaml")
    assert cfg.data.source == "mnist5k"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"data": {"source": "mnist6k"}}, "data.source"),
        ({"data": {"partition": "patho"}}, "data.partition"),
        ({"model": {"name": "resnet99"}}, "model.name"),
        ({"rounds": 0}, "rounds"),
        ({"data": {"num_clients": -3}}, "data.num_clients"),
        ({"data": {"partition": "pathological", "classes_per_client": 11}}, "classes_per_client"),
        ({"strategy": {"fraction": 1.5}}, "strategy.fraction"),
        ({"strategy": {"fraction": 0}}, "strategy.fraction"),
        ({"client": {"lr": "fast"}}, "client.lr"),
        ({"client": {"batch_size": 0}}, "client.batch_size"),
        ({"colour": "blue"}, "colour"),
        ({"client": {"optimiser": "sgd"}}, "client.optimiser"),
        ({"data": {"partition": "dirichlet", "alpha": 0}}, "data.alpha"),
    ],
)
def test_invalid_values_name_the_key(raw, needle):
    """Caught by config_from_dict, or (data section, model names) by strategies.resolve, which every entry point
    runs right after loading."""
    from strategies import resolve

    with pytest.raises(ConfigError) as exc:
        resolve(config_from_dict(raw))
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"strategy": {"name": "fedavgg"}}, "strategy.name"),
        ({"strategy": {"params": {"nonsense": 1}}}, "nonsense"),
        ({"model": {"per_client": ["cnn", "mlp"]}}, "per_client"),
    ],
)
def test_strategy_keys_are_checked_by_the_registry(raw, needle):
    """strategy.name, strategy.params and the strategy's cross-config rules: checked by strategies.resolve."""
    from strategies import resolve

    cfg = config_from_dict(raw)  # the config itself knows no strategy
    with pytest.raises(ConfigError) as exc:
        resolve(cfg)
    assert needle in str(exc.value)


def test_misspelt_strategy_lists_allowed():
    from strategies import resolve

    with pytest.raises(ConfigError) as exc:
        resolve(config_from_dict({"strategy": {"name": "fedavgg"}}))
    assert "fedavgg" in str(exc.value) and "fedavg" in str(exc.value) and "local" in str(exc.value)


def test_config_module_imports_no_strategy():
    code = (
        "import fedapps.config, sys; "
        "assert not any(m == 'strategies' or m.startswith('strategies.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('strategies'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))


def test_validate_does_not_change_the_config():
    cfg = load_config("configs/cwfedavg.yaml", ["data.root=~/somewhere/../data", "strategy.params.cosmos.b0=0.3"])
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before
    assert isinstance(cfg.strategy.params["cwfedavg"], dict)  # plain data, not the strategy's dataclass


def test_data_root_is_made_absolute_when_the_config_is_built_but_home_is_each_machines_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.root=x/../data"])
    assert cfg.data.root == str(tmp_path / "data")
    # '~' is expanded by each machine that reads the data (sources.py), never by the server for everyone
    assert load_config(None, ["data.root=~/x/../data"]).data.root == "~/x/../data"
    raw = ExperimentConfig()
    validate(raw)  # a default-built config validates as it is
    assert raw.data.root == "~/.cache/fedapps/data"


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/cfg.yaml")


def test_bad_override_syntax(tiny_config):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(tiny_config(), ["rounds"])


def test_default_yaml_is_the_tables_validation_choice_for_cwfedavg_on_its_partition():
    """configs/default.yaml says it runs cwFedAvg at the values the parameter-sharing table chose on validation for
    the pathological partition: it must be that setting with those values (the published CSV's chosen: columns),
    so that what `make run` shows is cwFedAvg as tuned, not the paper's 20-round setting."""
    import csv

    from strategies import resolve

    root = Path(__file__).resolve().parent.parent
    with open(root / "docs" / "results" / "param-sharing.csv") as f:
        row = next(r for r in csv.DictReader(f) if (r["setting"], r["method"]) == ("pathological", "cwfedavg"))
    chosen = {k.removeprefix("chosen:"): v for k, v in row.items() if k.startswith("chosen:") and v}
    default = load_config(root / "configs" / "default.yaml")
    setting = load_config(
        root / "configs" / "settings" / "param-pathological.yaml",
        ["strategy.name=cwfedavg", *(f"{k}={v}" for k, v in chosen.items())],
    )
    assert chosen.keys() == {"client.lr", "strategy.params.cwfedavg.wdr_lambda"}
    assert default.client.lr == float(chosen["client.lr"])
    assert resolve(default).params.wdr_lambda == float(chosen["strategy.params.cwfedavg.wdr_lambda"])
    for key in ("rounds", "data", "model"):  # the same setting: partition, clients, model, rounds
        assert getattr(default, key) == getattr(setting, key), key
    assert (default.client.batch_size, default.client.epochs) == (setting.client.batch_size, setting.client.epochs)


def test_unquoted_yaml_boolean_words_read_as_the_choice_they_spell(tmp_path):
    """PyYAML reads a bare `off`/`on`/`no` as a boolean: where the setting's choices hold exactly one word YAML reads as
    that boolean, the word is meant; elsewhere a boolean in a string setting is still refused, naming the key."""
    import yaml

    raw = yaml.safe_load("privacy: {mode: off}\nclient: {device: cpu}")
    assert raw["privacy"]["mode"] is False  # the YAML quirk this handles
    assert config_from_dict(raw).privacy.mode == "off"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("privacy:\n  mode: off\n")
    assert load_config(str(cfg)).privacy.mode == "off"
    assert load_config(str(cfg), ["privacy.mode=off"]).privacy.mode == "off"
    # `on` names no privacy mode: still an error that says which key
    with pytest.raises(ConfigError, match="mode"):
        config_from_dict(yaml.safe_load("privacy: {mode: on}"))
    # a string setting whose choices hold no YAML boolean word keeps refusing a boolean
    with pytest.raises(ConfigError, match="client.device' is 'False', which is not known; .*YAML reads an unquoted"):
        config_from_dict(yaml.safe_load("client: {device: off}"))
