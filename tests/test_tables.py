"""`fedapps tables`: the spec's rules (equal grid budget, tune_on), the final configs built from the tuned values,
and the report built from the comparisons and tunings."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedapps.config import ConfigError, load_config
from fedapps_tools import cli, compare, tables_report, tables_run, tables_spec

BASE = Path(__file__).resolve().parent.parent / "configs" / "fedavg.yaml"


def write_spec(tmp_path: Path, **extra) -> Path:
    spec = {
        "name": "demo",
        "settings": {"a": str(BASE), "b": str(BASE)},
        "seeds": [0, 1],
        "tune_seeds": [0],
        "methods": {
            "fedavg": {"grid": {"client.lr": [0.01, 0.1]}},
            "fedprox": {"set": ["strategy.params.fedprox.mu=0.5"], "grid": {"client.lr": [0.02, 0.2]}},
            "local": {},
        },
    }
    spec.update(extra)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


COMPARISON_COLUMNS = [
    "config",
    "strategy",
    "seeds",
    "accuracy_mean",
    "accuracy_mean_sem",
    "accuracy_weighted",
    "accuracy_weighted_sem",
    "bytes_up_per_client_round",
    "bytes_down_per_client_round",
    "wall_seconds",
]


def write_comparison(folder: Path, values: list) -> None:
    """``folder/comparison.csv`` with one row: ``values`` in the order of COMPARISON_COLUMNS."""
    tables_spec.write_csv(folder / "comparison.csv", COMPARISON_COLUMNS, [dict(zip(COMPARISON_COLUMNS, values))])


def write_run(folder: Path, keys: list[str], rows: list[tuple], summary: str = "{}") -> None:
    """A finished run folder: rounds.csv from ``rows`` (values in the order of ``keys``) and a summary.json."""
    folder.mkdir(parents=True)
    tables_spec.write_csv(folder / "rounds.csv", keys, [dict(zip(keys, r)) for r in rows])
    (folder / "summary.json").write_text(summary)


def test_grid_over_the_equal_budget_is_refused(tmp_path):
    p = write_spec(tmp_path, methods={"fedavg": {"grid": {"client.lr": [0.01, 0.1, 0.2], "client.epochs": [1, 2]}}})
    with pytest.raises(ConfigError, match="at most 4"):
        tables_spec.load_spec(p)
    assert tables_spec.grid_points({"a": [1, 2], "b": [1, 2]}) == 4
    assert all(
        yaml.safe_load(tables_spec.yaml_scalar(v)) == v for v in (1e-9, 0.1, 5, True, "norm")
    )  # exactly the budget is allowed
    tables_spec.load_spec(
        write_spec(tmp_path, methods={"fedavg": {"grid": {"client.lr": [1, 2], "client.epochs": [1, 2]}}})
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"tune_on": {"b": "zz"}},
        {"tune_on": {"b": "a", "a": "b"}},
        {"colour": 1},
        {"methods": {"fedavg": {"grids": {}}}},
        {"settings": {"a": "no-such.yaml"}},
        {"per_round": ["cluster_group_ari"]},
        {"per_round": {"cluster_group_ari": ""}},
    ],
)
def test_bad_specs_name_the_key(tmp_path, bad):
    with pytest.raises(ConfigError, match="tables spec"):
        tables_spec.load_spec(write_spec(tmp_path, **bad))


def test_final_config_takes_the_tuned_values_and_tune_on_reuses_another_setting(tmp_path):
    spec = tables_spec.load_spec(write_spec(tmp_path, tune_on={"b": "a"}))
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    fedprox = spec.methods[1]
    assert t.tune_dir("b", fedprox) == t.tune_dir("a", fedprox)
    chosen = yaml.safe_load(t.method_config("a", fedprox).read_text())
    chosen["client"]["lr"] = 0.2
    t.tune_dir("a", fedprox).mkdir(parents=True)
    (t.tune_dir("a", fedprox) / "chosen.yaml").write_text(yaml.safe_dump(chosen))
    final = t.final_config("b", fedprox)
    cfg = load_config(final)
    assert cfg.strategy.name == "fedprox" and cfg.client.lr == 0.2
    assert cfg.strategy.params["fedprox"]["mu"] == 0.5  # the method's own overrides stay
    assert load_config(t.final_config("a", spec.methods[2])).strategy.name == "local"  # no grid: the method's config


def test_the_specs_common_overrides_reach_every_method_before_its_own(tmp_path):
    spec = tables_spec.load_spec(write_spec(tmp_path, set=["client.epochs=3", "strategy.params.fedprox.mu=0.1"]))
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    fedavg, fedprox = (load_config(t.method_config("a", m)) for m in spec.methods[:2])
    assert fedavg.client.epochs == 3 and fedprox.client.epochs == 3
    assert fedprox.strategy.params["fedprox"]["mu"] == 0.5  # the method's own set wins over the spec's
    assert (
        load_config(
            tables_run.Tables(
                tables_spec.load_spec(write_spec(tmp_path)), tmp_path / "w2", "inprocess", 1
            ).method_config("a", spec.methods[0])
        ).client.epochs
        != 3
    )


def test_each_method_is_tuned_then_run_before_the_next_and_a_shared_tuning_runs_once(tmp_path, monkeypatch):
    """jobs=1: (setting, method) tasks in order, each its tuning then its seeds (its rows exist when it ends);
    b reuses a's tuning (tune_on), which runs once even when both settings are asked for; with 2 jobs b's runs
    wait for a's tuning."""
    import threading
    import time

    spec = tables_spec.load_spec(write_spec(tmp_path, tune_on={"b": "a"}))
    calls = []
    lock = threading.Lock()

    def record(kind, delay):
        def step(self, setting, m):
            time.sleep(delay)
            with lock:
                calls.append((kind, setting, m.name))

        return step

    monkeypatch.setattr(tables_run.Tables, "tune", record("tune", 0.0))
    monkeypatch.setattr(tables_run.Tables, "compare", record("compare", 0.0))
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    t.run(["a", "b"], spec.methods[:2], {"tune", "final"})
    assert calls == [
        ("tune", "a", "fedavg"),
        ("compare", "a", "fedavg"),
        ("tune", "a", "fedprox"),
        ("compare", "a", "fedprox"),
        ("compare", "b", "fedavg"),
        ("compare", "b", "fedprox"),
    ]
    calls.clear()
    monkeypatch.setattr(tables_run.Tables, "tune", record("tune", 0.3))
    tables_run.Tables(spec, tmp_path / "work", "inprocess", 2).run(["b", "a"], spec.methods[:1], {"tune", "final"})
    assert calls.count(("tune", "a", "fedavg")) == 1
    assert calls.index(("tune", "a", "fedavg")) < calls.index(("compare", "b", "fedavg"))
    calls.clear()
    t.run(["b"], spec.methods[:1], {"final"})
    assert calls == [("compare", "b", "fedavg")]


