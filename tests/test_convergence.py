"""Where a validation curve flattens (fedapps_tools/convergence.py): the trailing mean by hand, the flattening
round of synthetic curves, and the refusal to call a still-rising or too-short curve flat."""

from __future__ import annotations

import csv

import numpy as np

from fedapps_tools import convergence, tables_run, tables_spec


def test_trailing_mean_by_hand():
    np.testing.assert_allclose(convergence.smoothed([1, 2, 3, 4, 5], 3), [1, 1.5, 2, 3, 4])
    np.testing.assert_allclose(convergence.smoothed([4, 0], 1), [4, 0])


def test_flattening_round_of_a_rising_then_flat_curve():
    rising = list(np.linspace(0.5, 0.9, 51))  # +0.008 a round for 50 rounds, then flat at 0.9
    values = rising + [0.9] * 200
    # the first index within 0.005 of everything later: index 49 (0.892) is 0.008 short, index 50 is 0.9
    assert convergence.flattening_index(values, window=1, tolerance=0.005, after=100) == 50
    # a wider tolerance calls it flat earlier, by exactly the rounds that gain that much (5 × 0.008 = 0.04)
    assert convergence.flattening_index(values, window=1, tolerance=0.0405, after=100) == 45
    # the trailing mean delays it by about the window
    assert 50 < convergence.flattening_index(values, window=20, tolerance=0.005, after=100) <= 70


def test_a_curve_that_still_rises_or_is_too_short_is_not_called_flat():
    assert convergence.flattening_index(list(np.linspace(0.1, 0.9, 300)), window=5, tolerance=0.005, after=50) is None
    values = list(np.linspace(0.5, 0.9, 51)) + [0.9] * 30  # flat, but only 30 rounds seen after
    assert convergence.flattening_index(values, window=1, tolerance=0.005, after=100) is None
    assert convergence.flattening_index(values, window=1, tolerance=0.005, after=30) == 50
    # a dip later does not make an earlier round flat: the test is against the later maximum
    dip = [0.5] * 50 + [0.4] * 10 + [0.8] * 150
    assert convergence.flattening_index(dip, window=1, tolerance=0.005, after=100) == 60
    assert convergence.flattening_index([], 1, 0.005, 0) is None


def test_the_command_reads_run_folders_and_appends_its_rows_with_the_commit(tmp_path, capsys):
    run = tmp_path / "cwfedavg-x-s0"
    run.mkdir()
    acc = list(np.linspace(0.2, 0.8, 50)) + [0.8] * 60
    tables_spec.write_csv(
        run / "rounds.csv", ["round", "acc_mean"], [{"round": r + 1, "acc_mean": a} for r, a in enumerate(acc)]
    )
    (run / "summary.json").write_text(
        '{"strategy": "cwfedavg", "partition": "pathological", "evaluated_on": "validation"}'
    )
    out = tmp_path / "flat.csv"
    assert convergence.main([str(run), "--window", "1", "--after", "50", "--csv", str(out)]) == 0
    assert "flat from round 50" in capsys.readouterr().out
    assert convergence.main([str(run), "--window", "1", "--after", "50", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 2 and rows[0]["flattening_round"] == "50" and rows[0]["strategy"] == "cwfedavg"
    assert rows[0]["commit"] == tables_run.provenance()["commit"] and "--window 1" in rows[0]["command"]
    assert convergence.main([str(tmp_path / "nothing")]) == 2


def test_the_figure_is_drawn_for_finished_and_running_runs(tmp_path):
    runs = []
    for name, strategy, finished in (("a", "fedavg", True), ("b", "cwfedavg", False)):
        run = tmp_path / name
        run.mkdir()
        tables_spec.write_csv(
            run / "rounds.csv",
            ["round", "acc_mean"],
            [{"round": r + 1, "acc_mean": min(0.9, 0.1 * r)} for r in range(40)],
        )
        if finished:
            (run / "summary.json").write_text(f'{{"strategy": "{strategy}"}}')
        else:  # still running: no summary yet, its resolved config names the strategy
            (run / "config.yaml").write_text(f"strategy:\n  name: {strategy}\n")
        runs.append(run)
    assert [convergence.strategy_of(r) for r in runs] == ["fedavg", "cwfedavg"]
    figure = tmp_path / "curves.png"
    assert convergence.main([*map(str, runs), "--window", "1", "--after", "5", "--figure", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
