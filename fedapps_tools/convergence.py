"""`python -m fedapps_tools.convergence RUN_DIR ...`: where a run's validation curve flattens.

Used to fix the number of rounds of a long run BEFORE its test-split runs (the evaluation protocol: nothing is
chosen by looking at test accuracy): run the setting on the validation split (``data.evaluate_on=validation``)
for more rounds than it needs, then read off the round after which the curve stops rising.

The curve is each round's deployed-model accuracy (mean over clients, rounds.csv ``acc_mean``), smoothed by a
trailing mean over ``window`` rounds (the rounds' own noise is ±0.01 on mnist5k). Its flattening round is the
first round r whose smoothed value is within ``tolerance`` of every later smoothed value's maximum, i.e. the run
gains at most ``tolerance`` after r; it is only reported when at least ``after`` rounds were observed past r (else
the run was too short to say). Each call appends one row per run to ``--csv`` with the command and commit.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

from fedapps.reporting.results import read_csv

WINDOW, TOLERANCE, AFTER = 20, 0.005, 100


def smoothed(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (over the values so far for the first window − 1)."""
    v = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(v)
    out = np.empty_like(v)
    for i in range(len(v)):
        lo = max(0, i - window + 1)
        out[i] = (sums[i] - (sums[lo - 1] if lo else 0.0)) / (i - lo + 1)
    return out


def flattening_index(
    values: list[float], window: int = WINDOW, tolerance: float = TOLERANCE, after: int = AFTER
) -> int | None:
    """The first index i with max(smoothed[i:]) − smoothed[i] <= tolerance and at least ``after`` values past it;
    None when no such index exists (the curve still rises, or the run is too short to tell)."""
    s = smoothed(values, window)
    if not len(s):
        return None
    best_after = np.maximum.accumulate(s[::-1])[::-1]  # max of s[i:]
    for i in range(len(s)):
        if best_after[i] - s[i] <= tolerance:
            return i if len(s) - 1 - i >= after else None
    return None


def curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """(rounds, acc_mean) of a run's measured rounds."""
    rows = [r for r in read_csv(run_dir / "rounds.csv") if isinstance(r.get("acc_mean"), (int, float))]
    return [int(r["round"]) for r in rows], [float(r["acc_mean"]) for r in rows]


def strategy_of(run_dir: Path) -> str:
    """The run's strategy: summary.json's, or (a run still going) its resolved config's."""
    if (run_dir / "summary.json").is_file():
        return str(json.loads((run_dir / "summary.json").read_text()).get("strategy", ""))
    import yaml

    raw = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    return str((raw or {}).get("strategy", {}).get("name", ""))


def describe(run_dir: Path, window: int, tolerance: float, after: int) -> dict[str, object]:
    rounds, acc = curve(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    i = flattening_index(acc, window, tolerance, after)
    s = smoothed(acc, window)
    return {
        "run": run_dir.name,
        "strategy": strategy_of(run_dir),
        "partition": summary.get("partition", ""),
        "evaluated_on": summary.get("evaluated_on", ""),
        "rounds_observed": rounds[-1] if rounds else 0,
        "flattening_round": rounds[i] if i is not None else "",
        "smoothed_acc_at_flattening": round(float(s[i]), 4) if i is not None else "",
        "smoothed_acc_final": round(float(s[-1]), 4) if len(s) else "",
        "window": window,
        "tolerance": tolerance,
        "after": after,
    }


def plot_curves(runs: list[Path], path: Path, window: int, tolerance: float, after: int) -> None:
    """Each run's validation curve (faint) and its trailing mean, the flattening round marked where there is one."""
    from fedapps.reporting import plots

    plt = plots._pyplot()  # noqa: SLF001 - the project's one matplotlib set-up
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for run, style in zip(runs, plots.line_styles([strategy_of(d) for d in runs])):
        rounds, acc = curve(run)
        s = smoothed(acc, window)
        ax.plot(rounds, acc, color=style["color"], alpha=0.25, linewidth=0.8)
        ax.plot(rounds, s, color=style["color"], linestyle=style.get("linestyle", "-"), label=run.name)
        i = flattening_index(acc, window, tolerance, after)
        if i is not None:
            ax.axvline(rounds[i], color=style["color"], linestyle=":", linewidth=1)
    plots.round_axis(ax)
    ax.set_ylabel(f"accuracy, deployed model (mean over clients; {window}-round mean)")
    ax.legend(fontsize=8)
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedapps_tools.convergence", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with rounds.csv)")
    ap.add_argument("--window", type=int, default=WINDOW, help="rounds in the trailing mean")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest later gain counted as flat")
    ap.add_argument("--after", type=int, default=AFTER, help="rounds that must be observed past the flattening round")
    ap.add_argument("--csv", default="", help="append one row per run to this CSV (with the command and commit)")
    ap.add_argument("--figure", default="", help="draw the runs' curves (and flattening rounds) into this PNG")
    args = ap.parse_args(argv)
    from fedapps_tools.tables_run import provenance  # local: git is only asked when a CSV is written

    rows = []
    for run in args.runs:
        d = Path(run)
        if not (d / "rounds.csv").is_file():
            print(f"error: {d} has no rounds.csv (pass run folders)", file=sys.stderr)
            return 2
        rows.append(describe(d, args.window, args.tolerance, args.after))
        r = rows[-1]
        print(
            f"{r['run']}: {r['rounds_observed']} rounds observed, flat from round "
            f"{r['flattening_round'] or '— (still rising, or too few rounds after)'} "
            f"(smoothed acc there {r['smoothed_acc_at_flattening'] or '—'}, final {r['smoothed_acc_final']})"
        )
    if args.figure:
        plot_curves([Path(r) for r in args.runs], Path(args.figure), args.window, args.tolerance, args.after)
    if args.csv:
        made = provenance()
        command = "python -m fedapps_tools.convergence " + " ".join(argv if argv is not None else sys.argv[1:])
        path = Path(args.csv)
        new = not path.is_file()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0], "commit", "date", "command"])
            if new:
                w.writeheader()
            for r in rows:
                w.writerow(
                    {
                        **r,
                        "commit": made["commit"],
                        "date": time.strftime("%Y-%m-%d", time.gmtime()),
                        "command": command,
                    }
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
