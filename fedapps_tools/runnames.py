"""The folder a new run of `fedapps run` writes: ``<strategy>-<source>-<partition>-s<seed>-<digest>``, where the digest
is the first characters of the sha256 of the resolved config (what the run computes: everything but where it writes,
with only the chosen strategy's parameters). Two runs that differ in anything they compute (rounds, a learning rate,
a parameter) land in different folders; the same config lands in the same folder, where `--overwrite` replaces
it on purpose and `--resume` continues it. A ``run_name`` set by the user is used as it is."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from fedapps.config import ConfigError, ExperimentConfig, config_hash

DIGEST_CHARS = 8
# what marks a folder as a run's (a folder without any of these is not removed by --overwrite)
RUN_FILES = ("config.yaml", "summary.json", "rounds.csv", "checkpoint.pt", "partition.csv")


def digest(resolved: ExperimentConfig) -> str:
    """The short digest of a resolved config: the parameter sections of strategies the run does not use are left
    out (they change nothing the run computes)."""
    params = {k: v for k, v in resolved.strategy.params.items() if k == resolved.strategy.name}
    only = dataclasses.replace(resolved, strategy=dataclasses.replace(resolved.strategy, params=params))
    return config_hash(only)[:DIGEST_CHARS]


def derived_name(resolved: ExperimentConfig) -> str:
    """The folder name a run of ``resolved`` gets when it names none: strategy, source, partition, seed, digest."""
    base = dataclasses.replace(resolved, run_name="").resolved_run_name()
    return f"{base}-{digest(resolved)}"


def has_derived_name(resolved: ExperimentConfig) -> bool:
    """Whether a run's (resolved) config carries the name :func:`derived_name` gives it (not one the user chose)."""
    return bool(resolved.run_name) and resolved.run_name == derived_name(resolved)


def replace_run(folder: Path) -> bool:
    """``--overwrite``: remove an earlier run's folder before the new run starts; True when one was removed. A folder
    that does not look like a run's (none of :data:`RUN_FILES`) is refused, not removed."""
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise ConfigError(f"--overwrite: '{folder}' is a file, not a run folder; remove it yourself")
    if any(folder.iterdir()) and not any((folder / name).exists() for name in RUN_FILES):
        raise ConfigError(
            f"--overwrite: '{folder}' does not look like a run folder (none of {', '.join(RUN_FILES)}); "
            "it is left alone: remove it yourself or pass --output-dir DIR"
        )
    shutil.rmtree(folder)
    return True
