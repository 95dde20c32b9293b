"""cwFedAvg against FedAvg on the Dirichlet(0.1) mnist5k split: both accuracy metrics, the gain by client size, the
class-distribution estimator's error, and the longer-run curve (the cwFedAvg page's "Dirichlet" section).

    python scripts/cwfedavg_dirichlet.py --work /tmp/cw-dir --out docs/results          # runs, then the report
    python scripts/cwfedavg_dirichlet.py --work /tmp/cw-dir --out docs/results --report-only

Runs (``fedapps run``, in-process, one thread each, ``--jobs`` at a time) the parameter-sharing table's
``dirichlet`` setting (configs/settings/param-dirichlet.yaml: 20 clients, CNN, batch 10, 1 epoch) for three
configurations, each at the learning rate and λ its table row chose on validation, for ``--rounds`` rounds and
seeds 0-2: FedAvg (lr 0.1), cwFedAvg with WDR λ = 100 and the row-norm estimator (lr 0.05), the same cwFedAvg
mixing with the clients' TRUE class distributions (the estimator's ceiling: same training, only the mixing
weights differ), and cwFedAvg with the true distributions and no WDR (what the regulariser itself costs: with the true p
sent, WDR is not needed). Every run's rounds.csv holds the deployed-model accuracy of every client at every round, so
the table reads round 20 (the table's budget) and the last round from the same runs.

Writes ``<out>/cwfedavg-dirichlet.csv`` (one row per method × round read × metric), ``cwfedavg-dirichlet.md`` (a results
page; docs/algorithms/cwfedavg.md discusses it) and ``cwfedavg-dirichlet.png`` (both metrics per round, mean ± SEM over
seeds), each with the command and commit that produced it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedapps.reporting.results import read_csv  # noqa: E402
from fedapps_tools.tables_run import PROVENANCE, provenance  # noqa: E402

SETTING = ROOT / "configs" / "settings" / "param-dirichlet.yaml"
METHODS = {  # name -> (label, overrides): the table's validation choices for the dirichlet setting
    "fedavg": ("FedAvg (lr 0.1)", ["strategy.name=fedavg", "client.lr=0.1"]),
    "cwfedavg": (
        "cwFedAvg, WDR λ = 100, row-norm estimate (lr 0.05)",
        ["strategy.name=cwfedavg", "client.lr=0.05", "strategy.params.cwfedavg.wdr_lambda=100"],
    ),
    "cwfedavg-true": (
        "cwFedAvg, same training, true class distributions",
        [
            "strategy.name=cwfedavg",
            "client.lr=0.05",
            "strategy.params.cwfedavg.wdr_lambda=100",
            "strategy.params.cwfedavg.estimator=true",
        ],
    ),
    "cwfedavg-true-nowdr": (
        "cwFedAvg, true class distributions, no WDR (λ = 0)",
        [
            "strategy.name=cwfedavg",
            "client.lr=0.05",
            "strategy.params.cwfedavg.wdr_lambda=0",
            "strategy.params.cwfedavg.estimator=true",
        ],
    ),
}
SEEDS = (0, 1, 2)
SIZE_BINS = ((0, 100, "< 100"), (100, 250, "100–249"), (250, 10**9, "≥ 250"))  # training samples per client


def run_one(work: Path, method: str, seed: int, rounds: int) -> Path:
    """One run (skipped when its folder already has a summary): ``<work>/<method>-s<seed>``."""
    name = f"{method}-s{seed}"
    folder = work / name
    if (folder / "summary.json").is_file():
        return folder
    cmd = [
        sys.executable,
        "-m",
        "fedapps_tools.cli",
        "run",
        str(SETTING),
        "--engine",
        "inprocess",
        "--output-dir",
        str(work),
        "--set",
        *METHODS[method][1],
        f"rounds={rounds}",
        f"seed={seed}",
        f"run_name={name}",
    ]
    if (folder / "checkpoint.pt").is_file():  # an interrupted run continues after its last checkpointed round
        cmd += ["--resume", str(folder)]
    made = provenance()
    with open(work / f"{name}.log", "a") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        ).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}; see {work / (name + '.log')}")
    (folder / PROVENANCE).write_text(json.dumps(made))
    return folder


def finished(work: Path) -> list[str]:
    """The configurations all of whose seeds have finished (a summary.json)."""
    return [m for m in METHODS if all((work / f"{m}-s{s}" / "summary.json").is_file() for s in SEEDS)]


def run_commits(work: Path) -> str:
    """'commit C (n runs); …' over the finished runs' provenance files (runs resume across commits)."""
    commits: dict[str, int] = {}
    for method in finished(work):
        for seed in SEEDS:
            f = work / f"{method}-s{seed}" / PROVENANCE
            key = json.loads(f.read_text())["commit"] if f.is_file() else "not recorded"
            commits[key] = commits.get(key, 0) + 1
    return "; ".join(f"`{c}` ({n} runs)" for c, n in commits.items())