def test_report_lists_each_setting_the_chosen_values_and_the_validation_scores(tmp_path):
    spec = tables_spec.load_spec(
        write_spec(tmp_path, methods={"fedavg": {"grid": {"client.lr": [0.01, 0.1]}}}, settings={"a": str(BASE)})
    )
    work = tmp_path / "work"
    t = tables_run.Tables(spec, work, "inprocess", 1)
    m = spec.methods[0]
    tune = t.tune_dir("a", m)
    tune.mkdir(parents=True)
    raw = yaml.safe_load(t.method_config("a", m).read_text())
    raw["client"]["lr"] = 0.1
    (tune / "chosen.yaml").write_text(yaml.safe_dump(raw))
    with open(tune / "tuning.csv", "w", newline="") as f:
        w = csv.DictWriter(
            f,
            fieldnames=[
                "point",
                "seed",
                "client.lr",
                "val_accuracy_mean",
                "val_accuracy_weighted",
                "wall_seconds",
                "reused",
                "run_dir",
            ],
        )
        w.writeheader()
        w.writerows(
            [
                {
                    "point": 1,
                    "seed": 0,
                    "client.lr": 0.01,
                    "val_accuracy_mean": 0.5,
                    "val_accuracy_weighted": 0.4,
                    "wall_seconds": 3,
                    "reused": False,
                    "run_dir": "x",
                },
                {
                    "point": 2,
                    "seed": 0,
                    "client.lr": 0.1,
                    "val_accuracy_mean": 0.9,
                    "val_accuracy_weighted": 0.8,
                    "wall_seconds": 3,
                    "reused": False,
                    "run_dir": "y",
                },
            ]
        )
    cmp_dir = t.compare_dir("a", m)
    cmp_dir.mkdir(parents=True)
    with open(cmp_dir / "comparison.csv", "w", newline="") as f:
        keys = [
            "config",
            "strategy",
            "seeds",
            "accuracy_mean",
            "accuracy_mean_sem",
            "accuracy_weighted",
            "accuracy_weighted_sem",
            "accuracy_after_training_mean",
            "accuracy_after_training_mean_sem",
            "bytes_up_per_client_round",
            "bytes_down_per_client_round",
            "wall_seconds",
        ]
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerow(
            dict(zip(keys, ["fedavg", "fedavg", 2, 0.8766, 0.0123, 0.87, 0.01, 0.5, 0.25, 1048576, 2097152, 42]))
        )
    md = tables_report.report(spec, work, tmp_path / "docs").read_text()
    assert (
        "| fedavg | 0.877 ± 0.012 | 0.870 ± 0.010 | — | — | 0.500 ± 0.250 | 1.000 | 2.000 | 42 | client.lr=0.1 |" in md
    )
    assert "client.lr=0.01: 0.500; client.lr=0.1: 0.900" in md
    assert "deployed model" in md and "test split was not read" in md


@pytest.mark.heavy
def test_tables_end_to_end_tunes_runs_and_reports(tmp_path):
    """A tiny spec through the real sub-commands: tune on validation, compare on test, report, resume."""
    base = yaml.safe_load(BASE.read_text())
    base.update(rounds=2)
    base["data"].update(source="digits", num_clients=3, partition="iid")
    base["strategy"]["min_clients"] = 3
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "name": "tiny",
        "settings": {"iid": "base.yaml"},
        "seeds": [0],
        "tune_seeds": [0],
        "methods": {"fedavg": {"grid": {"client.lr": [1e-9, 0.1]}}, "local": {}},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    argv = [str(tmp_path / "spec.yaml"), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "docs")]
    assert cli.main(["tables", *argv]) == 0
    md = (tmp_path / "docs" / "tiny.md").read_text()
    assert "| fedavg |" in md and "client.lr=0.1 |" in md  # the learning point was chosen, on validation
    tuned = tmp_path / "work" / "tiny" / "iid" / "tune" / "fedavg" / "runs"
    summaries = [json.loads(p.read_text()) for p in tuned.glob("*/summary.json")]
    assert len(summaries) == 2 and {s["evaluated_on"] for s in summaries} == {"validation"}
    finals = [
        json.loads(p.read_text()) for p in (tmp_path / "work" / "tiny" / "compare").glob("iid--*/runs/*/summary.json")
    ]
    assert sorted(s["strategy"] for s in finals) == ["fedavg", "local"]
    assert {s["evaluated_on"] for s in finals} == {"test"}
    logs = sorted((tmp_path / "work" / "tiny" / "logs").glob("*.log"))
    assert [p.name for p in logs] == ["compare-iid-fedavg.log", "compare-iid-local.log", "tune-iid-fedavg.log"]
    assert "![iid: accuracy of the deployed models per round" in md and (tmp_path / "docs" / "tiny-iid.png").is_file()
    spec_ = tables_spec.load_spec(tmp_path / "spec.yaml")
    lines = tables_report.setting_lines(tables_run.Tables(spec_, tmp_path / "work" / "tiny", "inprocess", 1), "iid")
    final = {r["method"]: float(r["accuracy_mean"]) for r in tables_spec.read_rows(tmp_path / "docs" / "tiny.csv")}
    assert all(len(r["config_hash"]) == 64 for r in tables_spec.read_rows(tmp_path / "docs" / "tiny.csv"))  # the record
    curves = compare.comparison_curves(lines)
    assert [c.label for c in curves] == ["fedavg", "local"]  # one line per method, named by its label
    assert {c.label: c.mean[-1] for c in curves} == pytest.approx(final)  # the figure's last point is the table's
    assert cli.main(["tables", *argv]) == 0  # resumes: nothing is trained again
    for p in logs:
        second = p.read_text().rsplit("$ fedapps", 1)[1]
        assert "seed 0: " in second and ": running" not in second and ": rerunning" not in second


