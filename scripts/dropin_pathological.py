"""A user's quickstart-style Flower app (examples/cwfedavg-quickstart) on a pathological split of mnist5k through
`flwr run` (Ray simulation, one SuperNode per client): Flower's own FedAvg against the drop-in cwFedAvg built with its
defaults, (a) with the ClientApp unmodified apart from its data loader and (b) with its one-line ``class-counts``
metric added; the same ClientApp, rounds and initial model (``seed``) for each. The figure: the mean over clients of
each client's test accuracy of the model it was last sent (for FedAvg the global model, for cwFedAvg its own).

Each run appends a row to docs/results/dropin-pathological.csv with the command, the commit and the date; the table
docs/results/dropin-pathological.md (on docs/flower-apps.md) is written from the CSV's latest rows.

    python scripts/dropin_pathological.py [--rounds 20] [--clients 20] [--seeds 0 1 2]
    python scripts/dropin_pathological.py --table     # only the table, from the CSV
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedapps_tools.appruns import run_app  # noqa: E402
from fedapps_tools.benchrecord import command_line, git_commit  # noqa: E402

APP = ROOT / "examples" / "cwfedavg-quickstart"
CSV = ROOT / "docs" / "results" / "dropin-pathological.csv"
TABLE = CSV.with_suffix(".md")
COLUMNS = (
    "strategy",
    "class_counts",
    "seed",
    "rounds",
    "clients",
    "mean_client_acc",
    "best_round_acc",
    "seconds",
    "date_utc",
    "commit",
    "command",
)
CASES = (("fedavg", False), ("cwfedavg", False), ("cwfedavg", True))  # Flower's FedAvg; (a); (b)
CASE_NAMES = {
    ("fedavg", False): ("Flower's `FedAvg`", "unmodified apart from its data loader"),
    ("cwfedavg", False): ("drop-in `CwFedAvg()`, defaults", "(a) unmodified apart from its data loader"),
    ("cwfedavg", True): ("drop-in `CwFedAvg()`, defaults", "(b) with the one-line `class-counts` metric"),
}


def one_run(strategy: str, counts: bool, seed: int, rounds: int, clients: int) -> dict[str, object]:
    """One `flwr run` of the example; its final and best mean-over-clients accuracy."""
    with tempfile.TemporaryDirectory(prefix="dropin-bench-") as tmp:
        results = Path(tmp) / "results.json"
        run_config = (
            f'num-server-rounds={rounds} strategy="{strategy}" send-class-counts={str(counts).lower()} '
            f'seed={seed} results="{results}"'
        )
        t0 = time.monotonic()
        run = run_app(APP, run_config, num_supernodes=clients, timeout=3600)
        if not run.completed:
            raise SystemExit(f"{strategy} (class counts {counts}, seed {seed}): {run.status}\n{run.log[-4000:]}")
        evaluate = json.loads(results.read_text())["evaluate"]
    accs = [float(evaluate[str(r)]["eval_acc"]) for r in range(1, rounds + 1)]
    return {
        "strategy": strategy,
        "class_counts": counts,
        "seed": seed,
        "rounds": rounds,
        "clients": clients,
        "mean_client_acc": round(accs[-1], 4),
        "best_round_acc": round(max(accs), 4),
        "seconds": round(time.monotonic() - t0, 1),
    }


def table(rows: list[dict[str, str]]) -> str:
    """The page's table: per case, each seed's final mean-over-clients accuracy and their mean, from the latest row of
    each (case, seed) run with the latest row's rounds and clients; with the commands and commits."""
    last = rows[-1]
    same = [r for r in rows if (r["rounds"], r["clients"]) == (last["rounds"], last["clients"])]
    latest = {(r["strategy"], r["class_counts"] == "True", int(r["seed"])): r for r in same}
    seeds = sorted({seed for _, _, seed in latest})
    lines = [
        (
            f"`examples/cwfedavg-quickstart` through `flwr run` (Ray simulation): {last['clients']} clients, "
            f"one SuperNode each, each holding two of MNIST's digits (mnist5k, pathological split); "
            f"{last['rounds']} rounds of one local epoch (SGD, lr 0.01, momentum 0.9, batch 32, the client's own "
            "unseeded shuffling); the seed sets the initial model. The figure: the mean over clients of each client's "
            "test accuracy of the model it was sent after the "
            "last round (FedAvg: the global model; cwFedAvg: its own)."
        ),
        "",
        "| ServerApp strategy | ClientApp | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
        "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- |",
    ]
    for case in CASES:
        accs = [float(latest[(*case, s)]["mean_client_acc"]) for s in seeds if (*case, s) in latest]
        cells = [latest[(*case, s)]["mean_client_acc"] if (*case, s) in latest else "—" for s in seeds]
        mean = f"{sum(accs) / len(accs):.3f}" if accs else "—"
        lines.append(f"| {CASE_NAMES[case][0]} | {CASE_NAMES[case][1]} | " + " | ".join(cells) + f" | {mean} |")
    used = {(r["command"], r["commit"]) for r in latest.values()}
    lines += ["", "Produced by " + "; ".join(f"`{c}` at commit `{k}`" for c, k in sorted(used)) + " (every run: "]
    lines[-1] += "[dropin-pathological.csv](results/dropin-pathological.csv))."
    return "\n".join(lines) + "\n"


def write_table() -> None:
    with CSV.open() as f:
        TABLE.write_text(table(list(csv.DictReader(f))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--table", action="store_true", help="only write the table from the CSV")
    args = parser.parse_args(argv)
    if args.table:
        write_table()
        return 0
    command, commit = command_line(argv), git_commit()
    new = not CSV.is_file()
    for seed in args.seeds:
        for strategy, counts in CASES:
            row = one_run(strategy, counts, seed, args.rounds, args.clients)
            row.update(date_utc=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), commit=commit)
            row["command"] = command
            with CSV.open("a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                if new:
                    writer.writeheader()
                    new = False
                writer.writerow(row)
            print(", ".join(f"{k} {row[k]}" for k in COLUMNS[:8]), flush=True)
    write_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
