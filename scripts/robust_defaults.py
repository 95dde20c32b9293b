"""What the robust options cost WITHOUT an attacker, on the validation split (docs/reliability.md, "Defaults, chosen on
validation"): FedMD's consensus rule (mean, probs, median) on the two model-agnostic settings with the values its table
tuning chose, cwFedAvg's median_clip (off, 2) on the default demo; one seed, every round's deployed accuracy.

    python scripts/robust_defaults.py --work /tmp/robust-defaults [--collect] [--out docs/results/robust-defaults.csv]

Runs each arm with `fedapps run --engine inprocess` into WORK (an arm whose summary.json exists is not run again;
--collect runs nothing), then writes one CSV row per arm: the option, the accuracy after each round, the final one,
the command and the commit.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedapps.reporting.results import write_csv  # noqa: E402
from fedapps_tools.tables_run import provenance  # noqa: E402

FEDMD = {
    "cosmos-groups": (
        "configs/settings/agnostic-cosmos-groups.yaml",
        "client.lr=0.001 strategy.params.fedmd.distill_lr=0.001",
    ),
    "rotated": ("configs/settings/agnostic-rotated.yaml", "client.lr=0.001 strategy.params.fedmd.distill_lr=0.0001"),
}
ARMS = [
    *(
        (f"fedmd-{setting}-{rule}", config, f"strategy.name=fedmd {tuned} strategy.params.fedmd.consensus={rule}")
        for setting, (config, tuned) in FEDMD.items()
        for rule in ("mean", "probs", "median")
    ),
    *(
        (f"cwfedavg-default-clip{c}", "configs/default.yaml", f"strategy.params.cwfedavg.median_clip={c}")
        for c in (0, 2)
    ),
]


def command(name: str, config: str, overrides: str, work: Path) -> list[str]:
    sets = [*overrides.split(), "data.evaluate_on=validation", f"run_name={name}"]
    return ["fedapps", "run", config, "--engine", "inprocess", "--quiet", "--output-dir", str(work), "--set", *sets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="where the runs go (resumable: finished arms kept)")
    parser.add_argument("--collect", action="store_true", help="run nothing; write the CSV from the runs in WORK")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "robust-defaults.csv")
    parser.add_argument(
        "--made-at", help="with --collect: the commit(s) the runs in WORK were made at (recorded instead of this one's)"
    )
    args = parser.parse_args(argv)
    prov = provenance()
    if args.made_at:
        prov["commit"] = args.made_at
    rows = []
    for name, config, overrides in ARMS:
        cmd = command(name, config, overrides, args.work)
        run = args.work / name
        if not (run / "summary.json").is_file() and not args.collect:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, "-m", "fedapps_tools.cli", *cmd[1:]], cwd=ROOT, env=env, check=True)
        if not (run / "summary.json").is_file():
            print(f"{name}: no finished run in {run}", file=sys.stderr)
            continue
        with (run / "rounds.csv").open() as fh:
            per_round = [r["acc_mean"] for r in csv.DictReader(fh)]
        summary = json.loads((run / "summary.json").read_text())
        rows.append(
            {
                "arm": name,
                "overrides": overrides,
                "evaluated_on": summary["evaluated_on"],
                "accuracy_mean": summary["accuracy_mean"],
                **{f"acc_r{i}": v for i, v in enumerate(per_round, start=1)},
                "command": shlex.join(cmd),
                **prov,
            }
        )
    write_csv(args.out, rows)
    print(f"wrote {args.out}: {len(rows)} arms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