def test_report_keeps_published_rows_of_settings_whose_work_folder_is_gone(tmp_path):
    """A fresh work folder regenerates the report for what ran; the other settings keep their published rows
    (the CSVs are the durable record), and the report names them."""
    spec = tables_spec.load_spec(
        write_spec(tmp_path, methods={"fedavg": {"grid": {"client.lr": [0.01, 0.1]}}, "local": {}})
    )
    docs = tmp_path / "docs"
    docs.mkdir()
    keys = [
        "setting",
        "method",
        "config",
        "strategy",
        "seeds",
        "accuracy_mean",
        "accuracy_mean_sem",
        "accuracy_weighted",
        "accuracy_weighted_sem",
        "bytes_up_per_client_round",
        "bytes_down_per_client_round",
        "wall_seconds",
        "chosen:client.lr",
    ]
    tables_spec.write_csv(
        docs / "demo.csv",
        keys,
        [
            dict(zip(keys, ["b", "fedavg", "fedavg", "fedavg", 3, 0.61, 0.02, 0.6, 0.01, 1048576, 1048576, 9, 0.1])),
            dict(zip(keys, ["b", "local", "local", "local", 3, 0.55, 0.03, 0.5, 0.01, 0, 0, 4, ""])),
        ],
    )
    tables_spec.write_csv(
        docs / "demo-tuning.csv",
        ["setting", "method", "grid", "validation_scores"],
        [
            {
                "setting": "b",
                "method": "fedavg",
                "grid": tables_spec.grid_text(spec.methods[0]),
                "validation_scores": "client.lr=0.01: 0.3",
            }
        ],
    )
    md = tables_report.report(spec, tmp_path / "empty-work", docs).read_text()
    assert "| fedavg | 0.610 ± 0.020 | 0.600 ± 0.010 | — | — | — | 1.000 | 1.000 | 9 | client.lr=0.1 |" in md
    assert "| local | 0.550 ± 0.030 |" in md and "(no grid) |" in md
    assert "## a\n\nnot run yet" in md  # nothing invented for the setting that has no record
    assert "Carried over" in md and "b (all methods)" in md
    assert "| fedavg | b | client.lr ∈ {0.01, 0.1} | client.lr=0.01: 0.3 |" in md
    again = tables_spec.read_rows(docs / "demo.csv")  # the record survives its own regeneration unchanged
    assert [(r["setting"], r["method"], r["accuracy_mean"], r["chosen:client.lr"]) for r in again] == [
        ("b", "fedavg", "0.61", "0.1"),
        ("b", "local", "0.55", ""),
    ]
    assert tables_spec.read_rows(docs / "demo-tuning.csv")[0]["validation_scores"] == "client.lr=0.01: 0.3"


