"""The validation split (data.validation_fraction / data.evaluate_on) and `fedapps tune`: the split is deterministic,
stratified and carved from train only; tuning never builds the test split, picks the point that learns by its
validation accuracy, resumes without rerunning, and refuses bad grids with a message naming the key."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedapps.data.federation as federation
from fedapps.config import ConfigError, DataConfig, config_hash, load_config
from fedapps.data import DataError, build_federation, check_spec, clear_federation_cache, load_source
from fedapps.data.federation import validation_split
from fedapps.seeds import derive_rng
from fedapps_tools import cli, launch
from fedapps_tools.tune import choose_point, grid_points, parse_grid, parse_value

torch.set_num_threads(1)


def spec(**over) -> dict:
    base = dataclasses.asdict(
        DataConfig(
            source="digits",
            partition="dirichlet",
            num_clients=3,
            alpha=0.5,
            min_samples=20,
            root="/nonexistent-data-root",
        )
    )
    base.update(over)
    return base


# ------------------------------------------------------------------------------------------ the split
def test_validation_split_is_carved_from_train_stratified_and_deterministic():
    test_mode = build_federation(spec())
    val_mode = build_federation(spec(evaluate_on="validation"))
    again = build_federation(spec(evaluate_on="validation"))
    labels = load_source("digits").y.numpy()
    source_x = load_source("digits").x
    assert val_mode.eval_split == "validation" and test_mode.eval_split == "test"
    for i in range(3):
        train, test = test_mode.train_indices[i], test_mode.test_indices[i]
        fit, val = val_mode.train_indices[i], val_mode.test_indices[i]
        # deterministic for the spec
        assert np.array_equal(fit, again.train_indices[i]) and np.array_equal(val, again.test_indices[i])
        # fit + validation = the original train split; disjoint from each other and from test
        assert np.array_equal(np.sort(np.concatenate([fit, val])), np.sort(train))
        assert not set(fit) & set(val) and not set(val) & set(test) and not set(fit) & set(test)
        # stratified: each class's validation count is its share of train within rounding (largest remainder)
        n_train = np.bincount(labels[train], minlength=10)
        n_val = np.bincount(labels[val], minlength=10)
        assert np.all(np.abs(n_val - 0.15 * n_train) < 1.0), (n_val, 0.15 * n_train)
        assert val.size == round(0.15 * train.size)
        # what the client sees: fit as train, validation as "test"
        c = val_mode.client(i)
        assert torch.equal(c.test_y, torch.as_tensor(labels[val])) and torch.equal(c.test_x, source_x[val])
        assert torch.equal(c.train_y, torch.as_tensor(labels[fit]))
        assert np.array_equal(val_mode.test_counts[i], n_val)
        # seeded per client from data.seed (a constant or shared stream would pass the checks above)
        expected = validation_split(train, labels, 0.15, derive_rng(1, "validation-split", i))
        assert np.array_equal(fit, expected[0]) and np.array_equal(val, expected[1])
    # a larger fraction holds out more; with evaluate_on=test the fraction has no effect
    assert (
        build_federation(spec(evaluate_on="validation", validation_fraction=0.3)).test_counts.sum()
        > val_mode.test_counts.sum()
    )
    unaffected = build_federation(spec(validation_fraction=0.3))
    assert all(np.array_equal(a, b) for a, b in zip(unaffected.test_indices, test_mode.test_indices))
    assert all(np.array_equal(a, b) for a, b in zip(unaffected.train_indices, test_mode.train_indices))
    assert [r["split"] for r in val_mode.stats_rows()[:2]] == ["train", "validation"]


def test_validation_keys_are_checked_and_hashed():
    with pytest.raises(DataError, match=r"data\.evaluate_on='dev'.*allowed: test, validation"):
        check_spec(spec(evaluate_on="dev"))
    with pytest.raises(DataError, match=r"data\.validation_fraction=1\.0"):
        check_spec(spec(validation_fraction=1.0))
    with pytest.raises(DataError, match=r"data\.validation_fraction=0\.0 leaves no validation split.*in \(0, 1\)"):
        check_spec(spec(validation_fraction=0.0, evaluate_on="validation"))
    old = spec()
    del old["validation_fraction"], old["evaluate_on"]  # a spec from before these keys: defaults filled in
    assert check_spec(old)["evaluate_on"] == "test" and check_spec(old)["validation_fraction"] == 0.15
    with pytest.raises(ConfigError, match="evaluate_on"):
        load_config(None, ["data.evaluate_on=[1]"])
    hashes = {
        config_hash(load_config(None, o))
        for o in ([], ["data.evaluate_on=validation"], ["data.validation_fraction=0.2"])
    }
    assert len(hashes) == 3


# ------------------------------------------------------------------------------------------ tune end to end
def tune_config(tmp_path: Path) -> Path:
    """FedAvg on digits, 2 clients, 2 rounds, a tiny MLP (round 2's accuracy is after round 1's training)."""
    cfg = {
        "seed": 0,
        "rounds": 2,
        "strategy": {"name": "fedavg"},
        "data": {"source": "digits", "partition": "iid", "num_clients": 2},
        "model": {"name": "mlp"},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class GuardedX:
    """Stands in for a source's image tensor: reading any sample of a test split raises."""

    def __init__(self, x: torch.Tensor, forbidden: set[int]) -> None:
        self.x, self.forbidden = x, forbidden

    def __getitem__(self, index):
        asked = set(np.asarray(index).ravel().tolist())
        if asked & self.forbidden:
            raise AssertionError(f"{len(asked & self.forbidden)} test-split samples were read")
        return self.x[index]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tuning (2 points × 1 seed, in-process) with every test-split sample of the data unreadable."""
    tmp = tmp_path_factory.mktemp("tune")
    config = tune_config(tmp)
    data = dataclasses.asdict(load_config(config).data)
    clear_federation_cache()
    test_samples = {int(v) for t in build_federation(data).test_indices for v in t}
    real = federation.load_source
    calls = {"execute": 0}
    real_execute = launch.execute

    def guarded_source(*a, **kw):
        ds = real(*a, **kw)
        return dataclasses.replace(ds, x=GuardedX(ds.x, test_samples))

    def counting_execute(*a, **kw):
        calls["execute"] += 1
        return real_execute(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(federation, "load_source", guarded_source)
        mp.setattr(launch, "execute", counting_execute)
        clear_federation_cache()
        # the guard bites: building the test split now fails
        with pytest.raises(AssertionError, match="test-split samples were read"):
            build_federation(data)
        out = tmp / "out"
        argv = [
            "tune",
            str(config),
            "--grid",
            "client.lr=1e-9,0.1",
            "--seeds",
            "0",
            "--engine",
            "inprocess",
            "--out",
            str(out),
        ]
        rc = cli.main(argv)
        clear_federation_cache()
        files = (
            {name: (out / name).read_text() for name in ("tuning.csv", "tuning.md", "chosen.yaml")} if rc == 0 else {}
        )
        yield {"rc": rc, "out": out, "argv": argv, "calls": calls, "files": files}
    clear_federation_cache()


def test_tune_never_opens_the_test_split_and_picks_the_point_that_learns(tuned):
    assert tuned["rc"] == 0  # completed although every test-split sample was unreadable
    out, files = tuned["out"], tuned["files"]  # as written by the first tuning (another test extends the grid)
    rows = list(csv.DictReader(files["tuning.csv"].splitlines()))
    assert [(r["point"], r["seed"], r["client.lr"]) for r in rows] == [("1", "0", "1e-09"), ("2", "0", "0.1")]
    acc = [float(r["val_accuracy_mean"]) for r in rows]
    assert acc[0] < 0.3 < acc[1]  # lr 1e-9 cannot learn; lr 0.1 does
    for r in rows:
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["evaluated_on"] == "validation"
        assert float(r["val_accuracy_mean"]) == summary["accuracy_mean"]
        assert float(r["val_accuracy_weighted"]) == summary["accuracy_weighted"]
    chosen = yaml.safe_load(files["chosen.yaml"])
    assert chosen["client"]["lr"] == 0.1 and chosen["data"]["evaluate_on"] == "test"
    (out.parent / "chosen-copy.yaml").write_text(files["chosen.yaml"])
    assert load_config(out.parent / "chosen-copy.yaml").client.lr == 0.1
    md = files["tuning.md"]
    assert "| 2 | 0.1 |" in md and "**chosen**" in md.split("| 2 | 0.1 |")[1].splitlines()[0]
    assert "**chosen**" not in md.split("| 1 | 1.0e-09 |")[1].splitlines()[0]
    assert "validation" in md and "never built" in md and "first point in grid order" in md


def test_tune_resumes_finished_points(tuned, capsys):
    calls = tuned["calls"]
    assert calls["execute"] == 2
    assert cli.main(tuned["argv"]) == 0  # the same tuning again: nothing reruns
    assert calls["execute"] == 2
    assert capsys.readouterr().out.count("already complete with the same config, skipped") == 2
    argv = list(tuned["argv"])
    argv[argv.index("client.lr=1e-9,0.1")] = "client.lr=1e-9,0.1,0.05"  # one point more: only it runs
    assert cli.main(argv) == 0
    assert calls["execute"] == 3
    with (tuned["out"] / "tuning.csv").open() as fh:
        assert [r["reused"] for r in csv.DictReader(fh)] == ["True", "True", "False"]


# ------------------------------------------------------------------------------------------ rules and errors
def test_choice_rule():
    assert choose_point([0.5, 0.9, 0.7]) == 1
    assert choose_point([0.8, 0.8, 0.2]) == 0  # a tie goes to the first point in grid order
    assert choose_point([float("nan"), 0.1]) == 1  # a point without a number is never chosen
    with pytest.raises(ValueError):
        choose_point([float("nan")])


def test_grid_values_and_order():
    grid = parse_grid(["client.lr=0.01,1e-3", "strategy.params.cwfedavg.estimator=norm,bias", "client.drop-last=true"])
    assert grid == [
        ("client.lr", [0.01, 0.001]),
        ("strategy.params.cwfedavg.estimator", ["norm", "bias"]),
        ("client.drop_last", [True]),
    ]
    points = grid_points(grid)
    assert [(p["client.lr"], p["strategy.params.cwfedavg.estimator"]) for p in points] == [
        (0.01, "norm"),
        (0.01, "bias"),
        (0.001, "norm"),
        (0.001, "bias"),
    ]
    assert parse_value("5", "k") == 5 and parse_value("-2.5E+2", "k") == -250.0


@pytest.mark.parametrize(
    "grid, message",
    [
        (["client.lrr=0.1,0.2"], r"client\.lrr"),
        (["client.lr=0.1,0.2,0.3", "client.epochs=1,2"], r"6 points.*--max-points 4.*equal-budget"),
        (["seed=0,1"], r"--grid seed: cannot be tuned.*--seeds"),
        (["data.evaluate_on=test,validation"], r"data\.evaluate_on: cannot be tuned"),
        (["client.lr=0.1", "client.lr=0.2"], r"client\.lr is given twice"),
        (["client.lr=0.1,0.10"], r"client\.lr: a value is repeated"),
        (["client.lr"], r"KEY=V1,V2"),
        (["client.lr=0.1,"], r"empty value"),
        (["client.lr=0.1,-1"], r"point 2 \(client\.lr=-1\).*client\.lr"),
        (["strategy.params.ditto.lam=0.1,1"], r"strategy 'fedavg' ignores the section strategy\.params\.ditto"),
    ],
)
def test_bad_grids_exit_2_naming_the_key(tmp_path, capsys, grid, message):
    argv = ["tune", str(tune_config(tmp_path)), "--engine", "inprocess", "--out", str(tmp_path / "o"), "--grid", *grid]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "config error" in err
    assert re.search(message, err), err
    assert not (tmp_path / "o").exists()  # nothing ran


def test_tune_refuses_set_of_what_it_controls(tmp_path, capsys):
    argv = ["tune", str(tune_config(tmp_path)), "--grid", "client.lr=0.1,0.2", "--set", "data.evaluate_on=test"]
    assert cli.main(argv) == 2
    assert "data.evaluate_on" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a bad --seeds is a usage error, as any other bad option value
        cli.main(["tune", str(tune_config(tmp_path)), "--grid", "client.lr=0.1", "--seeds", "0,0"])
    assert exited.value.code == 2 and "--seeds: 0 is repeated" in capsys.readouterr().err


def test_eta_from_the_pace_of_the_steps_that_worked():
    from fedapps.reporting.results import Progress, eta_seconds, format_duration

    assert eta_seconds(30.0, 3, 5) == 50.0  # 10 s a step, 5 steps left
    assert eta_seconds(0.0, 0, 5) is None and eta_seconds(30.0, 3, -1) == 0.0
    assert [format_duration(s) for s in (None, 42, 185, 3720)] == ["?", "42s", "3m05s", "1h02m"]
    now = [0.0]
    p = Progress(4, clock=lambda: now[0])
    assert p.line() == "elapsed 0s, ETA ?"
    now[0] = 0.5
    p.step(worked=False)  # a resumed step: instant, not part of the pace
    now[0] = 20.5
    p.step()  # 20 s of work
    now[0] = 21.0
    assert p.line() == "elapsed 21s, ETA 40s"  # 2 steps left at 20 s each
