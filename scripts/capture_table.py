"""The capture table: every capture case of fedapps_tools/capture.py (strategy × attack) with the strategy's robust
option off (default) and on (robust), beside the run with the attacker dropped (reference) and that run with the
robust option on (what the option costs without an attack); in-process, digits, MLP, 5 clients, over seeds.

    python scripts/capture_table.py [--seeds 0 1 2] [--cases cwfedavg/scale ...] [--out docs/results]

Writes <out>/capture.csv (one row per case × arm × seed, with the command, commit and machine) and <out>/capture.md
(the table docs/reliability.md cites: per case, the victim's and the mean honest accuracy, averaged over seeds).
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedapps.reporting.results import write_csv  # noqa: E402
from fedapps_tools import capture  # noqa: E402
from fedapps_tools.tables_run import provenance  # noqa: E402


def measure(cases: list[capture.Case], seeds: list[int]) -> list[dict[str, Any]]:
    """One CSV row per case × arm × seed (the reference arms are their own reference)."""
    rows = []
    for c in cases:
        for seed in seeds:
            runs = {arm: capture.run_arm(c, arm, seed) for arm in capture.ARMS}
            ref = runs[capture.REFERENCE]
            victim = capture.victim_of(c, runs["default"], ref)
            for arm, got in runs.items():
                figures = capture.summarise(got, ref, victim)
                rows.append(
                    {
                        "case": c.name,
                        "strategy": c.strategy,
                        "attack": c.attack,
                        "arm": arm,
                        "seed": seed,
                        "robust_option": " ".join(c.robust),
                        "fault_spec": c.fault_spec(),
                        "rounds": c.rounds,
                        **figures,
                        "seconds": round(got.seconds, 2),
                        "cpu_seconds": round(got.cpu_seconds, 2),
                    }
                )
                logging.info(
                    "%s %s seed %d: victim %d %.3f (ref %.3f), mean %.3f (ref %.3f), %.1f s",
                    c.name,
                    arm,
                    seed,
                    figures["victim"],
                    figures["victim_acc"],
                    figures["victim_ref"],
                    figures["mean_acc"],
                    figures["mean_ref"],
                    got.seconds,
                )
    return rows


def mean_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None and not math.isnan(float(r[key]))]
    return float(np.mean(values)) if values else math.nan


def fmt(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3f}"


def verdict(c: capture.Case, robust: list[dict[str, Any]]) -> str:
    """Whether the robust option bounded the damage (:func:`fedapps_tools.capture.bounded`), and the case's own note
    where it did not."""
    if capture.bounded(robust):
        return "yes"
    return "**no**" + (f": {c.limits}" if c.limits else "")


def table(
    rows: list[dict[str, Any]],
    cases: list[capture.Case],
    seeds: list[int],
    command: str,
    prov: dict[str, str],
    cpu: float,
) -> str:
    """capture.md: one row per case, figures averaged over the seeds."""
    lines = [
        "# Capture table: one hostile client against the personalising strategies",
        "",
        f"<!-- written by `{command}`: do not edit by hand -->",
        "",
        (
            f"In-process, digits, MLP, {capture.CLIENTS} clients (pathological partition, "
            f"{capture.CLASSES_PER_CLIENT} classes each: every class held by two clients), every client every round, "
            f"{', '.join(sorted({str(c.rounds) for c in cases}))} rounds, seeds {', '.join(map(str, seeds))}. Client "
            f"{capture.ATTACKER} is hostile (its replies pass every check of the reply validation); the **victim** "
            f"is client {capture.VICTIM} for a targeted attack, else the honest client whose accuracy falls furthest "
            "below its own accuracy in the run without the attacker when the option is off (per seed; the robust "
            "run of that seed is judged on the same client). Accuracy: the deployed models "
            "after the last round (mean over seeds); an honest client whose replies were all rejected counts 0 for "
            "the victim column and is left out of the mean (`measured`). **Robust** turns on the option named in the "
            "row, which is off by default; **dropped**: the attacker's every reply lost (the reference); "
            "**dropped + robust**: the reference with the option on (its cost without an attack). **Bounded**: "
            "with the option on, the victim's and the mean accuracy, averaged over the seeds, within "
            f"{capture.BOUND:g} of the reference's, every honest client measured."
        ),
        "",
        (
            "| strategy | attack | robust option | victim default (ref) | victim robust (ref) | mean default | "
            "mean robust | mean dropped | mean dropped + robust | bounded |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        mine = [r for r in rows if r["case"] == c.name]
        arm = {a: [r for r in mine if r["arm"] == a] for a in capture.ARMS}
        measured = min((r["measured"] for r in arm["default"]), default=0)
        note = "" if measured == len(capture.honest_ids()) else f" ({measured}/{len(capture.honest_ids())} measured)"
        lines.append(
            f"| {c.strategy} | {c.attack} | `{' '.join(c.robust)}` | "
            f"{fmt(mean_of(arm['default'], 'victim_acc'))} ({fmt(mean_of(arm['default'], 'victim_ref'))}) | "
            f"{fmt(mean_of(arm['robust'], 'victim_acc'))} ({fmt(mean_of(arm['robust'], 'victim_ref'))}) | "
            f"{fmt(mean_of(arm['default'], 'mean_acc'))}{note} | {fmt(mean_of(arm['robust'], 'mean_acc'))} | "
            f"{fmt(mean_of(arm[capture.REFERENCE], 'mean_acc'))} | "
            f"{fmt(mean_of(arm[capture.REFERENCE_ROBUST], 'mean_acc'))} | {verdict(c, arm['robust'])} |"
        )
    lines += early_rounds_table(rows, cases)
    lines += ["", "The attacks (fault kinds of `fedapps/flower/faults.py`):", ""]
    lines += [
        f"- **{c.name}** (`{c.fault_spec()}`{', ' + ' '.join(c.setting) if c.setting else ''}): {c.what}."
        for c in cases
    ]
    diag = [c for c in cases if any(r["diagnostic"] is not None for r in rows if r["case"] == c.name)]
    if diag:
        lines += [
            "",
            (
                "Server side, where the deployed models hardly move (the clients train on their own data after "
                "the digest): accuracy of the consensus (FedMD) or of the clients' targets (COMET) on U's true "
                "labels after the last round, a diagnostic the method never sees."
            ),
            "",
            "| strategy | attack | default | robust | dropped | dropped + robust |",
            "|---|---|---|---|---|---|",
        ]
        for c in diag:
            mine = [r for r in rows if r["case"] == c.name]
            cells = [fmt(mean_of([r for r in mine if r["arm"] == a], "diagnostic")) for a in capture.ARMS]
            lines.append(f"| {c.strategy} | {c.attack} | " + " | ".join(cells) + " |")
    lines += [
        "",
        (
            f"Measured with commit `{prov['commit']}` on {prov['machine']}, {prov['date']}: "
            f"{len(rows)} runs, {cpu / 60:.1f} CPU minutes. Per run and seed: `capture.csv`."
        ),
        "",
    ]
    return "\n".join(lines)


def early_rounds_table(rows: list[dict[str, Any]], cases: list[capture.Case]) -> list[str]:
    """The first rounds (:data:`fedapps_tools.capture.EARLY_ROUNDS`) beside the last: the mean honest accuracy of the
    deployed models after each, option off, on, and with the attacker dropped — a defence that only catches up
    late still lost the rounds before."""
    early = capture.EARLY_ROUNDS
    head = " / ".join(f"r{k}" for k in early) + " / last"
    header = (
        f"| strategy | attack | robust option | default ({head}) | robust ({head}) | dropped ({head}) | "
        f"dropped + robust ({head}) |"
    )
    lines = [
        "",
        (
            f"The first rounds: the mean honest accuracy after rounds {', '.join(map(str, early))} and after the last "
            "(averaged over the seeds; an honest client whose reply was rejected is left out of that round's mean)."
        ),
        "",
        header,
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(early_row(c, [r for r in rows if r["case"] == c.name], "mean_r{}", "mean_acc"))
    diag = [c for c in cases if any(r.get("diagnostic_r1") is not None for r in rows if r["case"] == c.name)]
    if diag:
        lines += [
            "",
            "The same rounds on the server's side (the diagnostic of the table below, per round):",
            "",
            header,
            "|---|---|---|---|---|---|---|",
        ]
        for c in diag:
            lines.append(early_row(c, [r for r in rows if r["case"] == c.name], "diagnostic_r{}", "diagnostic"))
    return lines


def early_row(c: capture.Case, mine: list[dict[str, Any]], per_round: str, last: str) -> str:
    """One case's row of the first-rounds tables: per arm, ``per_round`` (a key with a {} for the round) at each
    early round, then ``last``, averaged over the seeds."""
    keys = [*(per_round.format(k) for k in capture.EARLY_ROUNDS), last]
    cells = [
        " / ".join(fmt(mean_of([r for r in mine if r["arm"] == arm], key)) for key in keys) for arm in capture.ARMS
    ]
    return f"| {c.strategy} | {c.attack} | `{' '.join(c.robust)}` | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=[c.name for c in capture.CASES],
        help="strategy/attack names (default: every case)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("fedapps", "fedapps.data", "fedapps.config"):
        logging.getLogger(name).setLevel(logging.ERROR)  # the attacks' own warnings, every round
    cases = [capture.case(n) for n in args.cases]
    command = "python scripts/capture_table.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    prov = provenance()
    c0, t0 = time.process_time(), time.perf_counter()
    rows = measure(cases, args.seeds)
    cpu = time.process_time() - c0
    for r in rows:
        r.update({"command": command.strip(), **prov})
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "capture.csv", rows)
    (args.out / "capture.md").write_text(table(rows, cases, args.seeds, command.strip(), prov, cpu))
    logging.info(
        "wrote %s and %s: %d runs, %.1f CPU minutes, %.1f minutes wall",
        args.out / "capture.csv",
        args.out / "capture.md",
        len(rows),
        cpu / 60,
        (time.perf_counter() - t0) / 60,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
