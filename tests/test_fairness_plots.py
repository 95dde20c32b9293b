"""Fairness across clients (worst 10 % of clients, std over clients) against hand computations, in rounds.csv,
summary.json and the comparison table; and the plots' one style: a fixed (colour, line style) per method,
integer round ticks, legends naming strategies, SEM bands over seeds."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import run_folder
from fedapps.reporting import plots
from fedapps.reporting.results import (
    accuracy_stats,
    after_training_stats,
    client_std,
    measured_columns,
    round_row,
    worst_share_count,
    worst_share_mean,
)
from fedapps.wire import protocol
from fedapps_tools import cli
from fedapps_tools.compare import Line, comparison_curves, markdown_table, summarise_runs

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the two statistics, by hand


@pytest.mark.parametrize(
    "n, k", [(1, 1), (3, 1), (9, 1), (10, 1), (11, 2), (20, 2), (21, 3), (30, 3), (100, 10), (101, 11)]
)
def test_worst_share_count_is_ceil_of_ten_percent(n, k):
    # 30 clients: 3 (math.ceil(30 * 0.1) is 4: floating point); 11 clients: 2 (not 11 // 10 = 1)
    assert worst_share_count(n) == k


def test_worst_share_count_refuses_no_client():
    with pytest.raises(ValueError, match="at least one client"):
        worst_share_count(0)


def test_worst_share_mean_is_the_mean_of_the_worst_clients():
    # 30 clients: the worst 3 are 0.0, 0.1 and 0.5 -> 0.2 (their median would be 0.1, the best 3 are 1.0)
    accs = [0.9 + 0.1 * (i % 2) for i in range(27)] + [0.5, 0.0, 0.1]
    assert worst_share_mean(accs) == pytest.approx(0.2)
    # 3 clients: the worst one, whatever the order
    assert worst_share_mean([0.9, 0.3, 0.6]) == pytest.approx(0.3)
    # 11 clients: the worst 2 (0.2 and 0.4) -> 0.3
    assert worst_share_mean([1.0] * 9 + [0.4, 0.2]) == pytest.approx(0.3)
    assert worst_share_mean([0.7]) == pytest.approx(0.7)


def test_client_std_is_the_population_standard_deviation():
    # mean 0.5; squared deviations 0.09, 0.01, 0.16 -> population variance 0.26 / 3, std its square root
    accs = [0.2, 0.4, 0.9]
    assert client_std(accs) == pytest.approx(math.sqrt(0.26 / 3))  # not 0.0867 (variance), not sqrt(0.13) (sample)
    assert client_std(accs) == pytest.approx(float(np.std(accs)))
    assert client_std([0.6]) == 0.0
    with pytest.raises(ValueError):
        client_std([])


def _metrics(cid, tag, correct, n, loss=1.0):
    return {
        protocol.CLIENT_ID: cid,
        protocol.NUM_EXAMPLES: n,
        f"{tag}-acc": correct / n,
        f"{tag}-loss": loss,
        f"{tag}-n": n,
        f"{tag}-correct": correct,
    }


def test_accuracy_stats_report_worst_and_std_of_the_per_client_accuracies():
    # clients: 9/10, 3/10, 60/100 -> per-client 0.9, 0.3, 0.6
    replies = [_metrics(0, "deployed", 9, 10), _metrics(1, "deployed", 3, 10), _metrics(2, "deployed", 60, 100)]
    stats = accuracy_stats(replies, "deployed")
    assert stats["acc_mean"] == pytest.approx(0.6)
    assert stats["acc_worst10"] == pytest.approx(0.3)  # the worst of 3 clients
    assert stats["acc_std"] == pytest.approx(math.sqrt((0.09 + 0.09 + 0.0) / 3))
    cols = measured_columns(replies, num_clients=3)
    assert cols["acc_worst10"] == stats["acc_worst10"] and cols["acc_std"] == stats["acc_std"]
    after = after_training_stats([_metrics(0, "after", 1, 10), _metrics(1, "after", 5, 10)])
    assert after["acc_after_training_worst10"] == pytest.approx(0.1)
    assert after["acc_after_training_std"] == pytest.approx(0.2)


def test_round_row_places_the_fairness_columns_next_to_the_mean():
    from fedapps.server.rounds import RoundLog

    reply = SimpleNamespace(metrics=_metrics(0, "after", 1, 2))
    row = round_row(RoundLog(1, [reply], 0, 0), 1)
    keys = list(row)
    assert keys[keys.index("acc_mean") : keys.index("acc_mean") + 4] == [
        "acc_mean",
        "acc_weighted",
        "acc_worst10",
        "acc_std",
    ]
    assert row["acc_worst10"] == "" and row["acc_after_training_worst10"] == pytest.approx(0.5)


def test_comparison_table_averages_the_fairness_columns_over_seeds():
    runs = [
        {
            "strategy": "fedavg",
            "accuracy_mean": 0.8,
            "accuracy_weighted": 0.8,
            "accuracy_worst10": 0.4,
            "accuracy_std": 0.1,
            "bytes_up_per_client_round": 1,
            "bytes_down_per_client_round": 1,
            "wall_seconds": 1,
        },
        {
            "strategy": "fedavg",
            "accuracy_mean": 0.9,
            "accuracy_weighted": 0.9,
            "accuracy_worst10": 0.6,
            "accuracy_std": 0.3,
            "bytes_up_per_client_round": 1,
            "bytes_down_per_client_round": 1,
            "wall_seconds": 1,
        },
    ]
    row = summarise_runs("fedavg-x", runs)
    assert row["accuracy_worst10"] == pytest.approx(0.5) and row["accuracy_worst10_sem"] == pytest.approx(0.1)
    assert row["accuracy_std"] == pytest.approx(0.2)
    assert math.isnan(row["accuracy_after_training_worst10"])  # no run recorded it
    table = markdown_table([row])
    assert "worst 10 % of clients" in table.splitlines()[2] and "0.5000 ± 0.1000" in table
    assert "| - |" in table  # the after-training column without values


# --------------------------------------------------------------------------- one style per method


def test_method_style_gives_at_least_20_distinct_pairs_stable_per_name():
    slots = {tuple(plots.style_of_slot(i).values()) for i in range(plots.STYLE_SLOTS)}
    assert len(slots) == plots.STYLE_SLOTS >= 20
    names = list(plots.METHOD_ORDER) + [f"variant-{i}" for i in range(24 - len(plots.METHOD_ORDER))]
    styles = plots.line_styles(names)
    assert len({(s["color"], s["linestyle"]) for s in styles}) == len(names) >= 20
    own = [tuple(plots.method_style(m).values()) for m in plots.METHOD_ORDER]
    assert len(set(own)) == len(own)  # the project's methods never share a pair
    for m in plots.METHOD_ORDER:  # the same style whatever else the plot shows, and in whichever order
        assert plots.line_styles(["variant-3", m, "fedavg"])[1] == plots.method_style(m)
        assert plots.line_styles(list(reversed(names)))[list(reversed(names)).index(m)] == plots.method_style(m)
    assert plots.method_style("fedavg") == {"color": "#1f77b4", "linestyle": "-"}  # pinned


def test_method_style_of_an_unlisted_name_is_the_same_in_another_process():
    code = "from fedapps.reporting.plots import method_style; print(method_style('my-method'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(plots.method_style("my-method"))


def test_no_two_registered_strategies_share_a_style():
    """A strategy METHOD_ORDER does not list has a slot from its name: distinct from the others' unless two names
    meet in one (then append one of them to METHOD_ORDER)."""
    from strategies import STRATEGIES

    styles = {name: tuple(plots.method_style(name).values()) for name in STRATEGIES}
    shared = sorted(n for n in styles if list(styles.values()).count(styles[n]) > 1)
    assert not shared, f"append {shared} to fedapps.reporting.plots.METHOD_ORDER (each method's fixed plot style)"


def test_the_same_method_twice_in_a_plot_keeps_its_colour_and_changes_its_line():
    a, b, c = plots.line_styles(["fedavg", "local", "fedavg"])
    assert a == plots.method_style("fedavg") and b == plots.method_style("local")
    assert c["color"] == a["color"] and c["linestyle"] != a["linestyle"]
    assert (c["color"], c["linestyle"]) != tuple(plots.method_style("fedper").values())  # fedper's is blue dashed


def test_legend_labels_name_strategies_and_settings_only_where_needed():
    one = [("fedavg", "digits iid, 3 clients", "cfg0"), ("local", "digits iid, 3 clients", "cfg1")]
    assert plots.legend_labels(one) == ["fedavg", "local"]
    mixed = [("fedavg", "S1", "fedavg-pat"), ("fedavg", "S2", "fedavg-dir"), ("local", "S1", "local-pat")]
    assert plots.legend_labels(mixed) == ["fedavg (S1)", "fedavg (S2)", "local (S1)"]
    same = [("cosmos", "S", "cosmos"), ("cosmos", "S", "cosmos-tuned"), ("local", "S", "cosmos-local")]
    assert plots.legend_labels(same) == ["cosmos", "cosmos (cosmos-tuned)", "local"]
    tables_like = [("cwfedavg", "", "cwfedavg"), ("cwfedavg", "", "cwfedavg (paper's setting)")]
    assert plots.legend_labels(tables_like) == ["cwfedavg", "cwfedavg (paper's setting)"]
    variant_alone = [("fedavg", "", "fedavg (paper's setting, 300 rounds)"), ("local", "", "local")]
    assert plots.legend_labels(variant_alone) == ["fedavg (paper's setting, 300 rounds)", "local"]
    comma = [("cosmos", "", "cosmos (the paper's)"), ("cosmos", "", "cosmos, centred (ours)"), ("local", "", "local")]
    assert plots.legend_labels(comma) == ["cosmos (the paper's)", "cosmos, centred (ours)", "local"]


def test_setting_label_names_the_partition_and_its_parameter():
    from fedapps.config import load_config
    from fedapps_tools.compare import setting_label

    dirichlet = load_config(None, "data.source=digits data.partition=dirichlet data.alpha=0.1 data.num_clients=20")
    pathological = load_config(None, "data.source=digits data.partition=pathological data.num_clients=5")
    assert setting_label(dirichlet) == "digits dirichlet α=0.1, 20 clients"
    assert setting_label(pathological) == "digits pathological 2 classes/client, 5 clients"


# --------------------------------------------------------------------------- the figures, read back


def _visible_ticks(ax):
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def _rows(accs, worst=None):
    return [{"round": r + 1, "acc_mean": a, **({"acc_worst10": worst[r]} if worst else {})} for r, a in enumerate(accs)]


def test_comparison_figure_integer_rounds_strategy_labels_and_sem_bands():
    lines = [
        Line("fedavg", "digits iid, 3 clients", "cfg0", [_rows([0.2, 0.4], [0.1, 0.2]), _rows([0.4, 0.6], [0.3, 0.2])]),
        Line("local", "digits iid, 3 clients", "cfg1", [_rows([0.5, 0.5], [0.5, 0.4]), _rows([0.7, 0.9], [0.5, 0.6])]),
    ]
    curves = comparison_curves(lines)
    assert curves[0].mean == pytest.approx([0.3, 0.5]) and curves[0].sem == pytest.approx([0.1, 0.1])
    assert curves[1].worst == pytest.approx([0.5, 0.5]) and curves[1].worst_sem == pytest.approx([0.0, 0.1])
    fig = plots.comparison_figure(curves)
    try:
        assert len(fig.axes) == 2  # mean over clients, worst 10 % of clients
        for ax in fig.axes:
            ticks = _visible_ticks(ax)
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
            assert [ln.get_color() for ln in ax.get_lines()] == [
                plots.method_style(m)["color"] for m in ("fedavg", "local")
            ]
            assert [ln.get_linestyle() for ln in ax.get_lines()] == ["-", "-"]
        legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert legend == ["fedavg", "local"]
        band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]  # fedavg's band: mean ± SEM
        assert band.min() == pytest.approx(0.2) and band.max() == pytest.approx(0.6)
    finally:
        plots._pyplot().close(fig)


def test_run_accuracy_figure_integer_rounds_and_the_methods_colour(tmp_path):
    rows = [
        {"round": 1, "acc_mean": 0.5, "acc_weighted": 0.6, "acc_worst10": 0.2, "acc_after_training_mean": 0.7},
        {"round": 2, "acc_mean": 0.6, "acc_weighted": 0.7, "acc_worst10": 0.3, "acc_after_training_mean": 0.8},
    ]
    fig = plots.accuracy_figure(rows, "run-s0", "local")
    try:
        ax = fig.axes[0]
        ticks = _visible_ticks(ax)
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "deployed model (worst 10 % of clients)" in labels and len(labels) == 4
        assert {ln.get_color() for ln in ax.get_lines()} == {plots.method_style("local")["color"]}
        assert len({ln.get_linestyle() for ln in ax.get_lines()}) == 4
        assert "local" in ax.get_title()
    finally:
        plots._pyplot().close(fig)
    plots.plot_accuracy(rows, tmp_path / "a.png", "run-s0", "local")
    assert (tmp_path / "a.png").stat().st_size > 0


# --------------------------------------------------------------------------- a short run writes the new fields


def test_short_run_writes_fairness_into_summary_and_rounds(tiny_config, tmp_path, capsys):
    cfg = tiny_config(data={"num_clients": 3})
    out = tmp_path / "res"
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    run = run_folder(out)
    summary = json.loads((run / "summary.json").read_text())
    with (run / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and {"acc_worst10", "acc_std", "acc_after_training_worst10", "acc_after_training_std"} <= set(
        rows[0]
    )
    last = rows[-1]
    accs = [float(last[f"acc_client_{i}"]) for i in range(3)]
    assert float(last["acc_worst10"]) == pytest.approx(min(accs))  # 3 clients: the worst one
    assert float(last["acc_std"]) == pytest.approx(float(np.std(accs)))
    assert summary["accuracy_worst10"] == pytest.approx(min(accs))
    assert summary["accuracy_std"] == pytest.approx(float(np.std(accs)))
    assert summary["accuracy_worst10"] <= summary["accuracy_mean"]
    assert isinstance(summary["accuracy_after_training_worst10"], float)
    assert isinstance(summary["accuracy_after_training_std"], float)
    assert (run / "accuracy.png").is_file()


def test_accuracy_limits_keep_close_methods_apart():
    """The comparison panel starts just below the lowest mean − SEM (a multiple of 0.05) and ends at 1."""
    from fedapps.reporting.plots import accuracy_limits

    assert accuracy_limits([0.861, 0.903, 0.95]) == (0.8, 1.0)  # 0.861 − 0.025 = 0.836 → 0.80
    assert accuracy_limits([0.876]) == (0.85, 1.0)  # 0.851 → 0.85, not 0.80 or 0.90
    assert accuracy_limits([0.01, 0.5]) == (0.0, 1.0)  # never below 0
    assert accuracy_limits([]) == (0.0, 1.0)
