"""`fedapps report RESULT_DIR`: the summary of a run folder (a comparison folder: its table) on stdout, or with
--html one self-contained HTML page of it (:mod:`fedapps_tools.html_report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedapps_tools import launch
from fedapps_tools.summary import print_summary


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="print the summary of a run folder (a comparison or tune folder: its table; a folder of results: "
        "an index), or with --html write one self-contained HTML report of it (a folder of results: index.html)",
        description="Print the summary of a run folder (a comparison or tune folder: its table; a folder of results: "
        "an index of them), or with --html write one self-contained HTML report of it (a folder of results: one "
        "sortable index.html linking every run, comparison and tuning under it to its report).",
    )
    p.add_argument(
        "result_dir",
        metavar="RESULT_DIR",
        help="a run folder (<output-dir>/<run-name>), a `fedapps compare` or `fedapps tune` folder, or a folder "
        "holding any of them (e.g. results: with --html an index page of them all, sortable, linking each report)",
    )
    p.add_argument(
        "--html",
        action="store_true",
        help="write a static HTML page (table, curves, per-client spread, strategy figures; no network "
        "needed to view it) and print its path",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="the folder --html writes report.html into (default: RESULT_DIR)"
    )
    return p


def run(args: argparse.Namespace) -> int:
    """The HTML page, or the summary table (a run folder) or comparison.md (a comparison folder) on stdout."""
    from fedapps_tools import results_index
    from fedapps_tools.html_report import ReportError, folder_kind, write_report

    launch.start_logging(args)
    folder = Path(args.result_dir).expanduser()
    try:
        kind = folder_kind(folder)
        if args.html and kind is None:  # a folder of results: the index of every run, comparison and tuning in it
            out = str(Path(args.out) / results_index.INDEX_NAME) if args.out else None
            page, folders, problems = results_index.write_index(folder, out)
            for problem in problems:
                print(f"report: not indexed: {problem}", file=sys.stderr)
            print(f"report: {page} (index of {folders} result folders, each linked to its report)")
            return 0
        if args.html:
            print(f"report: {write_report(folder, html_file(args.out))}")
            return 0
        if args.out:
            raise ReportError("--out names the folder of the HTML page: add --html")
        if kind == "run":
            print_summary(folder)
        elif kind in ("comparison", None) and (folder / "comparison.md").is_file():
            print((folder / "comparison.md").read_text(), end="")
        elif kind == "tune" and (folder / "tuning.md").is_file():
            print((folder / "tuning.md").read_text(), end="")
        else:
            print(results_index.index_text(folder), end="")
    except ReportError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    return 0


def html_file(out: str | None) -> str | None:
    """``--out DIR`` -> DIR/report.html. A name ending in .html (the option named the file until 0.x) is still taken
    as the file, with a deprecation message."""
    from fedapps_tools.html_report import REPORT_NAME

    if not out:
        return None
    if out.endswith((".html", ".htm")):
        print(
            f"report: --out {out}: --out names a folder now (report.html is written into it); "
            "a file name is deprecated and still honoured this time",
            file=sys.stderr,
        )
        return out
    return str(Path(out) / REPORT_NAME)