def test_published_rows_that_no_longer_match_the_spec_are_withdrawn_not_carried(tmp_path):
    """A carried row stands only for the method the spec defines now: a row tuned over another grid and a hash-less
    row of a method whose spec withdraws such rows are each replaced by 'not run yet' with the reason, and dropped
    from the CSV; a row of the same config hash is carried as it is, one of another hash carried with a mark."""
    methods = {
        "fedavg": {"grid": {"client.lr": [0.01, 0.1]}},
        "local": {},
        "fedprox": {"set": ["strategy.params.fedprox.mu=0.5"]},
        "cw": {"set": ["strategy.name=fedavg", "rounds=7"], "withdrawn_rows": "it ran 2 rounds\n before"},
    }
    spec = tables_spec.load_spec(write_spec(tmp_path, methods=methods, settings={"a": str(BASE)}))
    by_name = {m.name: m for m in spec.methods}
    docs = tmp_path / "docs"
    docs.mkdir()
    probe = tables_run.Tables(spec, tmp_path / "probe", "inprocess", 1)
    local_hash = probe.final_hash("a", by_name["local"])
    keys = [
        "setting",
        "method",
        "config",
        "strategy",
        "seeds",
        "accuracy_mean",
        "accuracy_mean_sem",
        "accuracy_weighted",
        "accuracy_weighted_sem",
        "bytes_up_per_client_round",
        "bytes_down_per_client_round",
        "wall_seconds",
        "config_hash",
        "chosen:client.lr",
        "chosen:client.epochs",
    ]
    rows = [["fedavg", "0.1", "2"], ["local", "", ""], ["fedprox", "", ""], ["cw", "", ""]]
    hashes = {"fedavg": "", "local": local_hash, "fedprox": "0" * 64, "cw": ""}
    tables_spec.write_csv(
        docs / "demo.csv",
        keys,
        [dict(zip(keys, ["a", n, n, n, 3, 0.6, 0.01, 0.6, 0.01, 0, 0, 1, hashes[n], lr, ep])) for n, lr, ep in rows],
    )
    tables_spec.write_csv(
        docs / "demo-tuning.csv",
        ["setting", "method", "grid", "validation_scores"],
        [
            {
                "setting": "a",
                "method": "fedavg",
                "grid": "client.lr ∈ {0.01, 0.1} × client.epochs ∈ {1, 2}",
                "validation_scores": "x",
            }
        ],
    )
    md = tables_report.report(spec, tmp_path / "work", docs).read_text()
    assert (
        "| fedavg | not run yet; the published row was withdrawn (fedavg is now tuned over client.lr ∈ {0.01, 0.1})"
        in md
    )
    assert "| local | 0.600 ± 0.010 |" in md  # same hash: carried
    assert "| fedprox † | 0.600 ± 0.010 |" in md and "refreshes them: fedprox." in md
    assert "| cw | not run yet; the published row was withdrawn (it ran 2 rounds before) |" in md
    assert sorted(r["method"] for r in tables_spec.read_rows(docs / "demo.csv")) == ["fedprox", "local"]
    assert "Carried over" in md and "a (fedprox, local)" in md


def test_a_published_choice_stands_in_for_a_lost_tuning_only_over_the_same_grid(tmp_path, monkeypatch):
    """`tune_on: {b: a}` with a's tuning known only from the published record: b's final config takes a's
    published values (typed, not strings) and a is not tuned again; a record tuned over another grid is not used."""
    spec = tables_spec.load_spec(
        write_spec(tmp_path, tune_on={"b": "a"}, methods={"fedavg": {"grid": {"client.lr": [0.01, 0.1]}}})
    )
    m = spec.methods[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    keys = ["setting", "method", "config", "accuracy_mean", "chosen:client.lr"]
    tables_spec.write_csv(docs / "demo.csv", keys, [dict(zip(keys, ["a", "fedavg", "fedavg", 0.7, "0.1"]))])
    tuning = docs / "demo-tuning.csv"
    tables_spec.write_csv(
        tuning,
        ["setting", "method", "grid", "validation_scores"],
        [{"setting": "a", "method": "fedavg", "grid": tables_spec.grid_text(m), "validation_scores": "x"}],
    )
    calls = []
    monkeypatch.setattr(tables_run, "fedapps", lambda args, log, jobs=1: calls.append(args))
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs)
    t.run(["b"], spec.methods, {"tune"})
    assert calls == []  # a's published choice stands; nothing is tuned
    assert load_config(t.final_config("b", m)).client.lr == 0.1
    assert (
        tables_run.Tables(spec, tmp_path / "work", "inprocess", 1).recorded_choice("a", m) is None
    )  # no --out: no record
    tables_spec.write_csv(
        tuning,
        ["setting", "method", "grid", "validation_scores"],
        [{"setting": "a", "method": "fedavg", "grid": "client.lr ∈ {0.5}", "validation_scores": "x"}],
    )
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs)
    with pytest.raises(RuntimeError, match="run the tuning stage first"):
        t.final_config("b", m)
    t.run(["b"], spec.methods, {"tune"})
    assert len(calls) == 1 and calls[0][0] == "tune"  # another grid: tuned afresh


def test_a_published_choice_made_for_another_config_of_the_method_is_tuned_again(tmp_path, monkeypatch):
    """The published row of (a, fedavg) was measured with a config whose hash differs from what its choice makes today
    (an option of the method changed since): its choice does not stand in for a tuning; with today's hash it does."""
    spec = tables_spec.load_spec(write_spec(tmp_path, methods={"fedavg": {"grid": {"client.lr": [0.01, 0.1]}}}))
    m = spec.methods[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    keys = ["setting", "method", "config", "accuracy_mean", "chosen:client.lr", "config_hash"]
    tables_spec.write_csv(
        docs / "demo-tuning.csv",
        ["setting", "method", "grid", "validation_scores"],
        [{"setting": "a", "method": "fedavg", "grid": tables_spec.grid_text(m), "validation_scores": "x"}],
    )
    calls = []
    monkeypatch.setattr(tables_run, "fedapps", lambda args, log, jobs=1: calls.append(args))

    def tune_with_published_hash(value: str) -> tables_run.Tables:
        row = dict(zip(keys, ["a", "fedavg", "fedavg", 0.7, "0.1", value]))
        tables_spec.write_csv(docs / "demo.csv", keys, [row])
        t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs)
        t.run(["a"], spec.methods, {"tune"})
        return t

    today = tune_with_published_hash("0" * 64).final_hash("a", m)  # the published choice applied to today's config
    assert len(calls) == 1
    tune_with_published_hash(today)
    assert len(calls) == 1 and calls[0][0] == "tune"  # the stale hash: tuned; today's hash: the choice stands


