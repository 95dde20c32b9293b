"""The `fedapps` command: run one config, compare configs over seeds, tune on the validation split, report a run,
regenerate the published tables, draw accuracy against ε, measure what the server can infer (attacks), deploy across
machines (each sub-command's --help says how).

One pattern per sub-command: its module (listed in :data:`COMMANDS`) exposes ``add_parser(subparsers)``, which
adds its parser, and ``run(args) -> int``, which runs it; this module builds the parser tree (the CLI reference is
generated from it, see docgen), dispatches, and turns the errors every command shares into exit statuses.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

from fedapps.config import ConfigError
from fedapps.reporting.results import EXIT_FAILED, UnusableRun
from fedapps_tools.flwrcli import RunFailed
from fedapps_tools.options import package_version

# sub-command -> its module under fedapps_tools (imported when the parser is built: each keeps heavy imports local)
COMMANDS = {
    "run": "run",
    "compare": "compare",
    "tune": "tune",
    "report": "report",
    "tables": "tables",
    "privacy-curves": "privacy_curves",
    "attacks": "attacks",
    "deploy": "deploy",
}


def command_module(name: str) -> ModuleType:
    """The module of sub-command ``name``."""
    return importlib.import_module(f"fedapps_tools.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    """The `fedapps` command line, every sub-command's parser included. Builds the parsers only: nothing is read or
    started (the CLI reference is generated from it)."""
    parser = argparse.ArgumentParser(
        prog="fedapps",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="`fedapps COMMAND --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


def interrupted_run_dir(args: argparse.Namespace) -> Path | None:
    """The folder of the `fedapps run` that was interrupted (None for other commands, or when it cannot be told)."""
    if args.command != "run":
        return None
    if getattr(args, "resume", None):
        return Path(args.resume).expanduser().resolve()
    try:
        from fedapps.config import load_config
        from fedapps_tools import launch, runnames
        from fedapps_tools.options import resolve_root
        from fedapps_tools.run import run_overrides

        cfg = load_config(Path(args.config).expanduser(), run_overrides(args))
        name = cfg.run_name or runnames.derived_name(launch.resolved_config(cfg))
        return resolve_root(args.output_dir, cfg.output_dir) / name
    except Exception:  # noqa: BLE001 - only a hint: an error here must not hide the interruption
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return int(command_module(args.command).run(args))
    except ConfigError as exc:  # includes fedapps.data.DataError and fedapps.models' ModelError
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (RunFailed, UnusableRun) as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_status", EXIT_FAILED))
    except KeyboardInterrupt:
        from fedapps_tools import interrupted

        print("interrupted; the processes this run started were stopped", file=sys.stderr)
        print(interrupted.message(argv, interrupted_run_dir(args)), file=sys.stderr)
        return 130


def console() -> None:
    """The `fedapps` command: :func:`main`, then the process ends at once, its output flushed. A process that has
    imported torch spends ~1 s more in the interpreter's teardown (measured on 2 busy cores: 1.3 s against 0.08 s),
    which a short run would wait for; everything the CLI holds is released before main returns (the processes it
    started stopped, its folders removed, tracking writers closed)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