def train_sizes(folder: Path) -> dict[int, int]:
    """Client id -> training samples (partition.csv's train rows)."""
    with open(folder / "partition.csv") as f:
        return {int(r["client"]): int(r["total"]) for r in csv.DictReader(f) if r["split"] == "train"}


def round_row(folder: Path, rnd: int) -> dict:
    rows = [
        r for r in read_csv(folder / "rounds.csv") if r.get("round") == rnd and isinstance(r.get("acc_mean"), float)
    ]
    if not rows:
        raise RuntimeError(f"{folder}/rounds.csv has no measured round {rnd}")
    return rows[0]


def client_accuracies(row: dict) -> dict[int, float]:
    return {
        int(k.rpartition("_")[2]): float(v)
        for k, v in row.items()
        if k.startswith("acc_client_") and isinstance(v, float)
    }


def estimator_l2(folder: Path) -> float | None:
    """Mean over clients of ‖p̂ − p‖₂ between the row-norm estimate and the true distribution (estimates.csv, at
    the end of the run); None for a run without estimates."""
    f = folder / "estimates.csv"
    if not f.is_file():
        return None
    by = {}
    with open(f) as fh:
        for r in csv.DictReader(fh):
            by.setdefault(int(r["client"]), {})[r["kind"]] = np.array(
                [float(v) for k, v in r.items() if k.startswith("class_")]
            )
    errors = [np.linalg.norm(v["norm"] - v["true"]) for v in by.values() if "norm" in v and "true" in v]
    return float(np.mean(errors)) if errors else None