def test_a_published_row_of_the_same_final_config_is_not_run_again(tmp_path, monkeypatch):
    """The final stage skips a setting × method whose published row carries the hash of today's final config (a run
    made in an earlier clone), and runs it when the config changed since, or when asked to rerun published rows."""
    spec = tables_spec.load_spec(write_spec(tmp_path, methods={"local": {}}, settings={"a": str(BASE)}))
    m = spec.methods[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs)
    keys = ["setting", "method", "config", "accuracy_mean", "config_hash"]
    calls = []
    monkeypatch.setattr(tables_run, "fedapps", lambda args, log, jobs=1: calls.append(args))
    for recorded, runs in ((t.final_hash("a", m), 0), ("0" * 64, 1)):
        tables_spec.write_csv(docs / "demo.csv", keys, [dict(zip(keys, ["a", "local", "local", 0.5, recorded]))])
        tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs).run(["a"], spec.methods, {"final"})
        assert len(calls) == runs
    assert calls[0][0] == "compare"
    tables_spec.write_csv(
        docs / "demo.csv", keys, [dict(zip(keys, ["a", "local", "local", 0.5, t.final_hash("a", m)]))]
    )
    rerun = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs, rerun_published=True)
    rerun.run(["a"], spec.methods, {"final"})
    assert len(calls) == 2 and calls[1][0] == "compare"  # --rerun-published: reproduced, not skipped


def test_a_standing_row_of_a_method_whose_rows_were_withdrawn_says_how_to_measure_it_again(
    tmp_path, monkeypatch, capsys
):
    """A change of an algorithm's code keeps its config hash: where the spec withdraws a method's earlier rows and a
    published row of today's hash stands, the final stage says so and names --rerun-published; without a
    withdrawal it says nothing more."""
    for withdrawn, noted in (("its coupling changed", True), (None, False)):
        body = {"withdrawn_rows": withdrawn} if withdrawn else {}
        spec = tables_spec.load_spec(write_spec(tmp_path, methods={"local": body}, settings={"a": str(BASE)}))
        docs = tmp_path / "docs"
        docs.mkdir(exist_ok=True)
        t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs)
        keys = ["setting", "method", "config", "accuracy_mean", "config_hash"]
        row = dict(zip(keys, ["a", "local", "local", 0.5, t.final_hash("a", spec.methods[0])]))
        tables_spec.write_csv(docs / "demo.csv", keys, [row])
        monkeypatch.setattr(tables_run, "fedapps", lambda args, log, jobs=1: pytest.fail("nothing should run"))
        capsys.readouterr()
        tables_run.Tables(spec, tmp_path / "work", "inprocess", 1, docs).run(["a"], spec.methods, {"final"})
        out = capsys.readouterr().out
        assert "the published row of the same config stands" in out
        assert ("--rerun-published" in out and "its coupling changed" in out) == noted, out


def test_fairness_columns_are_recomputed_from_the_runs_per_client_accuracies(tmp_path):
    """Runs whose summary.json predates the fairness columns: the worst 10 % and std over clients come from the
    last measured round's acc_client_<i> (not an earlier round, not the best clients), mean ± SEM over runs."""
    folders = []
    for seed, last in ((0, [0.2, 0.9, 0.8, 0.7]), (1, [0.4, 0.9, 0.9, 0.9])):
        d = tmp_path / f"m-s{seed}"
        d.mkdir()
        keys = ["round", "acc_mean"] + [f"acc_client_{i}" for i in range(4)]
        tables_spec.write_csv(
            d / "rounds.csv",
            keys,
            [dict(zip(keys, [1, 0.1, 0.0, 0.0, 0.0, 0.0])), dict(zip(keys, [2, sum(last) / 4, *last])), {"round": 3}],
        )  # a row with no measurement comes last
        (d / "summary.json").write_text("{}")
        folders.append(d)
    got = tables_report.fairness_from_runs(folders)
    assert got["accuracy_worst10"] == pytest.approx(0.3) and got["accuracy_worst10_sem"] == pytest.approx(0.1)
    std0, std1 = np.std([0.2, 0.9, 0.8, 0.7]), np.std([0.4, 0.9, 0.9, 0.9])  # population std
    assert got["accuracy_std"] == pytest.approx((std0 + std1) / 2)


def test_runs_that_lost_replies_are_flagged_in_the_report(tmp_path):
    """A table row whose runs missed replies or skipped a round (a round that timed out) is marked, and the
    report names each such run; complete runs are not."""
    spec = tables_spec.load_spec(
        write_spec(tmp_path, methods={"fedavg": {}}, settings={"a": str(BASE)}, seeds=[0, 1, 2])
    )
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    m = spec.methods[0]
    runs = t.compare_dir("a", m) / "runs"
    keys = ["round", "acc_mean", "replies_missing", "skipped"]
    lost = {
        0: [(1, 0.5, 0, 0), (2, 0.6, 0, 0)],
        1: [(1, 0.5, 3, 0), (2, 0.6, 0, 0)],
        2: [(1, 0.5, 0, 0), (2, "", 4, 1)],
    }
    for seed, rows in lost.items():
        write_run(runs / f"fedavg-s{seed}", keys, rows)
    assert tables_report.delivery_shortfalls(sorted(runs.iterdir())) == [
        "seed 1: 3 replies missing",
        "seed 2: 4 replies missing, rounds skipped [2]",
    ]
    write_comparison(t.compare_dir("a", m), ["fedavg", "fedavg", 3, 0.6, 0.01, 0.6, 0.01, 1048576, 1048576, 9])
    md = tables_report.report(spec, tmp_path / "work", tmp_path / "docs").read_text()
    assert "| fedavg ⚠ | 0.600 ± 0.010 |" in md
    assert "fedavg: seed 1: 3 replies missing, seed 2: 4 replies missing, rounds skipped [2]." in md
    for seed in (1, 2):  # rerun complete
        tables_spec.write_csv(runs / f"fedavg-s{seed}" / "rounds.csv", keys, [dict(zip(keys, r)) for r in lost[0]])
    md = tables_report.report(spec, tmp_path / "work", tmp_path / "docs").read_text()
    assert "| fedavg | 0.600 ± 0.010 |" in md and "lost replies" not in md


