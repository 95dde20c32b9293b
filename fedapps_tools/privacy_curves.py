"""`fedapps privacy-curves SPEC.yaml`: accuracy against ε, one curve per method, under one rule.

A spec names one setting (a config under ``configs/settings/``), the seeds, the privacy mode and its fixed keys
(``privacy:``), the noise multipliers σ to sweep, and the methods with their fixed hyper-parameters (``set``). Every
method runs once without privacy (``privacy.mode: off``, the curve's reference) and once per σ, at every seed, through
``fedapps compare`` (resumable: a finished run with the same config is not run again). The report stage reads each
run's ``summary.json`` (the deployed models' accuracy after the last round, docs/evaluation.md, and the run's ε:
``privacy.epsilon_max``, the largest ε any client or the server's release reached) and writes

- ``<out>/<name>.csv``: one row per method × σ (mean ± SEM over seeds of the accuracies, the mean and largest ε over
  seeds), with the commit(s), machine and date its runs were made with (the point's provenance.json) and the
  report's command;
- ``<out>/<name>.png``: accuracy against ε (log scale), one line per method, its non-private accuracy a hollow
  marker at "no DP".

Hyper-parameters are not re-tuned per σ: each method keeps the values chosen on the validation split of the
non-private comparison (the spec says which), so a curve shows what privacy costs a method as it was tuned, and every
method is treated alike. The docs page (docs/privacy.md) states this beside the figure.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedapps.config import ConfigError
from fedapps_tools.compare import mean_sem
from fedapps_tools.options import add_out_option, add_seeds_option, add_set_option
from fedapps_tools.tables_run import fedapps, provenance, read_provenance, record_provenance
from fedapps_tools.tables_spec import read_spec_mapping, with_overrides, write_yaml, yaml_scalar

DEFAULT_ROOT = "results/privacy-curves"  # --work and --out
OFF = "off"  # the point label of a method's non-private run
SUMMARY_KEYS = ("accuracy_mean", "accuracy_weighted", "accuracy_worst10")


@dataclass(frozen=True)
class CurveMethod:
    name: str
    overrides: list[str]  # dotted key=value, the method's fixed hyper-parameters
    label: str


@dataclass(frozen=True)
class CurveSpec:
    name: str
    title: str
    setting: Path  # the setting's config
    seeds: list[int]
    privacy: dict[str, Any]  # privacy.* keys every private run sets (mode included)
    noise_multipliers: list[float]
    methods: list[CurveMethod]
    notes: str
    extra: tuple[str, ...] = ()  # the command line's --set: after each method's own keys, before the point's privacy


def load_curve_spec(path: str | Path) -> CurveSpec:
    """Read and check a privacy-curves spec; every problem is a ConfigError naming the file and key."""
    p = Path(path)
    known = {"name", "title", "setting", "seeds", "privacy", "noise_multipliers", "methods", "notes"}
    raw = read_spec_mapping(
        p, "privacy-curves spec", known, ("name", "setting", "privacy", "noise_multipliers", "methods")
    )
    setting = p.parent / str(raw["setting"])
    if not setting.is_file():
        raise ConfigError(f"privacy-curves spec '{path}': setting '{raw['setting']}' is not a file (relative to it)")
    privacy = dict(raw["privacy"])
    if privacy.get("mode") in (None, OFF):
        raise ConfigError(
            f"privacy-curves spec '{path}': privacy.mode must name the private mode to sweep (e.g. sample), "
            f"got {privacy.get('mode')!r}; the non-private reference runs by itself"
        )
    if "noise_multiplier" in privacy:
        raise ConfigError(
            f"privacy-curves spec '{path}': privacy.noise_multiplier is what the curve sweeps; list its values "
            "under noise_multipliers instead"
        )
    sigmas = [float(s) for s in raw["noise_multipliers"]]
    if any(s <= 0 for s in sigmas) or len(set(sigmas)) != len(sigmas):
        raise ConfigError(
            f"privacy-curves spec '{path}': noise_multipliers must be distinct and > 0 (got {sigmas}); "
            "the non-private point is added by itself"
        )
    methods = []
    for name, body in raw["methods"].items():
        body = body or {}
        bad = sorted(set(body) - {"set", "label"})
        if bad:
            raise ConfigError(
                f"privacy-curves spec '{path}': methods.{name} has unknown key(s) {bad}; allowed: set, label"
            )
        overrides = [str(o) for o in body.get("set") or []]
        if any(o.split("=", 1)[0].startswith("privacy.") for o in overrides):
            raise ConfigError(
                f"privacy-curves spec '{path}': methods.{name}.set must not set privacy.* keys: the spec's "
                "'privacy' block applies to every method alike"
            )
        methods.append(CurveMethod(str(name), overrides, str(body.get("label") or name)))
    return CurveSpec(
        str(raw["name"]),
        str(raw.get("title") or raw["name"]),
        setting,
        [int(s) for s in raw.get("seeds") or [0, 1, 2]],
        privacy,
        sigmas,
        methods,
        str(raw.get("notes") or ""),
    )


def point_label(sigma: float | None) -> str:
    """A point's name in folder names and the CSV: ``off`` or ``sigma<σ>``."""
    return OFF if sigma is None else f"sigma{sigma:g}"


