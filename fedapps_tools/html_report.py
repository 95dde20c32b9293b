"""`fedapps report DIR --html`: one self-contained static HTML page for a run folder, a `fedapps compare` folder
or a `fedapps tune` folder (one row per grid point, on the validation split).

The page holds the results table (mean ± SEM over seeds, fairness across clients, traffic, wall time, the
protocol), accuracy against rounds and against cumulative traffic, the spread of the clients' accuracies per
method, the strategies' own figures (cwFedAvg's clients × classes heatmaps, COSMOS's clusters) and one row per
run. Figures are embedded as base64 PNG, drawn by :mod:`fedapps.reporting.plots` in the project's one style; there is no
script and nothing external (no CSS, font or image is fetched when the page is viewed).
"""

from __future__ import annotations

import base64
import csv
import html
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedapps.reporting import plots
from fedapps.reporting.results import read_csv
from fedapps_tools.compare import Line, _pm, comparison_curves, setting_label, summarise_runs

log = logging.getLogger("fedapps")

MIB = 1024 * 1024
MB = 1e6
REPORT_NAME = "report.html"
# the run folder's own figure, redrawn here; every other PNG in a run folder is a strategy's figure
RUN_FIGURE = "accuracy.png"
# what a strategy's figure shows (by file name); a figure not listed is captioned by its file name
FIGURE_CAPTIONS = {
    "weight_norms.png": "clients × classes: the true class distribution p (where the simulation knows it) and the "
    "normalised classifier row norms p̃ the server estimates it from, first and last round",
    "clusters.png": "left: each client's cluster as found (filled) against its true group (ring); right: the "
    "distance matrix between clients' predictions on the public set, ordered by true group",
}
# comparison.csv columns that are text; every other column is a number
TEXT_COLUMNS = ("config", "strategy")
# the results table: (header, summary key or None) — accuracy columns as mean ± SEM over seeds
ACCURACY_COLUMNS = (
    ("accuracy (mean over clients)", "accuracy_mean"),
    ("accuracy (sample-weighted)", "accuracy_weighted"),
    ("worst 10 % of clients", "accuracy_worst10"),
    ("std over clients", "accuracy_std"),
    ("after local training (mean)", "accuracy_after_training_mean"),
)
RESULTS_HEADER = (
    ["config", "strategy", "seeds"]
    + [h for h, _ in ACCURACY_COLUMNS]
    + ["up, MiB per client per round", "down, MiB per client per round", "wall s", "protocol"]
)


class ReportError(ValueError):
    """A folder the report cannot be made from (names the folder and what it lacks)."""


@dataclass
class Run:
    """One run folder: its seed, summary.json and rounds.csv rows."""

    path: Path
    seed: int
    summary: dict[str, Any]
    rows: list[dict[str, Any]]


@dataclass
class Group:
    """One config of the report (one row of the results table): its label, strategy, data setting, table row
    (comparison.csv's, or a single run's summary) and its run folders, one per seed found."""

    label: str
    method: str
    setting: str
    row: dict[str, Any]
    runs: list[Run]
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading folders


