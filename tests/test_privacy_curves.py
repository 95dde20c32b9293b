"""`fedapps privacy-curves`: the spec's rules, the points' configs, the rows' arithmetic, the figure, and one
tiny end-to-end sweep through the real sub-commands (sample-level DP-SGD on digits)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from fedapps.config import ConfigError, load_config
from fedapps.reporting import plots
from fedapps_tools import cli
from fedapps_tools import privacy_curves as pc

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "configs" / "fedavg.yaml"


def write_spec(tmp_path: Path, **changes) -> Path:
    spec = {
        "name": "curves",
        "setting": str(BASE),
        "seeds": [0, 1],
        "privacy": {"mode": "sample", "max_grad_norm": 1.0, "delta": 1.0e-5},
        "noise_multipliers": [0.5, 2.0],
        "methods": {"fedavg": {"set": ["client.lr=0.1"]}, "ditto": {"set": ["strategy.name=ditto"], "label": "Ditto"}},
    }
    spec.update(changes)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"privacy": {"mode": "off"}}, "mode must name the private mode"),
        ({"privacy": {"mode": "sample", "noise_multiplier": 1.0}}, "noise_multipliers instead"),
        ({"noise_multipliers": [1.0, 1.0]}, "distinct"),
        ({"noise_multipliers": [0.0]}, "> 0"),
        ({"setting": "nowhere.yaml"}, "is not a file"),
        ({"methods": {"fedavg": {"set": ["privacy.noise_multiplier=3"]}}}, "methods.fedavg.set must not set privacy"),
        ({"methods": {"fedavg": {"grid": {}}}}, "methods.fedavg has unknown key"),
        ({"sweep": 1}, "unknown key"),
    ],
)
def test_bad_specs_name_the_key(tmp_path, change, names):
    with pytest.raises(ConfigError, match=names):
        pc.load_curve_spec(write_spec(tmp_path, **change))


def test_every_method_runs_without_privacy_and_at_each_sigma_with_the_specs_keys(tmp_path):
    spec = pc.load_curve_spec(write_spec(tmp_path))
    assert [(m.name, s) for m, s in pc.points(spec)] == [
        ("fedavg", None),
        ("fedavg", 0.5),
        ("fedavg", 2.0),
        ("ditto", None),
        ("ditto", 0.5),
        ("ditto", 2.0),
    ]
    fedavg = spec.methods[0]
    private = load_config_from(tmp_path, pc.point_overrides(spec, fedavg, 2.0))
    assert (private.privacy.mode, private.privacy.noise_multiplier, private.privacy.max_grad_norm) == (
        "sample",
        2.0,
        1.0,
    )
    assert private.privacy.delta == pytest.approx(1e-5) and private.client.lr == pytest.approx(0.1)
    plain = load_config_from(tmp_path, pc.point_overrides(spec, fedavg, None))
    assert plain.privacy.mode == "off" and plain.client.lr == pytest.approx(0.1)


def load_config_from(tmp_path: Path, overrides: list[str]):
    path = pc.write_yaml(tmp_path / "point.yaml", pc.with_overrides(BASE, overrides))
    return load_config(path)


def summary(acc: float, eps: float | None, weighted: float = 0.5) -> dict:
    per_client = {"0": eps, "1": eps / 2, "2": eps / 4} if eps is not None else {}
    privacy = (
        {"mode": "off"} if eps is None else {"mode": "sample", "epsilon_max": eps, "epsilon_per_client": per_client}
    )
    return {"accuracy_mean": acc, "accuracy_weighted": weighted, "accuracy_worst10": acc - 0.1, "privacy": privacy}


def test_a_points_row_is_the_mean_and_sem_over_seeds_and_a_run_without_privacy_has_infinite_epsilon():
    m = pc.CurveMethod("fedavg", [], "FedAvg")
    row = pc.point_row(m, 1.0, [summary(0.8, 3.0), summary(0.9, 5.0)])
    assert row["accuracy_mean"] == pytest.approx(0.85)
    assert row["accuracy_mean_sem"] == pytest.approx(0.05)  # std (ddof 1) 0.0707 / sqrt(2)
    assert (row["epsilon_mean"], row["epsilon_max"]) == (pytest.approx(4.0), 5.0)
    assert row["epsilon_median_client"] == pytest.approx((1.5 + 2.5) / 2)  # median of (ε, ε/2, ε/4), mean over seeds
    assert (row["point"], row["noise_multiplier"], row["seeds"]) == ("sigma1", 1.0, 2)
    off = pc.point_row(m, None, [summary(0.95, None)])
    assert math.isinf(off["epsilon_mean"]) and off["point"] == "off" and off["noise_multiplier"] == ""
    # a run that claims privacy but recorded no ε has no guarantee to show either
    assert math.isinf(pc.run_epsilon({"privacy": {"mode": "sample", "epsilon_max": None}}))


def write_point(work: Path, method: str, point: str, seed: int, s: dict) -> None:
    d = work / "compare" / f"{method}--{point}" / "runs" / f"{method}-s{seed}"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(s))


def test_report_writes_the_rows_with_their_provenance_and_names_what_is_missing(tmp_path, capsys):
    spec = pc.load_curve_spec(write_spec(tmp_path))
    work = tmp_path / "work"
    write_point(work, "fedavg", "off", 0, summary(0.95, None))
    write_point(work, "fedavg", "sigma0.5", 0, summary(0.90, 8.0))
    write_point(work, "fedavg", "sigma0.5", 1, summary(0.88, 8.2))
    write_point(work, "fedavg", "sigma2", 0, summary(0.70, 1.1))
    write_point(work, "fedavg", "sigma2", 7, summary(0.10, 0.1))  # a seed the spec does not name: ignored
    made = {"commit": "abc1234567", "machine": "2 CPU cores, no GPU", "date": "2026-12-02"}
    (work / "compare" / "fedavg--sigma0.5" / "provenance.json").write_text(json.dumps(made))
    out = tmp_path / "docs"
    assert pc.report(spec, work, out, "fedapps privacy-curves spec.yaml") == out / "curves.csv"
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["point"], r["seeds"]) for r in rows] == [
        ("fedavg", "off", "1"),
        ("fedavg", "sigma0.5", "2"),
        ("fedavg", "sigma2", "1"),
    ]
    assert float(rows[1]["accuracy_mean"]) == pytest.approx(0.89) and float(rows[2]["epsilon_max"]) == 1.1
    assert all(r["command"] == "fedapps privacy-curves spec.yaml" for r in rows)
    # each row names the code its runs were made with, not the checkout the report is written from
    assert [r["commit"] for r in rows] == ["", "abc1234567", ""] and rows[1]["machine"] == "2 CPU cores, no GPU"
    assert (out / "curves.png").is_file()
    printed = capsys.readouterr().out
    assert "incomplete: fedavg off (1/2 seeds), fedavg sigma2 (1/2 seeds)" in printed
    assert "not run: ditto off, ditto sigma0.5, ditto sigma2" in printed


def test_the_figure_joins_each_methods_private_points_in_order_of_epsilon_and_puts_its_plain_accuracy_at_no_dp():
    rows = [
        pc.point_row(pc.CurveMethod("fedavg", [], "FedAvg"), s, [summary(acc, eps)])
        for s, acc, eps in [(None, 0.95, None), (0.5, 0.9, 8.0), (2.0, 0.7, 1.0)]  # σ order: ε descending
    ] + [
        pc.point_row(pc.CurveMethod("ditto", [], "Ditto"), s, [summary(acc, eps)])
        for s, acc, eps in [(1.0, 0.85, 3.0), (None, 0.97, None)]
    ]
    fig = plots.privacy_curves_figure(rows)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    curves = {c.get_label(): c.lines[0] for c in ax.containers if not c.get_label().startswith("_")}
    assert set(curves) == {"FedAvg", "Ditto"}  # one legend entry per method, not one per reference
    assert list(curves["FedAvg"].get_xdata()) == [1.0, 8.0] and list(curves["FedAvg"].get_ydata()) == [0.7, 0.9]
    assert list(curves["Ditto"].get_xdata()) == [3.0]
    references = [c.lines[0] for c in ax.containers if c.get_label().startswith("_")]
    # each non-private accuracy: one hollow point in its method's colour and marker, right of every private ε
    assert sorted((list(r.get_ydata()), r.get_color()) for r in references) == sorted(
        [([0.95], curves["FedAvg"].get_color()), ([0.97], curves["Ditto"].get_color())]
    )
    assert all(r.get_fillstyle() == "none" and r.get_xdata()[0] > 8.0 for r in references)
    assert {r.get_marker() for r in references} == {curves["FedAvg"].get_marker(), curves["Ditto"].get_marker()}
    assert curves["FedAvg"].get_marker() != curves["Ditto"].get_marker()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["1", "2", "5", "no DP"] and ax.get_xticks()[-1] == references[0].get_xdata()[0]
    plots._pyplot().close(fig)


@pytest.mark.parametrize(
    "lo, hi, ticks",
    [(1.0, 8.0, [1, 2, 5]), (2.3, 13.3, [5, 10]), (2.7, 26.7, [5, 10, 20]), (0.4, 0.45, [0.2]), (13.3, 13.3, [10])],
)
def test_epsilon_ticks_are_the_1_2_5_values_in_range(lo, hi, ticks):
    assert plots.epsilon_ticks(lo, hi) == pytest.approx(ticks)


def test_the_command_line_refuses_unknown_methods_and_stages(tmp_path, capsys):
    spec = write_spec(tmp_path)
    assert cli.main(["privacy-curves", str(spec), "--methods", "fedprox"]) == 2
    assert "--methods ['fedprox'] not in the spec" in capsys.readouterr().err
    assert cli.main(["privacy-curves", str(spec), "--stages", "tune"]) == 2
    assert cli.main(["privacy-curves", str(tmp_path / "none.yaml")]) == 2


def test_an_interrupted_point_records_the_provenance_of_the_runs_it_finished(tmp_path, monkeypatch):
    spec = pc.load_curve_spec(write_spec(tmp_path))
    work = tmp_path / "work"
    m = spec.methods[0]

    def finish_one_then_fail(args, log, jobs):
        write_point(work, m.name, "off", 0, summary(0.9, None))
        raise RuntimeError("stopped")

    monkeypatch.setattr(pc, "fedapps", finish_one_then_fail)
    monkeypatch.setattr(pc, "provenance", lambda: {"commit": "c0ffee", "machine": "m", "date": "d"})
    with pytest.raises(RuntimeError, match="stopped"):
        pc.run_point(spec, work, m, None, 1)
    assert json.loads((work / "compare" / f"{m.name}--off" / "provenance.json").read_text())["commit"] == "c0ffee"


@pytest.mark.heavy
def test_a_tiny_sweep_runs_for_real_and_epsilon_falls_as_sigma_grows(tmp_path):
    """Sample-level DP-SGD through `fedapps compare` (digits, 3 clients, 2 rounds): the non-private point has no
    ε, the private ones the accountant's, smaller at the larger σ; a second call trains nothing again."""
    pytest.importorskip("opacus")
    base = yaml.safe_load(BASE.read_text())
    base.update(rounds=2)
    base["data"].update(source="digits", num_clients=3, partition="iid")
    base["strategy"]["min_clients"] = 3
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = write_spec(tmp_path, setting="base.yaml", seeds=[0], methods={"fedavg": {"set": ["client.lr=0.05"]}})
    argv = [str(spec), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "docs")]
    assert cli.main(["privacy-curves", *argv]) == 0
    with open(tmp_path / "docs" / "curves.csv") as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["off", "sigma0.5", "sigma2"]
    assert all(r["commit"] and r["machine"] for r in rows.values())  # the runs' own provenance
    assert math.isinf(float(rows["off"]["epsilon_mean"]))
    assert 0 < float(rows["sigma2"]["epsilon_mean"]) < float(rows["sigma0.5"]["epsilon_mean"]) < math.inf
    log = tmp_path / "work" / "curves" / "logs" / "fedavg--sigma2.log"
    assert cli.main(["privacy-curves", *argv]) == 0
    assert ": running" not in log.read_text().rsplit("$ fedapps", 1)[1]


@pytest.mark.parametrize("spec", sorted((ROOT / "experiments").glob("privacy-*.yaml")), ids=lambda p: p.name)
def test_every_shipped_curves_spec_loads_and_each_of_its_points_is_a_valid_run(spec, tmp_path):
    """A code change that makes a published spec's point invalid (a renamed key, a strategy that now refuses the
    mode) fails here, not hours into the sweep."""
    from strategies import resolve

    loaded = pc.load_curve_spec(spec)
    assert loaded.privacy["mode"] in ("sample", "client")
    for m, sigma in pc.points(loaded):
        cfg = load_config(
            pc.write_yaml(tmp_path / "p.yaml", pc.with_overrides(loaded.setting, pc.point_overrides(loaded, m, sigma)))
        )
        resolve(cfg)  # the strategy's own checks, against the whole config
        assert cfg.privacy.mode == ("off" if sigma is None else loaded.privacy["mode"])
