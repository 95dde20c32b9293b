"""Config loading, overrides and the error messages for bad input."""

import pytest

from fedapps.config import ConfigError, config_from_dict, load_config


def test_defaults_and_overrides(tiny_config):
    cfg = load_config(tiny_config(), ["client.lr=0.01", "rounds=7", "model.per_client=[cnn,mlp]", "strategy.name=local"])
    assert cfg.client.lr == 0.01 and cfg.rounds == 7
    assert cfg.model.per_client == ["cnn", "mlp"]
    assert cfg.resolved_run_name() == "local-digits-iid-s0"


def test_default_yaml_is_valid():
    cfg = load_config("configs/default.yaml")
    assert cfg.data.source == "mnist5k"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"strategy": {"name": "fedavgg"}}, "strategy.name"),
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
        ({"strategy": {"params": {"nonsense": 1}}}, "nonsense"),
        ({"model": {"per_client": ["cnn", "mlp"]}}, "per_client"),
        ({"data": {"partition": "dirichlet", "alpha": 0}}, "data.alpha"),
    ],
)
def test_invalid_values_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    assert needle in str(exc.value)


def test_misspelt_strategy_lists_allowed():
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"strategy": {"name": "fedavgg"}})
    assert "fedavgg" in str(exc.value) and "fedavg" in str(exc.value) and "local" in str(exc.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/cfg.yaml")


def test_bad_override_syntax(tiny_config):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(tiny_config(), ["rounds"])
