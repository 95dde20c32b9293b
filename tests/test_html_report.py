"""`fedapps report DIR --html`: a real `fedapps compare` folder rendered into one self-contained page, opened in a
headless Chromium (the results table's cells read back from the rendered DOM, the screenshot not blank and showing
the methods' plot colours); a run folder's page; the pieces (traffic, per-client accuracies, run discovery) and the
two new figures against hand-made data."""

from __future__ import annotations

import base64
import csv
import math
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from conftest import write_config
from fedapps.reporting import plots
from fedapps_tools import cli
from fedapps_tools.html_report import (
    Run,
    cumulative_megabytes,
    final_client_accuracies,
    read_comparison,
    seed_runs,
    traffic_at,
)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def comparison(tmp_path_factory) -> Path:
    """A real `fedapps compare` folder: cwFedAvg (writes a heatmap figure) and Local (none), digits, pathological,
    3 clients, 2 rounds, seeds 0 and 1, in-process engine (~12 s)."""
    root = tmp_path_factory.mktemp("html-report")
    setting = {"data": {"source": "digits", "partition": "pathological", "num_clients": 3}}
    a = write_config(root / "cw.yaml", strategy={"name": "cwfedavg"}, **setting)
    b = write_config(root / "loc.yaml", strategy={"name": "local"}, **setting)
    assert (
        cli.main(
            [
                "compare",
                str(a),
                str(b),
                "--seeds",
                "0",
                "1",
                "--engine",
                "inprocess",
                "--output-dir",
                str(root / "out"),
                "--quiet",
            ]
        )
        == 0
    )
    return root / "out" / "comparison"


