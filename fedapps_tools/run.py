"""`fedapps run CONFIG`: validate the config and the data here (a bad key fails at once, naming it: exit 2), start
a SuperLink of the run's own (simulation mode, free port, own FLWR_HOME) or join --superlink ADDRESS; with
--ray-address HOST:PORT (or an exported RAY_ADDRESS) the simulation runs on that Ray cluster, submit the app with
`flwr run --format json`, follow the run's log and status, stop only the processes it started, and exit 0 only when
the run finished with a meaningful headline (every exit status is listed by `fedapps run --help`; summary.json's
`problems` says why a run did not). The process control is :mod:`fedapps_tools.launch`."""

from __future__ import annotations

import argparse

from fedapps.config import ConfigError
from fedapps.reporting.results import EXIT_STATUSES
from fedapps_tools import launch
from fedapps_tools.options import add_run_options, add_seeds_option
from fedapps_tools.summary import print_summary

EXIT_HELP = (
    "exit status:\n"
    + "".join(f"  {code:<5}{what}\n" for code, what in EXIT_STATUSES.items())
    + ("summary.json's 'problems' says why a run did not exit 0; its 'exit_status' is the status.")
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="run one config through `flwr run` and print its summary",
        description="Run one config through `flwr run` (or in this process with --engine inprocess) "
        "and print its summary.",
        epilog=EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config",
        metavar="CONFIG",
        help="the experiment's YAML file, e.g. configs/default.yaml (every key is checked before anything starts)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR (<output-dir>/<run folder>, printed when it started) after its last "
        "checkpointed round",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run folder of the same config if an earlier run left one (default: refuse, naming it)",
    )
    add_seeds_option(
        p,
        None,
        "the run's seed, the same as --set seed=N; a run has one: for several use "
        "`fedapps compare CONFIG --seeds 0,1,2`",
        default_text="the config's seed",
    )
    add_run_options(p, "the run folder DIR/<run name>/")
    return p


def run_overrides(args: argparse.Namespace) -> list[str]:
    """`fedapps run`'s overrides: --set, then --seeds (one seed: seed=N)."""
    seeds = getattr(args, "seeds", None)
    if not seeds:
        return list(args.overrides)
    if len(seeds) > 1:
        raise ConfigError(
            f"fedapps run makes one run, but --seeds names {len(seeds)} seeds "
            f"({','.join(map(str, seeds))}); pass one (--seeds {seeds[0]}), or run them all with "
            f"`fedapps compare {args.config} --seeds {','.join(map(str, seeds))}`"
        )
    return list(args.overrides) + [f"seed={seeds[0]}"]


def run(args: argparse.Namespace) -> int:
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts a run afresh and --resume continues one; pass one of the two")
    launch.start_logging(args)
    print_summary(launch.execute(args.config, run_overrides(args), args.output_dir, args))
    return 0
