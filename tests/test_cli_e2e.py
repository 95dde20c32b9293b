"""The command line: config errors exit non-zero naming the key; one real `flwr run` end to end on
Flower's Ray simulation engine; `fedapps compare` builds its table and resumes without re-running."""

import json
import re
from pathlib import Path

import pytest

from fedapps_tools import cli, launch

ROOT = Path(__file__).resolve().parent.parent


def test_misspelt_strategy_exits_nonzero_and_names_it(tiny_config, capsys):
    rc = cli.main(["run", str(tiny_config(strategy={"name": "fedavgg"})), "--engine", "inprocess"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "fedavgg" in err and "strategy.name" in err


def test_missing_config_file(capsys):
    assert cli.main(["run", "/no/such/file.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.heavy  # makes the shared run; test_determinism.py reads it later (see conftest)
def test_flwr_run_end_to_end(flower_run_of_tiny_config):
    """`fedapps run` -> `flwr run` (local SuperLink, Ray simulation, 3 SuperNodes, 2 rounds)."""
    _, proc, out = flower_run_of_tiny_config
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0
    assert "accuracy_mean" in proc.stdout and str(out) in proc.stdout
    pid = int(re.search(r"^SuperLink 127\.0\.0\.1:\d+ \(pid (\d+)", proc.stdout, re.M).group(1))
    assert launch._proc_stat(pid) is None, "the SuperLink started by the run must be stopped"


@pytest.mark.heavy
def test_compare_table_and_resume(tiny_config, tmp_path, capsys, monkeypatch):
    from fedapps.reporting import plots

    figures = []
    draw = plots.comparison_figure
    monkeypatch.setattr(plots, "comparison_figure", lambda curves: figures.append(list(curves)) or draw(curves))
    a = tiny_config(strategy={"name": "fedavg"})
    b = tiny_config(strategy={"name": "local"})
    args = ["compare", str(a), str(b), "--seeds", "0", "1", "--engine", "inprocess", "--output-dir", str(tmp_path)]
    assert cli.main(args) == 0
    folder = tmp_path / "comparison"
    table = (folder / "comparison.md").read_text()
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 4  # header, rule, 2 configs
    assert "±" in table and "fedavg" in table and "local" in table and "Protocol: deployed model" in table
    assert "worst 10 % of clients" in table
    assert (folder / "comparison.png").is_file()
    rows = (folder / "comparison.csv").read_text().splitlines()
    assert len(rows) == 3
    assert {"accuracy_worst10", "accuracy_worst10_sem", "accuracy_std", "accuracy_std_sem"} <= set(rows[0].split(","))
    # the plot's lines are labelled by strategy (the configs are cfg0.yaml, cfg1.yaml), both panels drawn
    assert [c.label for c in figures[0]] == ["fedavg", "local"] and all(c.worst_rounds == [1, 2] for c in figures[0])
    capsys.readouterr()
    stamp = (folder / "runs" / f"{a.stem}-s0" / "summary.json").stat().st_mtime
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("already complete with the same config, skipped") == 4
    assert (folder / "runs" / f"{a.stem}-s0" / "summary.json").stat().st_mtime == stamp


def test_mean_sem():
    from fedapps_tools.compare import mean_sem

    m, e = mean_sem([1.0, 2.0, 3.0])
    assert m == pytest.approx(2.0) and e == pytest.approx(1.0 / 3**0.5)
    assert mean_sem([0.5]) == (0.5, 0.0)


@pytest.mark.heavy
def test_summary_shows_fedavg_beside_personalised_run(tiny_config, tmp_path, capsys):
    cfg = tiny_config(strategy={"name": "cwfedavg"}, data={"partition": "pathological"})
    out = str(tmp_path / "res")
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", out]) == 0
    assert "strategy.name=fedavg" in capsys.readouterr().out  # says how to get FedAvg's number
    assert (
        cli.main(
            [
                "run",
                str(cfg),
                "--engine",
                "inprocess",
                "--output-dir",
                out,
                "--set",
                "strategy.name=fedavg",
                "strategy.params={}",
            ]
        )
        == 0
    )
    capsys.readouterr()
    (run,) = [d for d in Path(out).iterdir() if d.name.startswith("cwfedavg-digits-pathological-s0-")]
    assert cli.main(["report", str(run)]) == 0
    assert "FedAvg on the same setting (fedavg-digits-pathological-s0-" in capsys.readouterr().out