def mean_sem(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0


def analyse(work: Path, rounds: int) -> list[dict]:
    """One row per (method, round read, metric): mean ± SEM over the seeds."""
    out = []
    reads = sorted({min(20, rounds), rounds})
    for method in finished(work):
        folders = [work / f"{method}-s{s}" for s in SEEDS]
        sizes = train_sizes(folders[0])
        for rnd in reads:
            rows = [round_row(f, rnd) for f in folders]
            metrics: dict[str, list[float]] = {
                "mean over clients": [r["acc_mean"] for r in rows],
                "sample-weighted": [r["acc_weighted"] for r in rows],
            }
            for lo, hi, label in SIZE_BINS:
                members = [c for c, n in sizes.items() if lo <= n < hi]
                metrics[f"mean over clients with {label} training samples ({len(members)})"] = [
                    float(np.mean([client_accuracies(r)[c] for c in members])) for r in rows
                ]
            for metric, values in metrics.items():
                m, sem = mean_sem(values)
                out.append(
                    {"method": method, "round": rnd, "metric": metric, "mean": round(m, 4), "sem": round(sem, 4)}
                )
        errs = [e for e in (estimator_l2(f) for f in folders) if e is not None]
        if errs and method == "cwfedavg":
            m, sem = mean_sem(errs)
            out.append(
                {
                    "method": method,
                    "round": rounds,
                    "metric": "estimator error, mean ‖p̂ − p‖₂",
                    "mean": round(m, 4),
                    "sem": round(sem, 4),
                }
            )
    return out


def curves_figure(work: Path, path: Path) -> None:
    from fedapps_tools.compare import Line, plot_curves

    lines = [
        Line(method, "", label, [read_csv(work / f"{method}-s{s}" / "rounds.csv") for s in SEEDS])
        for method, (label, _) in METHODS.items()
        if method in finished(work)
    ]
    plot_curves(lines, path)


def write_report(rows: list[dict], work: Path, out: Path, rounds: int, command: str) -> None:
    made = provenance()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cwfedavg-dirichlet.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "commit", "machine", "command"])
        w.writeheader()
        w.writerows({**r, "commit": made["commit"], "machine": made["machine"], "command": command} for r in rows)
    curves_figure(work, out / "cwfedavg-dirichlet.png")
    reads = sorted({r["round"] for r in rows if r["metric"] == "mean over clients"})
    metrics = list(dict.fromkeys(r["metric"] for r in rows if not r["metric"].startswith("estimator")))
    cell = {(r["method"], r["round"], r["metric"]): f"{r['mean']:.3f} ± {r['sem']:.3f}" for r in rows}
    lines = [
        "# cwFedAvg and FedAvg on the Dirichlet split",
        "",
        f"<!-- generated by `{command}`; do not edit -->",
        "",
        (
            "The parameter-sharing table's `dirichlet` setting (mnist5k, Dirichlet α = 0.1, 20 clients, the CNN, "
            "batch 10, 1 epoch), each configuration at the learning rate and λ its table row chose on validation, "
            f"run for {rounds} rounds; round 20 is the table's budget. Discussed on the [cwFedAvg page]"
            "(../algorithms/cwfedavg.md#on-the-dirichlet-split)."
        ),
        "",
        "| metric | round | " + " | ".join(METHODS[m][0] for m in METHODS) + " |",
        "|---|---|" + "---|" * len(METHODS),
    ]
    for metric in metrics:
        for rnd in reads:
            lines.append(f"| {metric} | {rnd} | " + " | ".join(cell.get((m, rnd, metric), "—") for m in METHODS) + " |")
    missing = [m for m in METHODS if m not in finished(work)]
    if missing:
        lines += ["", "Not run yet (a — above): " + "; ".join(METHODS[m][0] for m in missing) + "."]
    est = [r for r in rows if r["metric"].startswith("estimator")]
    if est:
        lines += [
            "",
            (
                f"Estimator error after round {rounds} (cwFedAvg, λ = 100): mean over clients of ‖p̂ − p‖₂ = "
                f"{est[0]['mean']:.3f} ± {est[0]['sem']:.3f} (over seeds)."
            ),
        ]
    lines += [
        "",
        (
            f"Mean ± SEM over seeds {', '.join(map(str, SEEDS))}; deployed models on each client's test split; "
            f"produced by `{command}` on {made['machine']}; the runs were made at commit {run_commits(work)}, the "
            f"report at `{made['commit']}`."
        ),
        "",
        "![deployed-model accuracy per round, mean ± SEM over seeds](../results/cwfedavg-dirichlet.png)",
    ]
    (out / "cwfedavg-dirichlet.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="where the runs go (resumable: finished runs are kept)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="where the CSV, table and figure go")
    ap.add_argument("--rounds", type=int, default=60, help="rounds per run (round 20 is also read)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--report-only", action="store_true", help="only read the finished runs")
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda ms: run_one(work, *ms, args.rounds), [(m, s) for m in METHODS for s in SEEDS]))
    command = "python scripts/cwfedavg_dirichlet.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(analyse(work, args.rounds), work, Path(args.out), args.rounds, command)
    print("written:", Path(args.out) / "cwfedavg-dirichlet.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
