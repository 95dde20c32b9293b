"""The benchmarks' figures on disk: each run of a ``bench/*.py`` appends one row to ``bench/results/<bench>.csv``.

A row holds when (UTC), the git commit, the command line, the machine (cores, memory, GPU) and the bench's own
headline figures (its last printed line). ``python -m fedapps_tools.docgen`` tabulates the latest rows into
docs/reference/benchmarks/<bench>.md, which docs/performance.md includes: a figure on a page always comes with
the command and commit that produced it, and none is typed by hand.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
RESULTS_ENV = "FEDAPPS_BENCH_RESULTS"  # another folder for the CSVs (a test, or figures kept apart)
FIXED_COLUMNS = ("date_utc", "commit", "command", "machine")


def results_dir() -> Path:
    """Where the CSVs are: $FEDAPPS_BENCH_RESULTS, else bench/results/."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit (short), with ``+dirty`` when tracked files differ from it; 'unknown' without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ""


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> list[str]:
    """GPU names: through torch when the bench imported it, else nvidia-smi when present; [] when none is seen."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            return [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return []


def machine() -> str:
    """One line: usable cores (and the CPU model), memory, GPUs, e.g. '2 cores (AMD EPYC 7B13), 24 GiB, no GPU'."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = _cpu_model()
    parts = [f"{cores} cores" + (f" ({model})" if model else "")]
    mem = _memory_gib()
    if mem is not None:
        parts.append(f"{mem:.0f} GiB")
    gpus = _gpus()
    parts.append(", ".join(f"{gpus.count(g)}× {g}" for g in dict.fromkeys(gpus)) if gpus else "no GPU")
    return ", ".join(parts)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The bench's command as a user types it from the repository root: ``python bench/x.py --flag ...``."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(argv[0])
    return shlex.join(["python", shown, *argv[1:]])


def figure_text(value: object) -> str:
    """A figure as stored: floats to 6 significant digits, everything else as is."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, ".6g")
    return str(value)


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """A bench CSV's header and rows ([], [] when the file does not exist)."""
    if not path.is_file():
        return [], []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def append_row(
    bench: str,
    figures: Mapping[str, object],
    argv: Sequence[str] | None = None,
    folder: Path | None = None,
    when: dt.datetime | None = None,
) -> Path:
    """Append one row (date, commit, command, machine, ``figures``) to ``<folder>/<bench>.csv`` and return its path.

    A figure the file has no column for yet widens the header (earlier rows get an empty cell); figures named like
    a fixed column are refused."""
    clash = sorted(set(figures) & set(FIXED_COLUMNS))
    if clash:
        raise ValueError(f"bench {bench}: figure names {clash} are reserved for the row's own columns; rename them")
    if not figures:
        raise ValueError(f"bench {bench}: no figures to record")
    path = (folder or results_dir()) / f"{bench}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    when = when or dt.datetime.now(dt.UTC)
    row = {
        "date_utc": when.strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "command": command_line(argv),
        "machine": machine(),
        **{k: figure_text(v) for k, v in figures.items()},
    }
    header, rows = read_rows(path)
    if header and set(row) <= set(header):
        with path.open("a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=header, restval="").writerow(row)
        return path
    header = header or list(FIXED_COLUMNS)
    header += [k for k in row if k not in header]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows([*rows, row])
    tmp.replace(path)
    return path


def record(bench: str, figures: Mapping[str, object]) -> None:
    """What a bench calls at its end: append its row and say where (on stderr, after its figures)."""
    path = append_row(bench, figures)
    print(f"recorded in {path}", file=sys.stderr)
