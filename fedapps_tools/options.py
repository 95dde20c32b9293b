"""What the sub-commands share on their command line, defined once: the seed-list syntax (``--seeds 0,1,2`` and
``--seeds 0 1 2`` alike), the meaning of ``--output-dir`` (the results root, as the config's ``output_dir``), the
check that help texts are plain text, and the package's version."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fedapps.config import APP_DIR, ConfigError

PACKAGE = "fedapps"


def parse_seeds(items: Sequence[Any]) -> list[int]:
    """``["0,1", "2"]`` (or ``["0", "1", "2"]``, or ints) -> ``[0, 1, 2]``: non-negative integers, each once, in
    the order given. ConfigError naming the bad item otherwise."""
    seeds: list[int] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                seed = int(part)
            except ValueError:
                hint = " (a config file? write the configs before --seeds)" if part.endswith((".yaml", ".yml")) else ""
                raise ConfigError(
                    f"--seeds: {part!r} is not an integer{hint}; pass e.g. --seeds 0,1,2 or --seeds 0 1 2"
                ) from None
            if seed < 0:
                raise ConfigError(f"--seeds: {seed} is negative; seeds are integers >= 0")
            if seed in seeds:
                raise ConfigError(f"--seeds: {seed} is repeated; list each seed once")
            seeds.append(seed)
    if not seeds:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0")
    return seeds


class SeedsAction(argparse.Action):
    """``--seeds`` read by :func:`parse_seeds` while parsing: the namespace holds a list of ints, and a bad item
    is argparse's usage error (exit 2) naming it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            setattr(namespace, self.dest, parse_seeds(values if isinstance(values, list) else [values]))
        except ConfigError as exc:
            raise argparse.ArgumentError(self, str(exc).removeprefix("--seeds: ")) from None


def add_seeds_option(
    parser: argparse.ArgumentParser,
    default: list[int] | None,
    help: str,  # noqa: A002
    default_text: str = "",
) -> None:
    """``--seeds SEED[,SEED...] [SEED ...]``: the one seed-list option every sub-command uses (the namespace gets a
    list of ints). ``default`` None: the option is unset unless given, ``default_text`` says what applies then."""
    shown = default_text or " ".join(map(str, default or []))
    parser.add_argument(
        "--seeds",
        nargs="+",
        action=SeedsAction,
        default=None if default is None else list(default),
        metavar="SEED",
        help=f"{help}; write them as 0,1,2 or as 0 1 2 (default: {shown})",
    )


def add_set_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--set KEY=VALUE ...``: dotted config overrides (repeatable), the same option wherever a config is run;
    ``what``: whose keys they override. The namespace gets ``overrides``, a list of strings."""
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted overrides of {what}, e.g. --set rounds=5 client.lr=0.01 (repeatable; default: none)",
    )


def add_out_option(parser: argparse.ArgumentParser, what: str, default: str | None = None) -> None:
    """``--out DIR``: the folder a command writes its product into, the same meaning in every command; ``what``:
    what it writes there and, without ``default``, where it writes without the option."""
    shown = f" (default: {default})" if default else ""
    parser.add_argument("--out", default=default, metavar="DIR", help=f"the folder {what}{shown}")


def output_dir_help(what: str) -> str:
    """The help of ``--output-dir`` in run, compare and tune: the same results root everywhere, and what the
    sub-command writes under it."""
    return (
        f"the results root, as the config's output_dir and the same in run, compare and tune (default: the "
        f"config's output_dir); this command writes {what}"
    )


def resolve_root(output_dir: str | None, config_output_dir: str) -> Path:
    """The results root: ``--output-dir`` if given, else the config's ``output_dir``; absolute."""
    return Path(output_dir or config_output_dir).expanduser().resolve()


def package_version() -> str:
    """The installed package's version (importlib.metadata); from the source tree's pyproject.toml when the package
    is not installed (a checkout run with ``python -m fedapps_tools.cli``)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return pyproject_version(APP_DIR / "pyproject.toml")


def pyproject_version(path: Path) -> str:
    """``[project] version`` of a pyproject.toml ('unknown' when the file or the key is missing)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    try:
        import tomllib
    except ImportError:  # Python 3.10: the first version = "..." line of the [project] table
        section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        found = re.search(r'^version\s*=\s*"([^"]+)"', section.group(1), re.M) if section else None
        return found.group(1) if found else "unknown"
    return str(tomllib.loads(text).get("project", {}).get("version", "unknown"))


def parsers_of(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command path, parser)`` for a parser and every sub-command parser under it, depth first."""
    yield path or parser.prog, parser
    for action in parser._actions:  # noqa: SLF001 - argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from parsers_of(sub, f"{path or parser.prog} {name}")


def add_run_options(p: argparse.ArgumentParser, writes: str) -> None:
    """Options shared by run, compare and tune; ``writes``: what the sub-command writes under --output-dir."""
    add_set_option(p, "the config's keys")
    p.add_argument("--output-dir", default=None, metavar="DIR", help=output_dir_help(writes))
    p.add_argument(
        "--engine",
        choices=("flower", "inprocess"),
        default="flower",
        help="flower: `flwr run` on the Ray simulation engine (default); inprocess: same code, no Ray",
    )
    p.add_argument(
        "--supernodes", type=int, default=0, metavar="N", help="simulated SuperNodes (default: data.num_clients)"
    )
    p.add_argument(
        "--cpus-per-client",
        type=float,
        default=1,
        metavar="CPUS",
        help="CPUs Ray reserves per client, Flower's client-resources-num-cpus (default 1)",
    )
    p.add_argument(
        "--gpus-per-client",
        type=float,
        default=0,
        metavar="GPUS",
        help="GPUs (or a share of one, e.g. 0.25) Ray reserves per client, Flower's "
        "client-resources-num-gpus (default 0)",
    )
    p.add_argument(
        "--federation-config",
        default="",
        metavar="TEXT",
        help="the raw --federation-config of flwr run (replaces the three options above)",
    )
    p.add_argument(
        "--superlink",
        default="",
        metavar="ADDRESS",
        help="join this running SuperLink (host:port, insecure) instead of starting one; nothing is stopped",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="run the simulation on this running Ray cluster (the head's GCS address; default: an exported "
        "RAY_ADDRESS, else a Ray instance of the run's own; 'local' ignores RAY_ADDRESS). Run it on a "
        "node of the cluster; --cpus/--gpus-per-client are per client actor on any node",
    )
    p.add_argument(
        "--keep-superlink", action="store_true", help="leave the SuperLink this run started running afterwards"
    )
    p.add_argument(
        "--keep-state",
        action="store_true",
        help="keep a finished run's resume state (checkpoint.pt, client-state/, server-state/); by default "
        "a run that ends successfully removes it (an interrupted or failed run keeps it for --resume)",
    )
    p.add_argument("--quiet", action="store_true", help="do not stream the run's log")