def test_a_per_round_column_is_tabled_per_method_and_round_over_the_seeds(tmp_path):
    """A spec's ``per_round`` column: one table per setting, a cell per (method, round) holding the mean ± SEM over
    the seeds' runs of that round's value (not another round's, not the last), rounds a run lacks left out of its
    mean; a method whose runs never recorded the column has no row, nor one whose comparison has not finished; every
    cell is a row of <name>-per-round.csv, which stands in for the runs of rows carried over."""
    spec = tables_spec.load_spec(
        write_spec(
            tmp_path,
            methods={"fedavg": {}, "local": {}, "fedprox": {}},
            settings={"a": str(BASE)},
            seeds=[0, 1],
            per_round={"cluster_group_ari": "clusters against the groups (ARI)"},
        )
    )
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    fedavg, local, _ = spec.methods
    keys = ["round", "acc_mean", "cluster_group_ari"]
    write_run(t.compare_dir("a", fedavg) / "runs" / "fedavg-s0", keys, [(1, 0.5, 0.2), (2, 0.6, 0.6), (3, 0.7, 1.0)])
    write_run(t.compare_dir("a", fedavg) / "runs" / "fedavg-s1", keys, [(1, 0.5, 0.4), (2, 0.6, ""), (3, 0.7, 0.8)])
    write_run(t.compare_dir("a", local) / "runs" / "local-s0", ["round", "acc_mean"], [(1, 0.5), (2, 0.6)])
    unfinished = t.compare_dir("a", spec.methods[2]) / "runs" / "fedprox-s0"  # its comparison is still running
    write_run(unfinished, keys, [(1, 0.5, 0.7)])
    for m in (fedavg, local):
        write_comparison(t.compare_dir("a", m), [m.name, m.name, 2, 0.6, 0.01, 0.6, 0.01, 1048576, 1048576, 9])
    md = tables_report.report(spec, tmp_path / "work", tmp_path / "docs").read_text()
    assert "**clusters against the groups (ARI)** (`cluster_group_ari`), a, per round" in md
    assert "| method | round 1 | round 2 | round 3 |" in md
    assert "| fedavg | 0.300 ± 0.100 | 0.600 ± 0.000 | 0.900 ± 0.100 |" in md  # sample std / sqrt(2)
    assert "| local | 0.5" not in md.split("per round")[1] and "| fedprox | 0.7" not in md
    with (tmp_path / "docs" / "demo-per-round.csv").open() as fh:
        got = [(r["method"], int(r["round"]), float(r["mean"]), float(r["sem"])) for r in csv.DictReader(fh)]
    assert got == [
        ("fedavg", 1, pytest.approx(0.3), pytest.approx(0.1)),
        ("fedavg", 2, 0.6, 0.0),
        ("fedavg", 3, pytest.approx(0.9), pytest.approx(0.1)),
    ]
    published = (tmp_path / "docs" / "demo-per-round.csv").read_text()
    md = tables_report.report(spec, tmp_path / "gone", tmp_path / "docs").read_text()  # the runs' folder is gone
    assert "| fedavg | 0.300 ± 0.100 | 0.600 ± 0.000 | 0.900 ± 0.100 |" in md
    assert "Carried over from the published `demo-per-round.csv`: fedavg." in md
    assert (tmp_path / "docs" / "demo-per-round.csv").read_text() == published


def test_figures_keep_the_published_one_for_carried_settings_and_name_the_curves_they_lack(tmp_path):
    """Setting a: fedavg ran here, local is carried over → a figure of fedavg that says local is not drawn.
    Setting b: every row carried over → the published figure is linked and left as it was, not redrawn."""
    spec = tables_spec.load_spec(write_spec(tmp_path, methods={"fedavg": {}, "local": {}}))
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    fedavg = spec.methods[0]
    for seed in (0, 1):
        write_run(
            t.compare_dir("a", fedavg) / "runs" / f"fedavg-s{seed}",
            ["round", "acc_mean"],
            [(1, 0.5), (2, 0.6)],
            summary='{"strategy": "fedavg"}',
        )
    write_comparison(t.compare_dir("a", fedavg), ["fedavg", "fedavg", 2, 0.6, 0.01, 0.6, 0.01, 1048576, 1048576, 9])
    docs = tmp_path / "docs"
    docs.mkdir()
    rec = ["setting", "method", "config", *COMPARISON_COLUMNS[3:]]
    tables_spec.write_csv(
        docs / "demo.csv",
        rec,
        [
            dict(zip(rec, [s, m, m, 0.5, 0.01, 0.5, 0.01, 0, 0, 3]))
            for s, m in (("a", "local"), ("b", "fedavg"), ("b", "local"))
        ],
    )
    (docs / "demo-b.png").write_bytes(b"published figure")
    md = tables_report.report(spec, tmp_path / "work", docs).read_text()
    assert "(not drawn: local, carried over without their runs)](demo-a.png)" in md and (
        docs / "demo-a.png"
    ).read_bytes().startswith(b"\x89PNG")
    assert "(published with the carried-over rows)](demo-b.png)" in md
    assert (docs / "demo-b.png").read_bytes() == b"published figure"
    # a published caption that says more (what the kept figure lacks) is kept with the figure, report after report
    (docs / "demo.md").write_text(
        md.replace("(published with the carried-over rows)](demo-b.png)", "(lacks x)](demo-b.png)")
    )
    md = tables_report.report(spec, tmp_path / "work", docs).read_text()
    assert "mean ± SEM over seeds (lacks x)](demo-b.png)" in md and "published with" not in md
    (docs / "demo-b.png").unlink()  # no published figure: no link to a file that is not there
    assert "demo-b.png" not in tables_report.report(spec, tmp_path / "work", docs).read_text()