def point_overrides(spec: CurveSpec, m: CurveMethod, sigma: float | None) -> list[str]:
    """The dotted overrides of one point: the method's, then privacy off or the spec's privacy keys and σ."""
    if sigma is None:
        return [*m.overrides, *spec.extra, f"privacy.mode={yaml_scalar(OFF)}"]  # quoted: YAML reads a bare off as false
    keys = {**spec.privacy, "noise_multiplier": sigma}
    return [*m.overrides, *spec.extra, *(f"privacy.{k}={yaml_scalar(v)}" for k, v in keys.items())]


def points(spec: CurveSpec) -> list[tuple[CurveMethod, float | None]]:
    return [(m, s) for m in spec.methods for s in [None, *spec.noise_multipliers]]


def run_point(spec: CurveSpec, work: Path, m: CurveMethod, sigma: float | None, jobs: int) -> None:
    """One method × σ over the seeds: its config written under ``work/configs``, then ``fedapps compare``."""
    name = f"{m.name}--{point_label(sigma)}"
    cfg = write_yaml(work / "configs" / f"{name}.yaml", with_overrides(spec.setting, point_overrides(spec, m, sigma)))
    started, since, made = time.monotonic(), time.time(), provenance()
    args = ["compare", str(cfg), "--seeds", *map(str, spec.seeds), "--name", name]
    try:
        fedapps(
            [*args, "--output-dir", str(work / "compare"), "--engine", "inprocess", "--quiet"],
            work / "logs" / f"{name}.log",
            jobs,
        )
    finally:  # an interrupted point keeps the record of the runs it finished
        if point_dir(work, m, sigma).is_dir():
            record_provenance(point_dir(work, m, sigma), made, since)
    print(f"ran {name} over seeds {spec.seeds} ({time.monotonic() - started:.0f} s)", flush=True)


def point_dir(work: Path, m: CurveMethod, sigma: float | None) -> Path:
    """The comparison folder of one method × σ (its runs under ``runs/``, its ``provenance.json``)."""
    return work / "compare" / f"{m.name}--{point_label(sigma)}"


