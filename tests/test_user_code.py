"""The user's own model and data by import path: ``model.name: package.module:factory`` and ``data.source:
package.module:loader`` (the models and loaders are in tests/user_code.py, written as a user writes them).

- every way a name can be wrong is refused when the config is checked, naming the key (exit 2 from `fedapps run`);
- the user route is the built-in route: a loader returning the built-in digits and a factory returning the zoo's MLP
  give the same run, round for round, as ``digits`` and ``mlp``;
- a user's model runs under every strategy, or is refused with the reason by the strategies that need a classifier
  head it does not have (and runs under every strategy that does not);
- it runs through `fedapps run` with the in-process engine, and with `flwr run` (Ray workers import it through
  PYTHONPATH: tests/test_cli_processes.py, whose two concurrent `flwr run`s include it)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_in_process, write_config
from fedapps.config import config_from_dict, load_config
from fedapps.data import DataError, build_federation
from fedapps.flower.inprocess import InProcessGrid
from fedapps.importpath import load_callable
from fedapps.models import ModelError, build_model, classifier_name
from fedapps.models.zoo import USER_MODEL_KEY
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from fedapps_tools import cli
from strategies import STRATEGIES, RunContext, resolve

TESTS = Path(__file__).resolve().parent
DATA = {"source": "user_code:digits_dataset", "partition": "iid", "num_clients": 4}


def cfg_of(model: str = "user_code:tiny_net", source: str = "user_code:digits_dataset", strategy: str = "fedavg"):
    return config_from_dict(
        {"strategy": {"name": strategy}, "data": {**DATA, "source": source}, "model": {"name": model}}
    )


# ------------------------------------------------------------------------------------------------ errors


def test_import_paths_that_cannot_be_loaded_are_refused_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "broken_module.py").write_text("import numpy\nraise RuntimeError('needs a GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "user_code": "not an import path: write package.module:callable",
        "user_code:": "not an import path",
        "user code:tiny_net": "not an import path",
        "no_such_package.models:net": "there is no module 'no_such_package.models' here: it must be importable by "
        "every process of the run",
        "broken_module:net": "importing 'broken_module' failed: RuntimeError: needs a GPU driver",
        "user_code:tiny_nett": "has no attribute 'tiny_nett'; its callables: ",
        "user_code:TinyNet.nope": "user_code:TinyNet (",
        "user_code:NOT_CALLABLE": "not callable (an object of type int)",
    }
    for ref, text in cases.items():
        with pytest.raises(ModelError) as err:
            load_callable(USER_MODEL_KEY, ref, ModelError)
        assert str(err.value).startswith(f"'{USER_MODEL_KEY}' is {ref!r}"), err.value
        assert text in str(err.value), (ref, str(err.value))
    assert "PYTHONPATH" in str(pytest.raises(ModelError, load_callable, USER_MODEL_KEY, "nope:f", ModelError).value)
    assert load_callable(USER_MODEL_KEY, "user_code:TinyNet", ModelError).__name__ == "TinyNet"


@pytest.mark.parametrize(
    ("model", "text"),
    [
        ("user_code:returns_a_dict", "whose factory returned a dict, not a torch.nn.Module"),
        ("user_code:wrong_outputs", "its model returns (2, 11), but it must return logits of shape (2, 10)"),
        ("user_code:takes_nothing", "cannot be called as factory(num_classes, input_shape)"),
        ("user_code:no_such_factory", "has no attribute 'no_such_factory'"),
        ("absent_package:net", "there is no module 'absent_package' here"),
    ],
)
def test_a_wrong_factory_is_refused_when_the_config_is_checked(model, text):
    with pytest.raises(ModelError) as err:
        resolve(cfg_of(model=model))
    assert f"'model.name' is {model!r}" in str(err.value) and text in str(err.value), str(err.value)


def test_a_wrong_per_client_entry_names_its_index():
    cfg = config_from_dict(
        {
            "strategy": {"name": "local"},
            "data": DATA,
            "model": {"per_client": ["user_code:tiny_net", "user_code:wrong_outputs"]},
        }
    )
    with pytest.raises(ModelError, match=r"'model\.per_client\[1\]' is 'user_code:wrong_outputs'"):
        resolve(cfg)


@pytest.mark.parametrize(
    ("source", "text"),
    [
        ("user_code:returns_a_string", "whose loader returned a str; it must return (images, labels)"),
        ("user_code:channels_last", "looks channels-last (N×H×W×C); give N×C×H×W"),
        ("user_code:float_labels", "the labels have dtype torch.float64; give integer class indices"),
        ("user_code:raises", "the loader raised FileNotFoundError: /data/my-set/train.npz"),
        ("user_code:tiny_net", "whose loader needs the argument(s) num_classes, input_shape"),
        ("absent_package.data:load", "there is no module 'absent_package.data' here"),
    ],
)
def test_a_wrong_loader_is_refused_when_the_config_is_checked(source, text):
    with pytest.raises(DataError) as err:
        resolve(cfg_of(source=source))
    assert f"'data.source' is {source!r}" in str(err.value) and text in str(err.value), str(err.value)


def test_fedapps_run_exits_2_naming_the_key(tmp_path, capsys):
    cfg = write_config(tmp_path / "cfg.yaml", model={"name": "absent_package.models:net"})
    code = cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "config error: 'model.name' is 'absent_package.models:net', but there is no module" in err, err
    cfg = write_config(tmp_path / "cfg2.yaml", data={"source": "user_code:raises"})
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path / "out")]) == 2
    assert "config error: 'data.source' is 'user_code:raises': the loader raised" in capsys.readouterr().err


def test_a_client_that_cannot_import_the_model_says_what_to_do():
    """What a client replies when its process cannot import the model the message names (its error reply's reason,
    which the run's summary lists under 'problems')."""
    with pytest.raises(ModelError) as err:
        build_model("absent_package.models:net", 10, (1, 8, 8), seed=0)
    assert "install its package" in str(err.value) and "PYTHONPATH" in str(err.value), err.value


# ------------------------------------------------------------------------------------------------ the route itself


def test_the_head_of_a_users_model_is_its_last_linear_with_one_output_per_class():
    model = build_model("user_code:tiny_net", 10, (1, 8, 8), seed=0)
    assert classifier_name(model) == "out"
    cosine = build_model("user_code:tiny_net+cosine", 10, (1, 8, 8), seed=0)
    assert type(cosine.out).__name__ == "CosineClassifier" and classifier_name(cosine) == "out"
    headless = build_model("user_code:headless_net", 10, (1, 8, 8), seed=0)
    with pytest.raises(ModelError, match="has no nn.Linear layer"):
        classifier_name(headless)
    wrong = build_model("user_code:wrong_outputs", 10, (1, 8, 8), seed=0)
    with pytest.raises(ModelError, match="last nn.Linear '1' with 11 outputs, not the 10 classes"):
        classifier_name(wrong)
    # seeded as the zoo's models are: the same seed, the same weights; another seed, others
    a, b, c = (build_model("user_code:tiny_net", 10, (1, 8, 8), seed=s) for s in (3, 3, 4))
    assert torch.equal(a.out.weight, b.out.weight) and not torch.equal(a.out.weight, c.out.weight)


def test_a_dataset_loader_gives_its_samples_in_order_scaled_as_the_builtins():
    user = build_federation(dataclasses.asdict(cfg_of().data))
    builtin = build_federation(dataclasses.asdict(cfg_of(source="digits").data))
    # the same labels in the same order -> the same partition and splits; uint8 images scaled to [-1, 1]
    assert torch.equal(user.y, builtin.y)
    assert [i.tolist() for i in user.train_indices] == [i.tolist() for i in builtin.train_indices]
    from sklearn.datasets import load_digits

    pixels = torch.from_numpy((load_digits().images * 15).astype(np.uint8)).unsqueeze(1)
    order = torch.from_numpy(
        np.concatenate([b for tr, te in zip(user.train_indices, user.test_indices) for b in (tr, te)])
    )
    assert torch.equal(user.x, pixels[order].float() / 127.5 - 1.0)
    assert user.num_classes == 10 and user.input_shape == (1, 8, 8)


def test_the_user_route_gives_the_same_run_as_the_builtin_names(tmp_path):
    """digits and the zoo's MLP, once by their names, once through a loader and a factory of the user's that return
    the same things: every round's accuracies are the same to the last bit (same data, partition, initial weights)."""
    runs = {}
    for route, data, model in (
        ("builtin", {"source": "digits"}, "mlp"),
        ("user", {"source": "user_code:digits_arrays"}, "user_code:zoo_mlp"),
    ):
        config = write_config(tmp_path / f"{route}.yaml", rounds=2, data=data, model={"name": model}, run_name=route)
        _, folder = run_in_process(config, tmp_path / "out", InProcessGrid(4))
        runs[route] = read_csv(folder / "rounds.csv")
    keys = [k for k in runs["builtin"][0] if k.startswith(("acc", "loss")) or k.endswith(("_acc_mean", "_weighted"))]
    assert keys
    assert [{k: r[k] for k in keys} for r in runs["user"]] == [{k: r[k] for k in keys} for r in runs["builtin"]]


def test_fedapps_run_with_the_inprocess_engine(tmp_path, capsys):
    cfg = write_config(
        tmp_path / "cfg.yaml",
        strategy={"name": "fedper"},
        data={"source": "user_code:digits_dataset", "num_clients": 3},
        model={"name": "user_code:tiny_net"},
    )
    out = tmp_path / "out"
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(out), "--quiet"]) == 0
    (run,) = [d for d in out.iterdir() if (d / "summary.json").is_file()]
    assert re.fullmatch(r"fedper-user_code-digits_dataset-iid-s0-[0-9a-f]{8}", run.name), run.name
    summary = json.loads((run / "summary.json").read_text())
    assert isinstance(summary["accuracy_mean"], float) and not summary["problems"], summary
    recorded = load_config(run / "config.yaml")
    assert (recorded.model.name, recorded.data.source) == ("user_code:tiny_net", "user_code:digits_dataset")