class Page(HTMLParser):
    """The parts of a page the tests read: every table's rows of cell texts (by table id), every image's src/alt."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[dict[str, str]] = []
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []
        elif tag == "img":
            self.images.append({k: v or "" for k, v in a.items()})

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def expected_results_rows(folder: Path) -> list[list[str]]:
    """The results table's body as it must read, computed here from comparison.csv's raw numbers."""
    with (folder / "comparison.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    keys = ("accuracy_mean", "accuracy_weighted", "accuracy_worst10", "accuracy_std", "accuracy_after_training_mean")
    out = []
    for r in rows:
        pm = [f"{float(r[k]):.4f} ± {float(r[k + '_sem']):.4f}" for k in keys]
        out.append(
            [
                r["config"],
                r["strategy"],
                r["seeds"],
                *pm,
                f"{float(r['bytes_up_per_client_round']) / 2**20:.3f}",
                f"{float(r['bytes_down_per_client_round']) / 2**20:.3f}",
                f"{float(r['wall_seconds']):.0f}",
                "deployed-model (test split)",
            ]
        )
    return out


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "no headless browser on PATH (chromium, chromium-browser, google-chrome): install one with "
        "`apt-get install chromium` (Debian) to run the HTML report's browser test"
    )


def run_browser(exe: str, tmp_path: Path, *args: str, timeout: float = 90) -> str:
    """Run headless Chromium with a throw-away profile; its stdout. Only the process group it started is killed,
    and only when it overruns."""
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{exe} did not finish within {timeout} s: {' '.join(cmd)}")
    assert proc.returncode == 0, f"{exe} failed ({proc.returncode}): {err[-2000:]}"
    return out


def colour_pixels(image: np.ndarray, hex_colour: str, tol: float = 0.08) -> int:
    """How many pixels of an RGB(A) float image are within ``tol`` of ``hex_colour`` in every channel."""
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb) <= tol).all(axis=-1).sum())


# --------------------------------------------------------------------------- the comparison page in a browser


@pytest.mark.heavy
def test_comparison_report_renders_in_a_browser(comparison, tmp_path, capsys):
    import matplotlib.image

    assert cli.main(["report", str(comparison), "--html"]) == 0
    page = comparison / "report.html"
    assert f"report: {page}" in capsys.readouterr().out
    text = page.read_text()
    # self-contained: no script, no stylesheet link, every image inline, nothing addressed on the network
    assert "<script" not in text and "<link" not in text and "http://" not in text and "https://" not in text
    static = Page(text)
    assert len(static.images) == 4  # rounds, traffic, per-client spread, cwFedAvg's heatmaps
    assert all(im["src"].startswith("data:image/png;base64,") for im in static.images)

    exe = browser()
    dom = Page(run_browser(exe, tmp_path, "--dump-dom", page.as_uri()))
    header, *body = dom.tables["results"]
    assert header[:4] == ["config", "strategy", "seeds", "accuracy (mean over clients)"]
    assert "worst 10 % of clients" in header and "std over clients" in header and header[-1] == "protocol"
    assert body == expected_results_rows(comparison)
    assert [row[:3] for row in body] == [["cw", "cwfedavg", "2"], ["loc", "local", "2"]]
    runs = dom.tables["runs"][1:]
    assert [(r[0], r[1], r[-1]) for r in runs] == [
        ("cw", "0", "cw-s0"),
        ("cw", "1", "cw-s1"),
        ("loc", "0", "loc-s0"),
        ("loc", "1", "loc-s1"),
    ]

    shot = tmp_path / "page.png"
    run_browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,2200", page.as_uri())
    image = matplotlib.image.imread(shot)
    assert image.shape[:2] == (2200, 1280)
    white = (image[..., :3] > 0.97).all(axis=-1)
    assert 0.03 < 1 - white.mean() < 0.9, "the screenshot is blank (or all ink)"
    # the figures were decoded and painted: the methods' own colours (text and table are black and grey)
    for method in ("cwfedavg", "local"):
        assert colour_pixels(image, plots.method_style(method)["color"]) > 200, method


def test_run_folder_report_has_its_numbers_and_the_strategys_figure(comparison, tmp_path, capsys):
    import json

    run = comparison / "runs" / "cw-s0"
    out = tmp_path / "sub" / "cw.html"
    assert cli.main(["report", str(run), "--html", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out and not (run / "report.html").exists()
    page = Page(out.read_text())
    s = json.loads((run / "summary.json").read_text())
    (row,) = page.tables["results"][1:]
    assert row[:3] == ["cw-s0", "cwfedavg", "1"]
    # one run: its summary's numbers, no ± (there is no spread over seeds to show)
    assert row[3:7] == [
        f"{s[k]:.4f}" for k in ("accuracy_mean", "accuracy_weighted", "accuracy_worst10", "accuracy_std")
    ]
    heatmap = [im for im in page.images if im["alt"] == "weight_norms.png"]
    assert len(heatmap) == 1
    png = (run / "weight_norms.png").read_bytes()
    assert heatmap[0]["src"] == "data:image/png;base64," + base64.b64encode(png).decode()
    # Local writes no figure of its own; its page says so
    local_out = tmp_path / "loc.html"
    assert cli.main(["report", str(comparison / "runs" / "loc-s0"), "--html", "--out", str(local_out)]) == 0
    assert "local writes no figure of its own" in local_out.read_text()


def test_report_without_html_prints_the_table_and_bad_folders_are_refused(comparison, tmp_path, capsys):
    assert cli.main(["report", str(comparison)]) == 0
    assert (comparison / "comparison.md").read_text() in capsys.readouterr().out
    assert cli.main(["report", str(tmp_path), "--html"]) == 2
    assert "no run, comparison or tune folder found" in capsys.readouterr().err
    assert cli.main(["report", str(comparison), "--out", str(tmp_path / "x.html")]) == 2
    assert "add --html" in capsys.readouterr().err


# --------------------------------------------------------------------------- the pieces, by hand


def _run(rows, final_round=None, seed=0):
    return Run(Path(f"r{seed}"), seed, {"final_round": final_round}, rows)


def test_cumulative_megabytes_sums_up_and_down_over_the_rounds_so_far():
    rows = [
        {"round": 2, "bytes_up": 1_000_000, "bytes_down": 3_000_000},
        {"round": 1, "bytes_up": 500_000, "bytes_down": 1_500_000},
        {"round": 3, "bytes_up": None, "bytes_down": 2_000_000},
    ]
    assert cumulative_megabytes(rows) == {1: pytest.approx(2.0), 2: pytest.approx(6.0), 3: pytest.approx(8.0)}


def test_traffic_at_is_the_mean_over_seeds():
    a = _run([{"round": 1, "bytes_up": 1e6, "bytes_down": 0}, {"round": 2, "bytes_up": 1e6, "bytes_down": 0}])
    b = _run([{"round": 1, "bytes_up": 3e6, "bytes_down": 0}, {"round": 2, "bytes_up": 3e6, "bytes_down": 0}])
    assert traffic_at([a, b], [1, 2]) == [pytest.approx(2.0), pytest.approx(4.0)]


def test_final_client_accuracies_are_the_final_rounds_in_client_order():
    rows = [
        {"round": 1, "acc_mean": 0.5, "acc_client_0": 0.1, "acc_client_2": 0.2, "acc_client_10": 0.3},
        {"round": 2, "acc_mean": 0.6, "acc_client_0": 0.7, "acc_client_2": None, "acc_client_10": 0.9},
        {"round": 3, "acc_mean": None, "acc_client_0": None, "acc_client_2": None, "acc_client_10": None},
    ]
    # client 2 was not measured in round 2; client 10 after client 2 (numeric order, not "10" < "2")
    assert final_client_accuracies(_run(rows, final_round=2)) == [0.7, 0.9]
    assert final_client_accuracies(_run(rows, final_round=1)) == [0.1, 0.2, 0.3]
    assert final_client_accuracies(_run(rows)) == [0.7, 0.9]  # no final_round: the last measured row


def test_seed_runs_finds_exactly_one_configs_finished_runs(tmp_path):
    for name in ("a-s0", "a-s10", "a-s1", "a-s1-s0", "ab-s0", "a-s2"):
        (tmp_path / name).mkdir()
        if name != "a-s2":  # a-s2 never finished
            (tmp_path / name / "summary.json").write_text(f'{{"seed": {int(name.rsplit("-s", 1)[1])}}}')
    assert [r.path.name for r in seed_runs(tmp_path, "a")] == ["a-s0", "a-s1", "a-s10"]
    assert [r.path.name for r in seed_runs(tmp_path, "a-s1")] == ["a-s1-s0"]
    assert seed_runs(tmp_path / "missing", "a") == []


def test_read_comparison_keeps_labels_as_text(tmp_path):
    f = tmp_path / "comparison.csv"
    f.write_text("config,strategy,seeds,accuracy_mean,accuracy_mean_sem,accuracy_worst10\n01,fedavg,3,0.5,0.1,\n")
    (row,) = read_comparison(f)
    assert row["config"] == "01" and row["seeds"] == 3 and row["accuracy_mean"] == 0.5
    assert math.isnan(row["accuracy_worst10"])


# --------------------------------------------------------------------------- the two new figures


def _curve(method, rounds, mean):
    return plots.Curve(method, method, rounds, mean, [0.01] * len(rounds))


def test_traffic_figure_puts_each_point_at_its_traffic():
    curves = [_curve("fedavg", [1, 2, 3], [0.5, 0.6, 0.7]), _curve("cosmos", [1, 2, 3], [0.4, 0.5, 0.55])]
    fig = plots.traffic_figure(curves, [[10.0, 20.0, 30.0], [0.01, 0.02, 0.03]])
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["fedavg"].get_xdata()) == [10.0, 20.0, 30.0]
    assert list(lines["fedavg"].get_ydata()) == [0.5, 0.6, 0.7]
    assert list(lines["cosmos"].get_xdata()) == [0.01, 0.02, 0.03]
    assert lines["cosmos"].get_color() == plots.method_style("cosmos")["color"]
    assert ax.get_xscale() == "log"  # three decades apart
    near = plots.traffic_figure(curves, [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]])
    assert near.axes[0].get_xscale() == "linear"
    zero = plots.traffic_figure(curves, [[0.0, 20.0, 30.0], [0.01, 0.02, 0.03]])
    assert zero.axes[0].get_xscale() == "symlog"  # a 0 has no place on a log axis
    with pytest.raises(ValueError, match="3 rounds but 2 traffic values"):
        plots.traffic_figure(curves[:1], [[1.0, 2.0]])
    import matplotlib.pyplot as plt

    plt.close("all")


def test_client_accuracy_figure_shows_every_client_in_its_methods_colour():
    fig = plots.client_accuracy_figure([("fedavg", "fedavg", [0.2, 0.9, 0.8]), ("local", "local", [0.5, 0.6])])
    ax = fig.axes[0]
    dots = ax.collections  # one scatter per method
    assert [sorted(c.get_offsets()[:, 1].tolist()) for c in dots] == [[0.2, 0.8, 0.9], [0.5, 0.6]]
    for c, method, x in zip(dots, ("fedavg", "local"), (0, 1)):
        assert np.allclose(
            c.get_facecolor()[0][:3],
            np.array([int(plots.method_style(method)["color"][i : i + 2], 16) / 255 for i in (1, 3, 5)]),
        )
        assert all(abs(v - x - 0.32) <= 0.06 for v in c.get_offsets()[:, 0])  # beside its own box
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fedavg", "local"]
    medians = [ln for ln in ax.get_lines() if ln.get_linewidth() == 2]
    assert [ln.get_ydata()[0] for ln in medians] == [pytest.approx(0.8), pytest.approx(0.55)]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_png_bytes_is_a_png():
    png = plots.png_bytes(plots.client_accuracy_figure([("a", "fedavg", [0.5])]))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