def read_point(work: Path, m: CurveMethod, sigma: float | None, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The finished runs' summaries of one point at the spec's seeds (a missing seed is simply absent)."""
    runs = point_dir(work, m, sigma) / "runs"
    found = []
    for seed in seeds:
        for d in sorted(runs.glob(f"*-s{seed}")):
            f = d / "summary.json"
            if f.is_file():
                found.append(json.loads(f.read_text()))
    return found


def run_epsilon(summary: Mapping[str, Any]) -> float:
    """A run's ε: summary.json's ``privacy.epsilon_max``; ∞ for a run without privacy (no guarantee at all)."""
    privacy = summary.get("privacy") or {}
    eps = privacy.get("epsilon_max") if privacy.get("mode", OFF) != OFF else None
    return math.inf if eps is None else float(eps)


def run_median_epsilon(summary: Mapping[str, Any]) -> float:
    """The median over clients of their ε (``privacy.epsilon_per_client``): the typical client's guarantee, where
    :func:`run_epsilon` is the weakest client's (the one with the fewest samples); ∞ without privacy."""
    privacy = summary.get("privacy") or {}
    per_client = [float(e) for e in (privacy.get("epsilon_per_client") or {}).values()]
    if privacy.get("mode", OFF) == OFF or not per_client:
        return math.inf
    return float(statistics.median(per_client))


def point_row(m: CurveMethod, sigma: float | None, summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One CSV row: the point's accuracies (mean ± SEM over seeds) and ε: the run's (the largest over its clients)
    as mean and largest over seeds, and the median client's, as mean over seeds."""
    eps = [run_epsilon(s) for s in summaries]
    medians = [run_median_epsilon(s) for s in summaries]
    row: dict[str, Any] = {
        "method": m.name,
        "label": m.label,
        "point": point_label(sigma),
        "noise_multiplier": "" if sigma is None else sigma,
        "seeds": len(summaries),
        "epsilon_mean": sum(eps) / len(eps) if eps else math.nan,
        "epsilon_max": max(eps) if eps else math.nan,
        "epsilon_median_client": sum(medians) / len(medians) if medians else math.nan,
    }
    for key in SUMMARY_KEYS:
        values = [float(s[key]) for s in summaries if isinstance(s.get(key), (int, float))]
        row[key], row[key + "_sem"] = mean_sem(values) if values else (math.nan, math.nan)
    return row


def curve_rows(spec: CurveSpec, work: Path) -> list[dict[str, Any]]:
    """Every point that has at least one finished run, in the spec's order."""
    rows = []
    for m, sigma in points(spec):
        summaries = read_point(work, m, sigma, spec.seeds)
        if summaries:
            made = read_provenance(point_dir(work, m, sigma))
            rows.append({**point_row(m, sigma, summaries), **{k: made.get(k, "") for k in MADE}})
    return rows


MADE = ("commit", "machine", "date")  # a point's provenance.json: the code and machine its runs were made with


def write_curve_csv(rows: Sequence[Mapping[str, Any]], path: Path, command: str) -> None:
    """The rows, each with the provenance of its runs ("" where none was recorded) and the report's command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "command"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "command": command})


def report(spec: CurveSpec, work: Path, out: Path, command: str) -> Path | None:
    """``<out>/<name>.csv`` and ``.png`` from the finished runs; None (and a message) when nothing ran yet."""
    from fedapps.reporting import plots  # local: the plotting stack only when a report is written

    rows = curve_rows(spec, work)
    if not rows:
        print(f"{spec.name}: no finished run under {work}; run the 'run' stage first", flush=True)
        return None
    write_curve_csv(rows, out / f"{spec.name}.csv", command)
    plots.plot_privacy_curves(rows, out / f"{spec.name}.png", spec.title)
    incomplete = [
        f"{r['method']} {r['point']} ({r['seeds']}/{len(spec.seeds)} seeds)"
        for r in rows
        if r["seeds"] < len(spec.seeds)
    ]
    missing = [
        f"{m.name} {point_label(s)}"
        for m, s in points(spec)
        if not any(r["method"] == m.name and r["point"] == point_label(s) for r in rows)
    ]
    for what, items in (("incomplete", incomplete), ("not run", missing)):
        if items:
            print(f"{spec.name}: {what}: {', '.join(items)}", flush=True)
    return out / f"{spec.name}.csv"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "privacy-curves",
        help="accuracy against ε from a spec (experiments/privacy-*.yaml): every method without privacy and at "
        "each noise multiplier, over the seeds",
        description="Accuracy against ε per method: runs every method without privacy and at each noise "
        "multiplier of the spec, then writes <out>/<name>.csv and .png.",
    )
    p.add_argument("spec", metavar="SPEC", help="the curves spec, e.g. experiments/privacy-sample.yaml")
    p.add_argument(
        "--work",
        default=DEFAULT_ROOT,
        metavar="DIR",
        help="where the runs go, in DIR/<spec name>/ (resumable; default: results/privacy-curves)",
    )
    add_out_option(p, "the CSV and the figure (<name>.csv, <name>.png) are written into", DEFAULT_ROOT)
    p.add_argument(
        "--stages",
        default="run,report",
        metavar="A,B",
        help="comma-separated, any of run, report (default: run,report)",
    )
    p.add_argument(
        "--methods",
        default="",
        metavar="A,B",
        help="comma-separated subset of the spec's methods to run (default: all; the report covers them all)",
    )
    add_seeds_option(p, None, "the seeds of every point", default_text="the spec's seeds")
    add_set_option(p, "every run's config (after the method's own keys; the point's privacy keys stay)")
    p.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="fedapps sub-processes at a time, one thread each (default 1)"
    )
    return p


def command_line(args: argparse.Namespace) -> str:
    """The command that makes this report (recorded in the CSV): the spec and every option not at its default."""
    parts = ["fedapps privacy-curves", args.spec]
    for flag, value, default in (
        ("--work", args.work, DEFAULT_ROOT),
        ("--out", args.out, DEFAULT_ROOT),
        ("--stages", args.stages, "run,report"),
        ("--methods", args.methods, ""),
    ):
        if value != default:
            parts += [flag, value]
    if args.seeds:
        parts += ["--seeds", ",".join(map(str, args.seeds))]
    if args.overrides:
        parts += ["--set", *args.overrides]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    spec = load_curve_spec(args.spec)
    if args.seeds:
        spec = dataclasses.replace(spec, seeds=list(args.seeds))
    if args.overrides:
        spec = dataclasses.replace(spec, extra=tuple(args.overrides))
    stages = {s.strip() for s in args.stages.split(",") if s.strip()}
    if not stages or stages - {"run", "report"}:
        raise ConfigError(f"--stages {args.stages!r}: use run, report or both")
    chosen = [s for s in args.methods.split(",") if s]
    unknown = sorted(set(chosen) - {m.name for m in spec.methods})
    if unknown:
        raise ConfigError(f"--methods {unknown} not in the spec ({', '.join(m.name for m in spec.methods)})")
    work = Path(args.work) / spec.name
    if "run" in stages:  # --methods narrows what runs; the report always covers the whole spec
        todo = [(m, s) for m, s in points(spec) if not chosen or m.name in chosen]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(lambda ms: run_point(spec, work, ms[0], ms[1], args.jobs), todo))
    if "report" in stages:
        report(spec, work, Path(args.out), command_line(args))
    return 0
