"""The benchmarks' rows (fedapps_tools/benchrecord.py) and their tables on the docs site (fedapps_tools/docgen.py):
a row carries its date, commit, command and machine; a new figure widens the CSV without losing earlier rows; the
page shows the latest row of each command; every bench/*.py records under its own name."""

from __future__ import annotations

import csv
import datetime as dt
import re
import subprocess
from pathlib import Path

import pytest

from fedapps_tools import benchrecord, docgen

ROOT = Path(__file__).resolve().parent.parent


def when(minute: int) -> dt.datetime:
    return dt.datetime(2026, 1, 2, 3, minute, tzinfo=dt.UTC)


def rows_of(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def test_a_row_holds_date_commit_command_machine_and_the_figures(tmp_path):
    argv = [str(ROOT / "bench" / "startup.py"), "--repeat", "3"]
    path = benchrecord.append_row(
        "startup", {"startup_seconds": 12.3456789, "ok": True}, argv=argv, folder=tmp_path, when=when(4)
    )
    assert path == tmp_path / "startup.csv"
    header, rows = rows_of(path)
    assert header == ["date_utc", "commit", "command", "machine", "startup_seconds", "ok"]
    (row,) = rows
    assert row["date_utc"] == "2026-01-02 03:04"
    assert row["command"] == "python bench/startup.py --repeat 3"
    assert row["startup_seconds"] == "12.3457" and row["ok"] == "true"
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert row["commit"].removesuffix("+dirty") == head
    assert re.match(r"\d+ cores", row["machine"]) and ("GPU" in row["machine"])


def test_rows_append_and_a_new_figure_widens_the_header(tmp_path):
    argv = ["bench/scale.py"]
    benchrecord.append_row("scale", {"a": 1}, argv=argv, folder=tmp_path, when=when(1))
    benchrecord.append_row("scale", {"a": 2}, argv=argv, folder=tmp_path, when=when(2))
    benchrecord.append_row("scale", {"b": 3, "a": 4}, argv=argv, folder=tmp_path, when=when(3))
    header, rows = rows_of(tmp_path / "scale.csv")
    assert header == [*benchrecord.FIXED_COLUMNS, "a", "b"]
    assert [(r["a"], r["b"]) for r in rows] == [("1", ""), ("2", ""), ("4", "3")]
    assert [r["date_utc"][-2:] for r in rows] == ["01", "02", "03"]


def test_reserved_names_and_an_empty_row_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        benchrecord.append_row("x", {"commit": 1}, folder=tmp_path)
    with pytest.raises(ValueError, match="no figures"):
        benchrecord.append_row("x", {}, folder=tmp_path)
    assert not (tmp_path / "x.csv").exists()


def test_results_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(benchrecord.RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert benchrecord.append_row("b", {"v": 1}, argv=["bench/b.py"]) == tmp_path / "elsewhere" / "b.csv"
    monkeypatch.delenv(benchrecord.RESULTS_ENV)
    assert benchrecord.results_dir() == ROOT / "bench" / "results"


def test_commit_outside_a_checkout_is_unknown(tmp_path):
    assert benchrecord.git_commit(tmp_path) == "unknown"


def test_the_page_shows_the_latest_row_of_each_command_newest_first(tmp_path):
    for minute, argv, value in (
        (1, ["bench/b.py"], 1.0),
        (2, ["bench/b.py", "--fast"], 2.0),
        (3, ["bench/b.py"], 3.0),
        (4, ["bench/b.py", "--x"], 4.0),
    ):
        benchrecord.append_row("b", {"seconds": value}, argv=argv, folder=tmp_path, when=when(minute))
    benchrecord.append_row(
        "b", {"seconds": 5.0, "extra": "|<x>"}, argv=["bench/b.py", "--y"], folder=tmp_path, when=when(5)
    )
    page = docgen.benchmark_page("b", tmp_path / "b.csv")
    lines = [line for line in page.splitlines() if line.startswith("| 2026")]
    assert [line.split(" | ")[0] for line in lines] == [
        "| 2026-01-02 03:05",
        "| 2026-01-02 03:04",
        "| 2026-01-02 03:03",
        "| 2026-01-02 03:02",
    ]
    assert "`python bench/b.py`" in lines[2] and "| 3 |" in lines[2]  # the first command's latest row, not 1.0
    assert "| 1 |" not in page
    assert page.splitlines()[2].startswith("| Date (UTC) | Commit | Machine | Command | `seconds` | `extra` |")
    assert "\\|&lt;x>" in lines[0]  # a cell never breaks the table or opens an HTML tag
    limited = docgen.latest_rows(benchrecord.read_rows(tmp_path / "b.csv")[1], limit=2)
    assert [r["seconds"] for r in limited] == ["5", "4"]


def test_a_bench_without_rows_says_how_to_get_them(tmp_path):
    page = docgen.benchmark_page("startup", tmp_path / "startup.csv")
    assert "No figures recorded yet" in page and "python bench/startup.py" in page


def test_every_benchmark_records_under_its_own_name():
    """docgen finds a bench's CSV by the bench's file name: each bench/*.py with a __main__ records as itself."""
    names = docgen.bench_names()
    assert "startup" in names and "proctree" not in names
    for name in names:
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert re.search(rf'record\(\s*"{name}",', text), f'bench/{name}.py does not call record("{name}", ...)'