# ------------------------------------------------------------------------------------------------ every strategy


@pytest.mark.parametrize("model", ["user_code:tiny_net", "user_code:headless_net"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.heavy
def test_a_users_model_under_every_strategy(name, model, tmp_path):
    """2 rounds with all 3 clients replying; a model without a classifier head is refused, naming the strategy and
    why, by exactly the strategies that declare they need one, and runs under all the others."""
    cls = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    section = {key: value for key, value in (("clusters", 2), ("server_epochs", 1)) if key in fields}
    params = {name: {**section, **({"server_model": "mlp"} if name == "cosmos" else {})}}
    raw = {
        "rounds": 2,
        "strategy": {"name": name, "params": params},
        "data": {**DATA, "num_clients": 3, "public_fraction": 0.2 if cls.needs_public_set else 0.0},
        "model": {"name": model},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.005},  # FedAMP's default λ/α_K (100): lr·λ/α_K < 1
    }
    cfg = config_from_dict(raw)
    if model == "user_code:headless_net" and cls.needs_classifier:
        with pytest.raises(ModelError) as err:
            resolve(cfg)
        assert f"strategy '{name}' {cls.needs_classifier}" in str(err.value) and "has no nn.Linear" in str(err.value)
        return
    resolved = resolve(cfg)
    logs: list = []
    grid = InProcessGrid(3, record=True)
    RoundDriver(resolved.build(resolved.config(cfg), RunContext(on_round=logs.append))).start(grid)
    errors = [m.error.reason for m in grid.replies if m.has_error()]
    assert not errors, f"{model} under {name}: {errors}"
    assert [len(e.replies) for e in logs] == [3, 3], f"{model} under {name}"
    assert [e.replies_rejected for e in logs] == [0, 0], f"{model} under {name}: {logs[-1].rejections}"


# ------------------------------------------------------------------------------------------------ flwr run
