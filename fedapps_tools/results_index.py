"""`fedapps report ROOT --html` on a folder of results: one page indexing every run, comparison and tune folder in it.

Each folder `fedapps` wrote (a run: summary.json; a comparison: comparison.csv; a tuning: tuning.csv) is found by
walking ROOT (a comparison's or tuning's own ``runs/`` belong to it and are not listed again). The index has one row
per config of a comparison, per grid point of a tuning, and per run: its kind, folder, config, strategy, data setting,
headline (the deployed models' accuracy after the last round, mean over clients, ± SEM over seeds), seeds, rounds,
the split it was measured on and the date, with a link to the folder's own report (written by
:func:`fedapps_tools.html_report.write_report` where it is missing or older than the folder's results). Clicking a
column header sorts the table by it; the page's one script is inline, it loads nothing and needs no server. The page
opened with ``#sort=<column>`` (``#sort=<column>:desc``) starts sorted.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedapps_tools.html_report import REPORT_NAME, STYLE, ReportError, folder_kind, load_groups, write_report

INDEX_NAME = "index.html"
# what marks a folder as written by `fedapps` (its report is out of date when one of them is newer)
RESULT_FILES = ("summary.json", "comparison.csv", "tuning.csv", "rounds.csv")
SKIPPED_DIRS = {"tensorboard", "mlruns", "client-state", "server-state", "__pycache__"}
COLUMNS = (
    ("kind", False),
    ("folder", False),
    ("config", False),
    ("strategy", False),
    ("setting", False),
    ("accuracy", True),
    ("± SEM", True),
    ("seeds", False),
    ("rounds", True),
    ("split", False),
    ("date (UTC)", False),
)


@dataclass
class Entry:
    """One row of the index: a config of a comparison, a grid point of a tuning, or a run."""

    kind: str
    folder: Path
    config: str
    strategy: str
    setting: str
    accuracy: float
    sem: float
    seeds: list[int]
    rounds: str
    split: str
    date: str
    report: Path | None = None
    note: str = ""


def result_folders(root: Path) -> Iterator[tuple[str, Path]]:
    """(kind, folder) of every run, comparison and tune folder under ``root`` (``root`` itself included), sorted
    by path; the ``runs/`` of a comparison or a tuning are part of it and not walked."""
    for current, dirs, _ in os.walk(root):
        here = Path(current)
        kind = folder_kind(here)
        if kind is not None:
            dirs[:] = []  # a run's state folders, a comparison's or tuning's runs/: part of this folder
            yield kind, here
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)


def _num(v: Any) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return math.nan
    return x


def newest_result(folder: Path) -> float:
    """The modification time of the newest of the folder's result files (and of its runs' summaries)."""
    times = [p.stat().st_mtime for p in (folder / name for name in RESULT_FILES) if p.is_file()]
    runs = folder / "runs"
    if runs.is_dir():
        times += [p.stat().st_mtime for p in runs.glob("*/summary.json")]
    return max(times, default=0.0)


def utc_date(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%d %H:%M") if timestamp else ""


def folder_entries(kind: str, folder: Path) -> list[Entry]:
    """The rows of one folder (ReportError: it cannot be read)."""
    _, groups = load_groups(folder)
    date = utc_date(newest_result(folder))
    out = []
    for g in groups:
        summaries = [r.summary for r in g.runs]
        rounds = sorted({str(s.get("rounds", "?")) for s in summaries})
        splits = sorted({str(s.get("evaluated_on", "test")) for s in summaries})
        out.append(
            Entry(
                kind=kind,
                folder=folder,
                config=g.label if kind != "run" else "",
                strategy=g.method,
                setting=g.setting,
                accuracy=_num(g.row.get("accuracy_mean")),
                sem=_num(g.row.get("accuracy_mean_sem")) if len(g.runs) > 1 else math.nan,
                seeds=sorted(r.seed for r in g.runs),
                rounds=", ".join(rounds),
                split=", ".join(splits),
                date=date,
                note="; ".join(g.notes),
            )
        )
    return out


def ensure_report(folder: Path) -> Path:
    """The folder's report.html, written (again) where it is missing or older than the folder's results."""
    page = folder / REPORT_NAME
    if not page.is_file() or page.stat().st_mtime < newest_result(folder):
        write_report(folder)
    return page


def collect(root: Path, reports: bool = True) -> tuple[list[Entry], list[str]]:
    """Every row under ``root`` and the problems met (a folder that cannot be read is listed as a problem, not
    fatal); with ``reports`` each folder's report is written where it is missing or stale."""
    entries: list[Entry] = []
    problems: list[str] = []
    for kind, folder in result_folders(root):
        try:
            rows = folder_entries(kind, folder)
            page = ensure_report(folder) if reports else None
        except (ReportError, OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            problems.append(f"{folder}: {exc}")
            continue
        for e in rows:
            e.report = page
        entries.extend(rows)
    return entries, problems


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(x: float, spec: str = ".4f") -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def seeds_text(seeds: Sequence[int]) -> str:
    return ", ".join(map(str, seeds)) if seeds else "-"


def cells(e: Entry, root: Path, index_dir: Path) -> list[tuple[str, str]]:
    """(HTML of the cell, its sort key) for each column."""
    name = str(e.folder.relative_to(root)) if e.folder != root else e.folder.name
    if e.report is not None:
        href = Path(os.path.relpath(e.report, index_dir)).as_posix()
        folder = f'<a href="{_esc(href)}">{_esc(name)}</a>'
    else:
        folder = _esc(name)
    config = _esc(e.config) + (f'<br><span class="note">{_esc(e.note)}</span>' if e.note else "")
    return [
        (_esc(e.kind), e.kind),
        (folder, name),
        (config, e.config),
        (_esc(e.strategy), e.strategy),
        (_esc(e.setting), e.setting),
        (_fmt(e.accuracy), repr(e.accuracy) if math.isfinite(e.accuracy) else ""),
        (_fmt(e.sem), repr(e.sem) if math.isfinite(e.sem) else ""),
        (_esc(seeds_text(e.seeds)), f"{len(e.seeds):04d} {seeds_text(e.seeds)}"),
        (_esc(e.rounds), e.rounds),
        (_esc(e.split), e.split),
        (_esc(e.date), e.date),
    ]


# Sorting: a click on a header sorts by its column (again: the other way); numbers by value (no value: last),
# text by its text. #sort=<column>[:desc] in the address sorts when the page opens.
SCRIPT = """
(function () {
  function key(row, i, numeric) {
    var v = row.cells[i].getAttribute('data-sort');
    if (!numeric) { return v.toLowerCase(); }
    return v === '' ? null : parseFloat(v);
  }
  function sortBy(table, i, dir) {
    var head = table.tHead.rows[0].cells, numeric = head[i].classList.contains('num');
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a, i, numeric), y = key(b, i, numeric);
      if (x === null || y === null) { return (x === null) - (y === null); }
      var c = x < y ? -1 : (x > y ? 1 : 0);
      return dir === 'desc' ? -c : c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    for (var j = 0; j < head.length; j++) { head[j].removeAttribute('aria-sort'); }
    head[i].setAttribute('aria-sort', dir === 'desc' ? 'descending' : 'ascending');
  }
  var table = document.getElementById('index');
  if (!table) { return; }
  var head = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(head, function (th, i) {
    th.addEventListener('click', function () {
      sortBy(table, i, th.getAttribute('aria-sort') === 'ascending' ? 'desc' : 'asc');
    });
  });
  var m = /^#sort=([^:]+)(?::(asc|desc))?$/.exec(decodeURIComponent(window.location.hash));
  if (m) {
    Array.prototype.forEach.call(head, function (th, i) {
      if (th.getAttribute('data-column') === m[1]) { sortBy(table, i, m[2] || 'asc'); }
    });
  }
})();
"""

INDEX_STYLE = (
    "th{cursor:pointer;user-select:none}th[aria-sort=ascending]::after{content:' ▲'}"
    "th[aria-sort=descending]::after{content:' ▼'}"
)


def render_index(root: Path, entries: Sequence[Entry], problems: Sequence[str], index_dir: Path) -> str:
    """The index page (see the module docstring) as HTML text."""
    head = "".join(
        f'<th data-column="{_esc(name)}" class="{"num" if numeric else "txt"}">{_esc(name)}</th>'
        for name, numeric in COLUMNS
    )
    body = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="{"num" if numeric else "txt"}" data-sort="{_esc(key)}">{shown}</td>'
            for (shown, key), (_, numeric) in zip(cells(e, root, index_dir), COLUMNS)
        )
        + "</tr>"
        for e in entries
    )
    kinds = {k: sum(1 for e in entries if e.kind == k) for k in ("run", "comparison", "tune")}
    folders = len({e.folder for e in entries})
    parts = [
        f"<h1>fedapps results: {_esc(root.name or root)}</h1>",
        (
            f'<p class="meta">{folders} folders under {_esc(root)}: {kinds["run"]} runs, {kinds["comparison"]} rows of '
            f"comparisons, {kinds['tune']} grid points of tunings. Accuracy: the deployed models after the last round, "
            "mean over clients, ± SEM over seeds (none with one seed), on the split named (a tuning's: validation). "
            "Click a column's header to sort by it; the folder links open each folder's report.</p>"
        ),
        (
            f'<div class="wide"><table id="index">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n'
            "</table></div>"
        ),
    ] + [f'<p class="note">not indexed: {_esc(p)}</p>' for p in problems]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>fedapps results: {_esc(root.name or root)}</title>\n<style>{STYLE}{INDEX_STYLE}</style>\n</head>\n"
        f"<body>\n" + "\n".join(parts) + f"\n<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )


def write_index(root: str | Path, out: str | Path | None = None) -> tuple[Path, int, list[str]]:
    """Write the index of ``root`` to ``out`` (default ``<root>/index.html``), each folder's report where missing
    or stale; return the page's path, the number of folders indexed and the problems met. ReportError: ``root`` is
    not a folder or holds no results."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise ReportError(f"'{root}' is not a folder; pass a results folder (e.g. results)")
    entries, problems = collect(root)
    if not entries:
        raise ReportError(
            f"no run, comparison or tune folder found under '{root}'"
            + (f" ({len(problems)} could not be read: {problems[0]})" if problems else "")
            + "; pass the folder `fedapps run`, `compare` or `tune` wrote into (e.g. results)"
        )
    path = Path(out).expanduser().resolve() if out else root / INDEX_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_index(root, entries, problems, path.parent), encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot write the index to '{path}' ({exc.strerror or exc}); pass --out FILE") from exc
    return path, len({e.folder for e in entries}), problems


def index_text(root: str | Path) -> str:
    """The index as plain text (``fedapps report ROOT`` without --html): one line per row, no report written."""
    root = Path(root).expanduser().resolve()
    entries, problems = collect(root, reports=False)
    if not entries:
        raise ReportError(
            f"'{root}' is neither a run folder (summary.json), a `fedapps compare` folder (comparison.csv), a "
            "`fedapps tune` folder (tuning.csv), nor a folder holding any of them; pass one of those"
        )
    lines = [f"{'kind':<10} {'accuracy':>8} {'± SEM':>7}  {'seeds':<8} {'strategy':<10} folder · config · setting"]
    for e in entries:
        name = str(e.folder.relative_to(root)) if e.folder != root else e.folder.name
        what = " · ".join(x for x in (name, e.config, e.setting) if x)
        lines.append(
            f"{e.kind:<10} {_fmt(e.accuracy):>8} {_fmt(e.sem):>7}  {seeds_text(e.seeds):<8} {e.strategy:<10} {what}"
        )
    lines += [f"not indexed: {p}" for p in problems]
    return "\n".join(lines) + "\n"