def test_a_method_runs_only_in_its_settings_and_the_report_says_which_column_its_paper_reports(tmp_path, monkeypatch):
    """``settings:`` restricts a method (no task, no row elsewhere); ``paper_metric``/``paper_note`` become the
    table's footnote; a comparison's provenance (commit, machine) is printed under its table and kept in the CSV;
    a global-model column appears only where a row has one."""
    p = write_spec(
        tmp_path,
        settings={"a": str(BASE), "b": str(BASE)},
        methods={
            "fedavg": {"paper_metric": "deployed"},
            "fednh": {"settings": ["a"], "paper_metric": "after-training", "paper_note": "the released code's metric"},
        },
    )
    spec = tables_spec.load_spec(p)
    work = tmp_path / "work"
    t = tables_run.Tables(spec, work, "inprocess", 1)
    ran = []
    monkeypatch.setattr(tables_run.Tables, "compare", lambda self, s, m: ran.append((s, m.name)))
    t.run(["a", "b"], spec.methods, {"final"})
    assert sorted(ran) == [("a", "fedavg"), ("a", "fednh"), ("b", "fedavg")]
    for setting, name, generic in (("a", "fedavg", ""), ("a", "fednh", 0.91), ("b", "fedavg", "")):
        m = next(m for m in spec.methods if m.name == name)
        folder = t.compare_dir(setting, m)
        folder.mkdir(parents=True)
        keys = COMPARISON_COLUMNS + ["final_generic_acc_mean", "final_generic_acc_mean_sem"]
        tables_spec.write_csv(
            folder / "comparison.csv",
            keys,
            [
                dict(
                    zip(
                        keys,
                        [name, name, 3, 0.8, 0.01, 0.8, 0.01, 1048576, 1048576, 9, generic, 0.02 if generic else ""],
                    )
                )
            ],
        )
        if setting == "a":
            (folder / tables_run.PROVENANCE).write_text(
                json.dumps({"commit": "abc123", "machine": "2 CPU cores, no GPU"})
            )
    md = tables_report.report(spec, work, tmp_path / "docs" / "results").read_text()
    section_a, section_b = md.split("## a (")[1].split("## b (")
    assert "global model |" in section_a and "global model |" not in section_b  # only where a row has it
    assert "| fednh | 0.800 ± 0.010 |" in section_a and "0.910 ± 0.020 |" in section_a
    assert "fednh" not in section_b.split("## Tuning")[0]  # restricted to setting a: no row, not "not run yet"
    assert (
        "**Which column matches what each method's paper reports:** fedavg: *accuracy, deployed model*; fednh: "
        "*after local training* (the released code's metric)."
    ) in section_a
    assert "Measured with commit `abc123` on 2 CPU cores, no GPU (fedavg, fednh)." in section_a
    assert "Measured with a commit not recorded (fedavg)." in section_b
    link = md.split("[evaluation protocol](")[1].split(")")[0]  # relative to the page: it resolves wherever it is
    assert (tmp_path / "docs" / "results" / link).resolve() == tables_run.REPO / "docs" / "evaluation.md"
    rows = tables_spec.read_rows(tmp_path / "docs" / "results" / "demo.csv")
    assert [(r["setting"], r["method"], r["commit"]) for r in rows] == [
        ("a", "fedavg", "abc123"),
        ("a", "fednh", "abc123"),
        ("b", "fedavg", ""),
    ]
    with pytest.raises(ConfigError, match="methods.fednh.settings"):
        tables_spec.load_spec(write_spec(tmp_path, methods={"fednh": {"settings": ["zz"]}}))
    with pytest.raises(ConfigError, match="paper_metric 'best'"):
        tables_spec.load_spec(write_spec(tmp_path, methods={"fednh": {"paper_metric": "best"}}))


def test_provenance_names_the_checkout_commit_and_the_machine():
    got = tables_run.provenance()
    head = tables_run.subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=tables_run.REPO, capture_output=True, text=True
    ).stdout.strip()
    assert got["commit"].split("+")[0] == (head or "unknown")
    assert got["machine"].startswith(f"{tables_run.os.cpu_count()} CPU cores")


def test_published_rows_without_a_commit_name_the_commit_that_published_them(tmp_path):
    """Rows measured before comparisons recorded their commit: git blame of the published CSV names the commit that
    wrote each row (stamped as ``published_in``, so it survives the report rewriting the file)."""
    import subprocess

    spec = tables_spec.load_spec(write_spec(tmp_path, methods={"fedavg": {}, "local": {}}, settings={"a": str(BASE)}))
    docs = tmp_path / "docs"
    docs.mkdir()
    keys = [
        "setting",
        "method",
        "config",
        "strategy",
        "seeds",
        "accuracy_mean",
        "accuracy_mean_sem",
        "accuracy_weighted",
        "accuracy_weighted_sem",
        "bytes_up_per_client_round",
        "bytes_down_per_client_round",
        "wall_seconds",
    ]
    row = ["a", "fedavg", "fedavg", "fedavg", 3, 0.61, 0.02, 0.6, 0.01, 1, 1, 9]
    tables_spec.write_csv(docs / "demo.csv", keys, [dict(zip(keys, row))])

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=docs,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    git("add", "demo.csv")
    git("commit", "-qm", "first row")
    first = git("rev-parse", "--short=10", "HEAD")
    tables_spec.write_csv(
        docs / "demo.csv",
        keys,
        [dict(zip(keys, row)), dict(zip(keys, ["a", "local", "local", "local", 3, 0.5, 0.1, 0.5, 0.1, 0, 0, 4]))],
    )
    git("commit", "-qam", "second row")
    second = git("rev-parse", "--short=10", "HEAD")
    assert first != second
    md = tables_report.report(spec, tmp_path / "empty-work", docs).read_text()
    assert f"runs published in commit `{first}` (their own commit was not recorded) (fedavg)" in md
    assert f"runs published in commit `{second}` (their own commit was not recorded) (local)" in md
    assert [r["published_in"] for r in tables_spec.read_rows(docs / "demo.csv")] == [first, second]