def load_run(path: Path) -> Run:
    """A run folder's summary.json and rounds.csv (a missing or unreadable summary: ReportError)."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}/summary.json cannot be read ({exc}); is {path} a finished run folder?") from exc
    if not isinstance(summary, dict):
        raise ReportError(f"{path}/summary.json is not a run summary (a JSON object)")
    rows = read_csv(path / "rounds.csv") if (path / "rounds.csv").is_file() else []
    seed = summary.get("seed")
    return Run(path, int(seed) if isinstance(seed, int) else 0, summary, rows)


def run_setting(run: Run) -> str:
    """The run's data setting in words (:func:`fedapps_tools.compare.setting_label` of its config.yaml); from
    summary.json where the config no longer loads (written by an older version)."""
    from fedapps.config import ConfigError, load_config

    try:
        return setting_label(load_config(run.path / "config.yaml"))
    except (ConfigError, OSError, ValueError, TypeError, KeyError):
        s = run.summary
        return f"{s.get('dataset', '?')} {s.get('partition', '?')}, {s.get('num_clients', '?')} clients"


def seed_runs(runs_dir: Path, label: str) -> list[Run]:
    """The finished run folders of config ``label`` in a comparison's ``runs/`` (``<label>-s<seed>``, as
    `fedapps compare` names them), by seed."""
    pattern = re.compile(re.escape(label) + r"-s(\d+)")
    found = []
    if runs_dir.is_dir():
        for p in runs_dir.iterdir():
            m = pattern.fullmatch(p.name)
            if m and (p / "summary.json").is_file():
                found.append((int(m.group(1)), p))
    return [load_run(p) for _, p in sorted(found)]


def _number(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def read_comparison(path: Path) -> list[dict[str, Any]]:
    """comparison.csv's rows: config and strategy as text (a config named ``1`` stays ``1``), numbers as floats
    (NaN where empty), ``seeds`` as an int."""
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = []
    for r in rows:
        row: dict[str, Any] = {k: (v if k in TEXT_COLUMNS else _number(v)) for k, v in r.items()}
        row["seeds"] = int(row["seeds"]) if math.isfinite(row.get("seeds", math.nan)) else 0
        out.append(row)
    return out


TUNE_COLUMNS = ("point", "seed", "reused", "run_dir", "wall_seconds")  # tuning.csv's columns besides the grid's


def load_tune_groups(folder: Path) -> list[Group]:
    """A `fedapps tune` folder: one group per grid point (label ``p<n>: key=value, ...``), its runs
    ``runs/p<n>-s<seed>`` summarised as a comparison's row (their accuracies are on the validation split, as their
    summaries say)."""
    with (folder / "tuning.csv").open(newline="") as fh:
        reader = csv.DictReader(fh)
        keys = [k for k in reader.fieldnames or [] if k not in TUNE_COLUMNS and not k.startswith("val_")]
        rows = list(reader)
    groups = []
    for point in dict.fromkeys(r["point"] for r in rows):
        first = next(r for r in rows if r["point"] == point)
        label = f"p{point}: " + ", ".join(f"{k}={first[k]}" for k in keys)
        runs = seed_runs(folder / "runs", f"p{point}")
        if not runs:
            groups.append(
                Group(
                    label, "", "", {"config": label, "seeds": 0}, [], [f"no finished run folder runs/p{point}-s<seed>/"]
                )
            )
            continue
        row = summarise_runs(label, [r.summary for r in runs])
        groups.append(Group(label, str(row.get("strategy", "")), run_setting(runs[0]), row, runs))
    if not groups:
        raise ReportError(f"{folder}/tuning.csv has no rows; rerun `fedapps tune`")
    return groups


def folder_kind(folder: Path) -> str | None:
    """What `fedapps` wrote ``folder`` as: "comparison", "tune", "run", or None (none of those)."""
    if (folder / "comparison.csv").is_file():
        return "comparison"
    if (folder / "tuning.csv").is_file():
        return "tune"
    if (folder / "summary.json").is_file():
        return "run"
    return None


def load_groups(folder: Path) -> tuple[str, list[Group]]:
    """("comparison", one group per comparison.csv row), ("tune", one group per grid point of tuning.csv) or
    ("run", one group of the folder's run)."""
    if folder_kind(folder) == "tune":
        return "tune", load_tune_groups(folder)
    if (folder / "comparison.csv").is_file():
        groups = []
        for row in read_comparison(folder / "comparison.csv"):
            label = str(row.get("config", ""))
            runs = seed_runs(folder / "runs", label)
            notes = []
            if not runs:
                notes.append(f"no finished run folder runs/{label}-s<seed>/ found: no figures for this config")
            elif len(runs) != row["seeds"]:
                notes.append(
                    f"runs/ holds {len(runs)} finished runs of {label} (seeds "
                    f"{', '.join(str(r.seed) for r in runs)}) while comparison.csv averaged {row['seeds']}; "
                    "the figures use all of them"
                )
            setting = run_setting(runs[0]) if runs else ""
            groups.append(Group(label, str(row.get("strategy", "")), setting, row, runs, notes))
        if not groups:
            raise ReportError(f"{folder}/comparison.csv has no rows; rerun `fedapps compare`")
        return "comparison", groups
    if (folder / "summary.json").is_file():
        run = load_run(folder)
        label = str(run.summary.get("run_name") or folder.name)
        row = summarise_runs(label, [run.summary])
        return "run", [Group(label, str(run.summary.get("strategy", "")), run_setting(run), row, [run])]
    raise ReportError(
        f"'{folder}' is neither a run folder (summary.json), a `fedapps compare` folder (comparison.csv) nor a "
        "`fedapps tune` folder (tuning.csv); pass one of those (e.g. results/comparison or results/<run-name>)"
    )


# --------------------------------------------------------------------------- what the figures show


def final_client_accuracies(run: Run) -> list[float]:
    """The deployed models' accuracy of each measured client after the run's last measured round (its
    ``acc_client_<i>`` columns of the ``final_round`` row; the last row with ``acc_mean`` where the summary has
    none), in client-id order."""
    final = run.summary.get("final_round")
    measured = [r for r in run.rows if isinstance(r.get("acc_mean"), (int, float))]
    row = next((r for r in run.rows if r.get("round") == final), None) if final is not None else None
    if row is None:
        row = measured[-1] if measured else {}
    clients = sorted(
        (int(k[len("acc_client_") :]), float(v))
        for k, v in row.items()
        if k.startswith("acc_client_") and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    return [v for _, v in clients]


def cumulative_megabytes(rows: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per round, the training traffic of the whole federation so far: the sum of ``bytes_up + bytes_down`` over
    this and every earlier round, in MB (10⁶ bytes)."""
    total = 0.0
    out = {}
    for r in sorted(rows, key=lambda r: int(r["round"])):
        total += sum(float(r.get(k) or 0) for k in ("bytes_up", "bytes_down"))
        out[int(r["round"])] = total / MB
    return out


def traffic_at(runs: Sequence[Run], rounds: Sequence[int]) -> list[float]:
    """The mean over the runs (seeds) of the cumulative traffic (:func:`cumulative_megabytes`) at each round."""
    per_run = [cumulative_megabytes(r.rows) for r in runs]
    return [float(np.mean([mb[rnd] for mb in per_run if rnd in mb])) for rnd in rounds]


# --------------------------------------------------------------------------- HTML pieces


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _plain(v: Any, fmt: str = ".4f") -> str:
    """A number for a cell; '-' where there is none."""
    x = _number(v)
    return "-" if not math.isfinite(x) else format(x, fmt)


def results_cells(group: Group, single_run: bool) -> list[str]:
    """The results table's cells of one config (the text of comparison.md's row, plus the protocol): accuracies
    as mean ± SEM over seeds (a single run's without ±), MiB per client per round, wall seconds."""
    r = group.row
    acc = [(_plain(r.get(key)) if single_run else _pm(r, key)) for _, key in ACCURACY_COLUMNS]
    protocols = sorted(
        {
            f"{s.get('protocol', '?')} ({s.get('evaluated_on', 'test')} split)"
            for s in (run.summary for run in group.runs)
        }
    )
    return (
        [group.label, group.method, str(r.get("seeds", len(group.runs)))]
        + acc
        + [
            _plain(_number(r.get("bytes_up_per_client_round")) / MIB, ".3f"),
            _plain(_number(r.get("bytes_down_per_client_round")) / MIB, ".3f"),
            _plain(r.get("wall_seconds"), ".0f"),
            ", ".join(protocols) or "-",
        ]
    )


def html_table(table_id: str, header: Sequence[str], rows: Sequence[Sequence[str]], numeric: range) -> str:
    """A table (scrolling sideways where the page is narrower); cells of the ``numeric`` columns are right-aligned
    numbers."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "\n".join(
        "<tr>"
        + "".join(f'<td class="{"num" if i in numeric else "txt"}">{_esc(c)}</td>' for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return (
        f'<div class="wide"><table id="{table_id}">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n'
        "</table></div>"
    )


def run_cells(group: Group, run: Run) -> list[str]:
    s = run.summary
    return [
        group.label,
        str(run.seed),
        group.method,
        _plain(s.get("accuracy_mean")),
        _plain(s.get("accuracy_worst10")),
        _plain(s.get("accuracy_std")),
        _plain(s.get("final_round"), ".0f"),
        _plain(s.get("final_round_measured_clients"), ".0f"),
        _plain((_number(s.get("bytes_up")) + _number(s.get("bytes_down"))) / MB, ".3f"),
        _plain(s.get("wall_seconds"), ".1f"),
        run.path.name,
    ]


RUNS_HEADER = [
    "config",
    "seed",
    "strategy",
    "accuracy (mean over clients)",
    "worst 10 % of clients",
    "std over clients",
    "final round",
    "clients measured",
    "traffic MB (up + down)",
    "wall s",
    "folder",
]


def img(png: bytes, alt: str) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" alt="{_esc(alt)}">'


def figure(draw: Callable[[], Any], alt: str, caption: str) -> str:
    """A figure drawn by ``draw()`` (a matplotlib Figure), embedded; where drawing fails the page says so and
    everything else is still written."""
    try:
        png = plots.png_bytes(draw())
    except Exception as exc:  # noqa: BLE001 - a figure never costs the rest of the report
        log.warning("report: could not draw %s: %s", alt, exc)
        return f'<p class="note">{_esc(alt)}: could not be drawn ({_esc(exc)})</p>'
    return f"<figure>{img(png, alt)}<figcaption>{_esc(caption)}</figcaption></figure>"


STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;margin:24px auto;
max-width:1240px;padding:0 16px;color:#1a1a1a;background:#fff;line-height:1.4}
h1{font-size:1.5em;margin-bottom:4px}h2{font-size:1.2em;margin-top:32px;border-bottom:1px solid #ddd}
h3{font-size:1.05em;margin-bottom:4px}.meta,.note,figcaption{color:#555;font-size:.9em}
.note{color:#8a4b00}table{border-collapse:collapse;font-size:.82em;margin:8px 0}
th,td{border:1px solid #ccc;padding:4px 7px}th{background:#f2f2f2;text-align:left;vertical-align:bottom}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:nth-child(even){background:#fafafa}.wide{overflow-x:auto}figure{margin:12px 0}
img{max-width:100%;height:auto}pre{background:#f6f6f6;padding:8px;font-size:.8em;overflow:auto}
"""

PROTOCOL_TEXT = (
    "Protocol: the deployed models after the last round (docs/evaluation.md), each measured on its "
    "client's own evaluation split. Worst 10 %: the mean accuracy of the worst ⌈10 % of n⌉ of the n "
    "clients; std: the population standard deviation of the clients' accuracies."
)


def heading(folder: Path, groups: list[Group], single: bool) -> list[str]:
    """Title and what the folder holds."""
    out = [f"<h1>fedapps report: {_esc(folder.name)}</h1>"]
    if single:
        g = groups[0]
        s = g.runs[0].summary
        out.append(
            f'<p class="meta">Run folder {_esc(folder)}: {_esc(g.method)} on {_esc(g.setting)}, '
            f"{_esc(s.get('rounds', '?'))} rounds, seed {_esc(s.get('seed', '?'))}.</p>"
        )
    else:
        seeds = ", ".join(map(str, sorted({run.seed for g in groups for run in g.runs}))) or "-"
        settings = "; ".join(sorted({g.setting for g in groups if g.setting})) or "-"
        if (folder / "tuning.csv").is_file():
            out.append(
                f'<p class="meta">Tuning folder {_esc(folder)} (<code>fedapps tune</code>): {len(groups)} grid '
                f"points, seeds {_esc(seeds)}; settings: {_esc(settings)}. The accuracies are on the validation "
                "split, the one the choice (chosen.yaml) is made on.</p>"
            )
        else:
            out.append(
                f'<p class="meta">Comparison folder {_esc(folder)} (<code>fedapps compare</code>): '
                f"{len(groups)} configs, seeds {_esc(seeds)}; settings: {_esc(settings)}.</p>"
            )
    return out


def results_section(groups: list[Group], single: bool) -> list[str]:
    """The results table, its protocol, and what did not add up (run folders missing)."""
    spread = "One run: no spread over seeds." if single else "± is the SEM over seeds."
    return [
        "<h2>Results</h2>",
        f'<p class="meta">{_esc(PROTOCOL_TEXT)} {spread}</p>',
        html_table(
            "results", RESULTS_HEADER, [results_cells(g, single) for g in groups], range(2, len(RESULTS_HEADER) - 1)
        ),
    ] + [f'<p class="note">{_esc(g.label)}: {_esc(n)}</p>' for g in groups for n in g.notes]


def curves_section(groups: list[Group], single: bool) -> list[str]:
    """Accuracy against rounds and against traffic, and the clients' accuracies per method."""
    drawn = [g for g in groups if any(run.rows for run in g.runs)]
    curves = comparison_curves([Line(g.method, g.setting, g.label, [run.rows for run in g.runs]) for g in drawn])
    out = ["<h2>Accuracy against rounds</h2>"]
    if single:
        g = groups[0]
        out.append(
            figure(
                lambda: plots.accuracy_figure(g.runs[0].rows, title=g.label, method=g.method),
                "accuracy against rounds",
                "The deployed models (mean over clients, sample-weighted, "
                "worst 10 % of clients) and the models right after local training, after each round.",
            )
        )
    else:
        out.append(
            figure(
                lambda: plots.comparison_figure(curves),
                "accuracy against rounds",
                "The deployed models' accuracy after each round, mean over clients (left) and over the "
                "worst 10 % of clients (right); line: mean over seeds, band: ± SEM.",
            )
        )
    megabytes = [traffic_at(g.runs, c.rounds) for g, c in zip(drawn, curves)]
    out += [
        "<h2>Accuracy against traffic</h2>",
        figure(
            lambda: plots.traffic_figure(curves, megabytes, over_seeds=not single),
            "accuracy against traffic",
            "The same accuracy (mean over clients) against the training traffic of the whole federation so "
            "far (bytes up + down of every round up to that one" + ("" if single else ", mean over seeds") + ").",
        ),
    ]
    spread = [
        (c.label, g.method, [a for run in g.runs for a in final_client_accuracies(run)]) for g, c in zip(drawn, curves)
    ]
    out += [
        "<h2>Accuracy per client</h2>",
        figure(
            lambda: plots.client_accuracy_figure(spread),
            "accuracy per client",
            "Each client's deployed-model accuracy after the last measured round"
            + ("" if single else ", every seed's clients pooled (one dot per client and seed)")
            + "; box: quartiles and median, whiskers: the furthest values within 1.5 IQR.",
        ),
    ]
    return out


def strategy_section(groups: list[Group], single: bool) -> list[str]:
    """Per config: the figures its strategy wrote into the (first seed's) run folder, and the resolved config."""
    out = ["<h2>Strategy figures and configs</h2>"]
    for g in groups:
        out.append(f"<h3>{_esc(g.label)} ({_esc(g.method)}{'; ' + _esc(g.setting) if g.setting else ''})</h3>")
        if not g.runs:
            out.append('<p class="note">no run folder found</p>')
            continue
        run = g.runs[0]
        own = sorted(p for p in run.path.glob("*.png") if p.name != RUN_FIGURE)
        where = "" if single else f" (seed {run.seed}; the other seeds' are in their run folders)"
        for p in own:
            caption = f"{p.name}{where}: {FIGURE_CAPTIONS.get(p.name, 'figure written by the strategy')}"
            out.append(f"<figure>{img(p.read_bytes(), p.name)}<figcaption>{_esc(caption)}</figcaption></figure>")
        if not own:
            out.append(f'<p class="meta">{_esc(g.method)} writes no figure of its own.</p>')
        config = run.path / "config.yaml"
        if config.is_file():
            out.append(
                f"<details><summary>resolved config ({_esc(run.path.name)}/config.yaml)</summary>"
                f"<pre>{_esc(config.read_text())}</pre></details>"
            )
    return out


def render(folder: Path) -> str:
    """The report page of a run folder or a comparison folder (see the module docstring), as HTML text."""
    folder = Path(folder)
    kind, groups = load_groups(folder)
    single = kind == "run"
    parts = (
        heading(folder, groups, single)
        + results_section(groups, single)
        + curves_section(groups, single)
        + strategy_section(groups, single)
        + [
            "<h2>Runs</h2>",
            html_table(
                "runs",
                RUNS_HEADER,
                [run_cells(g, run) for g in groups for run in g.runs],
                range(1, len(RUNS_HEADER) - 1),
            ),
        ]
    )
    body = "\n".join(parts)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>fedapps report: {_esc(folder.name)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n"
        "</body>\n</html>\n"
    )


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write :func:`render`'s page to ``out`` (default ``<folder>/report.html``) and return its path."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise ReportError(f"'{folder}' is not a folder; pass a run folder or a `fedapps compare` folder")
    path = Path(out).expanduser().resolve() if out else folder / REPORT_NAME
    page = render(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(
            f"cannot write the report to '{path}' ({exc.strerror or exc}); pass --out DIR, a folder you can write"
        ) from exc
    return path
