"""`fedapps tables SPEC.yaml`: the published comparison tables, regenerated end to end under one rule.

A spec (see ``experiments/*.yaml``) names settings (a base config each), methods (overrides on top of a base
config, and a tuning grid of at most 4 points over the method's key hyper-parameters, client learning rate
included) and seeds. For every setting × method the tool

1. writes the method's config (the setting's base YAML with the method's overrides) under the work folder;
2. tunes it with ``fedapps tune`` on the validation split (``tune_seeds``; a setting listed under ``tune_on``
   reuses the choice of another setting — a CPU cut the report states);
3. writes the final config (the method's config with the chosen values, evaluated on the test split);

then runs ``fedapps compare`` over the final configs and ``seeds`` per setting and writes the report:
``<out>/<name>.md`` (protocol, one table per setting, the grids with the chosen values and their
validation scores, one figure per setting) and ``<out>/<name>.csv`` / ``<name>-tuning.csv``. Every step resumes:
finished tuning points and runs with the same resolved config are not run again. The published CSVs are the
durable record across clones and machines: a published row whose final config has today's hash is not run again,
a published choice over the same grid stands in for its tuning, and the report keeps (and names) the rows it
carries over. Steps run as ``fedapps`` sub-processes, ``--jobs`` at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from fedapps.config import ConfigError
from fedapps_tools.options import add_out_option, add_seeds_option, add_set_option

DEFAULT_OUT = "docs/results"  # the published tables of this checkout


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tables",
        help="regenerate the published comparison tables from a spec "
        "(experiments/*.yaml): tune every method on validation, run the seeds, write the report",
        description="The published comparison tables, regenerated end to end under one rule: tune every method "
        "of a spec on the validation split, run the final configs over the seeds, write the report. By default "
        f"the report goes into this checkout's {DEFAULT_OUT}/ (the published tables); pass --out DIR to write "
        "elsewhere.",
    )
    p.add_argument("spec", metavar="SPEC", help="the tables spec, e.g. experiments/param-sharing.yaml")
    p.add_argument(
        "--work",
        default="results/tables",
        metavar="DIR",
        help="where tunings and runs go, in DIR/<spec name>/ (resumable; default: results/tables)",
    )
    add_out_option(p, "the report (<name>.md, .csv, -tuning.csv, figures) is written into", DEFAULT_OUT)
    p.add_argument(
        "--settings", default="", metavar="A,B", help="comma-separated subset of the spec's settings (default: all)"
    )
    p.add_argument(
        "--methods", default="", metavar="A,B", help="comma-separated subset of the spec's methods (default: all)"
    )
    p.add_argument(
        "--stages",
        default="tune,final,report",
        metavar="A,B",
        help="comma-separated, any of tune, final, report (default: tune,final,report)",
    )
    add_seeds_option(p, None, "the seeds of the final runs", default_text="the spec's seeds")
    add_set_option(p, "every method's config, applied after the spec's own 'set' keys")
    p.add_argument(
        "--engine",
        default="inprocess",
        choices=("inprocess", "flower"),
        help="the engine of every run: inprocess (default here: no Ray) or flower (`flwr run`)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="fedapps sub-processes at a time, one thread each (default 1)"
    )
    p.add_argument(
        "--rerun-published",
        action="store_true",
        help="run the seeds of rows the published CSV already holds (reproduce them; draw their curves)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from fedapps_tools.tables_report import report
    from fedapps_tools.tables_run import Tables
    from fedapps_tools.tables_spec import load_spec

    spec = load_spec(args.spec)
    if args.seeds:
        spec = dataclasses.replace(spec, seeds=list(args.seeds))
    if args.overrides:
        spec = dataclasses.replace(spec, extra=list(args.overrides))
    settings = [s for s in args.settings.split(",") if s] or list(spec.settings)
    methods = [m for m in spec.methods if not args.methods or m.name in args.methods.split(",")]
    bad = [s for s in settings if s not in spec.settings]
    if bad:
        raise ConfigError(f"--settings: {bad} not in the spec ({', '.join(spec.settings)})")
    stages = set(args.stages.split(","))
    work = Path(args.work).resolve() / spec.name
    try:
        Tables(spec, work, args.engine, args.jobs, Path(args.out), args.rerun_published).run(settings, methods, stages)
        if "report" in stages:
            print("written:", report(spec, work, Path(args.out)))
    except RuntimeError as exc:
        print(f"tables failed: {exc}", file=sys.stderr)
        return 1
    return 0