def test_parallel_jobs_share_the_cores_between_their_in_process_engines(tmp_path, monkeypatch):
    seen = []

    class Done:
        returncode = 0

    monkeypatch.setattr(tables_run.subprocess, "run", lambda cmd, **kw: seen.append(kw["env"]) or Done())
    monkeypatch.delenv("FEDAPPS_INPROCESS_WORKERS", raising=False)
    monkeypatch.setattr(tables_run.os, "cpu_count", lambda: 8)
    for jobs, workers in ((1, "8"), (2, "4"), (3, "2"), (16, "1")):
        tables_run.fedapps(["run"], tmp_path / "log.txt", jobs)
        assert seen[-1]["FEDAPPS_INPROCESS_WORKERS"] == workers and seen[-1]["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("FEDAPPS_INPROCESS_WORKERS", "3")  # the user's own choice stands
    tables_run.fedapps(["run"], tmp_path / "log.txt", 2)
    assert seen[-1]["FEDAPPS_INPROCESS_WORKERS"] == "3"


def test_provenance_is_recorded_when_runs_finish_and_names_every_commit_of_a_resumed_comparison(tmp_path):
    """Nothing finished: the record stays. All runs new: the new record. Some runs from before with other code: both
    commits, in order, once each."""
    import os
    import time

    folder = tmp_path / "cmp"
    runs = [folder / "runs" / f"m-s{seed}" for seed in (0, 1)]
    for d in runs:
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
    old_time = time.time() - 100
    for d in runs:
        os.utime(d / "summary.json", (old_time, old_time))
    a = {"commit": "aaa", "machine": "m", "date": "d"}
    tables_run.record_provenance(folder, a, since=time.time())  # nothing finished since
    assert tables_run.read_provenance(folder) == {}
    tables_run.record_provenance(folder, a, since=old_time - 1)  # both runs finished under a
    assert tables_run.read_provenance(folder)["commit"] == "aaa"
    since = time.time() - 1
    (runs[1] / "summary.json").write_text("{}")  # seed 1 resumed and finished under b
    tables_run.record_provenance(folder, {**a, "commit": "bbb"}, since=since)
    assert tables_run.read_provenance(folder)["commit"] == "aaa, bbb"
    tables_run.record_provenance(folder, {**a, "commit": "bbb"}, since=since)
    assert tables_run.read_provenance(folder)["commit"] == "aaa, bbb"
    for d in runs:  # every run made again under c: c alone
        (d / "summary.json").write_text("{}")
    tables_run.record_provenance(folder, {**a, "commit": "ccc"}, since=since)
    assert tables_run.read_provenance(folder)["commit"] == "ccc"


def test_a_setting_can_be_a_base_config_with_overrides_of_its_own(tmp_path):
    """``settings: {name: {config, set}}``: one base file, several points of a study; the setting's overrides come
    after the spec's common ones and before the method's, and its tune_on reuse still applies; bad forms are refused
    naming the key."""
    settings = {
        "base": str(BASE),
        "ten": {"config": str(BASE), "set": ["data.num_clients=10", "rounds=3"]},
    }
    spec = tables_spec.load_spec(
        write_spec(
            tmp_path,
            settings=settings,
            set=["rounds=2"],
            tune_on={"ten": "base"},
            methods={"fedprox": {"set": ["rounds=4"]}, "local": {}},
        )
    )
    assert spec.settings == {"base": str(BASE), "ten": str(BASE)}
    assert spec.setting_overrides == {"ten": ["data.num_clients=10", "rounds=3"]}
    t = tables_run.Tables(spec, tmp_path / "work", "inprocess", 1)
    local, fedprox = {m.name: m for m in spec.methods}["local"], {m.name: m for m in spec.methods}["fedprox"]
    base_cfg = load_config(t.method_config("base", local))
    ten_cfg = load_config(t.method_config("ten", local))
    assert (base_cfg.data.num_clients, base_cfg.rounds) == (load_config(BASE).data.num_clients, 2)
    assert (ten_cfg.data.num_clients, ten_cfg.rounds) == (10, 3)  # the setting's own after the common override
    assert load_config(t.method_config("ten", fedprox)).rounds == 4  # the method's after the setting's
    assert t.tune_dir("ten", fedprox) == t.tune_dir("base", fedprox)
    for bad, match in [
        ({"x": {"set": ["rounds=2"]}}, "'config' is missing"),
        ({"x": {"config": str(BASE), "sett": []}}, r"unknown key\(s\) \['sett'\]"),
        ({"x": {"config": str(BASE), "set": ["rounds"]}}, "settings.x.set must be a list of KEY=VALUE"),
        ({"x": {"config": "no-such.yaml"}}, "settings.x -> 'no-such.yaml' is not a file"),
    ]:
        with pytest.raises(ConfigError, match=match):
            tables_spec.load_spec(write_spec(tmp_path, settings=bad))
