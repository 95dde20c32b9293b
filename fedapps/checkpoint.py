"""Checkpoints of a run, written by the round loop's driver (never by a strategy), and the clients' state files.

``<run>/checkpoint.pt`` (rewritten atomically after every round) holds: the format version, the last finished
round, the resolved config as YAML, the strategy's name and state
(:meth:`fedapps.server.driver.RoundDriver.checkpoint_state`: its algorithm attributes, the sampling RNG, node -> client
map, last extras), the rows of rounds.csv so far, and the run's token. ``<run>/client-state/<client-id>.pt`` holds a
client's private model (written by the client
itself after each message, see :mod:`fedapps.client.worker`); the token tells a resumed run's files from a stale run's.
``<run>/server-state/`` holds the strategy's per-client state that is too large to rewrite every round (cwFedAvg's
stack), one file per client, written only when it changed (:class:`RowFiles`); checkpoint.pt names the files.

A run folder is either a new run's (:func:`check_fresh` refuses a used one) or a resumed run of the same config
(:func:`load_checkpoint`, :func:`check_same_config`). These three are resume state only: a run that ends successfully
removes them (:func:`remove_resume_state`) unless it is asked to keep them; an interrupted, crashed or failed run
keeps them.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedapps.config import HASH_EXCLUDED, ConfigError, without_later_defaults

CHECKPOINT = "checkpoint.pt"
CLIENT_STATE = "client-state"
SERVER_STATE = "server-state"
FORMAT = 1
IGNORED_KEYS = HASH_EXCLUDED  # where a run is written (and tracked) may differ between the run and its resumption
RESUME_STATE = (CHECKPOINT, CLIENT_STATE, SERVER_STATE)  # what a resumption needs; removed at a successful end


def ndarray_from_tensor(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array saved by :class:`ArrayPickler`, back as numpy (sharing the loaded tensor's memory)."""
    return tensor.numpy()


class ArrayPickler(pickle.Pickler):
    """torch.save's pickler, with every numpy array (anywhere in the object) stored as a torch tensor: torch writes a
    tensor's storage as raw bytes, numpy's own pickling copies it through Python bytes first — 4.6 s against 0.5 s
    for 400 MB here (cwFedAvg's per-client stack is checkpointed every round). Loads back as numpy
    (:func:`ndarray_from_tensor`); dtypes torch lacks and non-native byte orders keep numpy's pickling."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.dtype.isnative and obj.dtype.kind in "biufc" and obj.dtype != np.uint64:
            try:
                return ndarray_from_tensor, (torch.from_numpy(np.ascontiguousarray(obj)),)
            except (TypeError, ValueError):  # a dtype this torch does not know
                pass
        return NotImplemented


class _ArrayPickleModule:
    """What torch.save needs of a pickle module: ours only differs in its Pickler."""

    Pickler = ArrayPickler
    Unpickler = pickle.Unpickler
    dump, load, loads = pickle.dump, pickle.load, pickle.loads


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file next to ``path``, flushed to disk, then renamed over it: a reader (or a
    resumed run after SIGKILL) sees the old file or the new one, never half of one. Numpy arrays are written as
    tensors (:class:`ArrayPickler`) and read back as numpy."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        torch.save(obj, fh, pickle_module=_ArrayPickleModule)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load(path: str | Path) -> Any:
    """A file written by :func:`atomic_save` (our own pickles: full unpickling)."""
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def save_checkpoint(run_dir: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``<run_dir>/checkpoint.pt``."""
    path = Path(run_dir) / CHECKPOINT
    atomic_save({"format": FORMAT, **data}, path)
    return path


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    """Read ``<run_dir>/checkpoint.pt``; ConfigError when there is none or it is of another format."""
    path = Path(run_dir).expanduser() / CHECKPOINT
    if not path.is_file():
        raise ConfigError(
            f"cannot resume: no {CHECKPOINT} in '{run_dir}' (pass the run's results folder, "
            "<output-dir>/<run-name>, of a run that finished at least one round)"
        )
    data = load(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"cannot resume: {path} is not a checkpoint of format {FORMAT}")
    return data


class RowFiles:
    """Per-client state saved incrementally: one file per key (a client id), rewritten only when its row changed.

    A checkpoint must stay consistent if the process dies at any instant, so files are versioned: :meth:`save`
    writes the changed rows under a new version and returns the map key -> file name that the checkpoint stores;
    the files it supersedes are deleted by the NEXT save, which the round loop calls only after the checkpoint
    naming the new files has replaced the old one (a crash in between leaves the old checkpoint and the files it
    names). :meth:`restore` adopts a checkpoint's map and deletes every other file (superseded, or written for a
    checkpoint that was never committed)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.names: dict[int, str] = {}  # key -> the file holding its row in the last save
        self.version = 0  # of the last save
        self.superseded: list[str] = []  # files the last save replaced: deleted by the next save

    def save(self, rows: Mapping[int, Any]) -> dict[int, str]:
        """Write ``rows`` (key -> the changed row's data) as a new version; the map of every key's file."""
        for name in self.superseded:
            (self.directory / name).unlink(missing_ok=True)
        self.superseded = []
        self.version += 1
        for key, data in rows.items():
            key = int(key)
            name = f"{key}.v{self.version}.pt"
            atomic_save(data, self.directory / name)
            if key in self.names:
                self.superseded.append(self.names[key])
            self.names[key] = name
        return dict(self.names)

    def restore(self, names: Mapping[int, str], version: int) -> dict[int, Any]:
        """Adopt a checkpoint's map (saving continues after ``version``) and read back every key's row."""
        self.names, self.version, self.superseded = dict(names), int(version), []
        named = set(self.names.values())
        if self.directory.is_dir():
            for path in self.directory.iterdir():
                if path.name not in named:
                    path.unlink()
        missing = [name for name in named if not (self.directory / name).is_file()]
        if missing:
            raise ConfigError(
                f"cannot resume: {len(missing)} server-state file(s) named by the checkpoint are "
                f"missing from '{self.directory}' (e.g. {sorted(missing)[0]}); the run folder is "
                "incomplete — restore it whole or start the run again"
            )
        return {key: load(self.directory / name) for key, name in self.names.items()}


def config_differences(saved_yaml: str, given_yaml: str) -> list[str]:
    """Dotted keys whose values differ between two dumped configs (ignoring :data:`IGNORED_KEYS`)."""
    a, b = (without_later_defaults(yaml.safe_load(text) or {}) for text in (saved_yaml, given_yaml))
    for d in (a, b):
        for key in IGNORED_KEYS:
            d.pop(key, None)
    out: list[str] = []

    def walk(x: Any, y: Any, prefix: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k, "<absent>"), y.get(k, "<absent>"), f"{prefix}.{k}" if prefix else str(k))
        elif x != y:
            out.append(f"{prefix}: checkpoint {x!r}, given {y!r}")

    walk(a, b, "")
    return out


def check_same_config(saved_yaml: str, given_yaml: str, run_dir: str | Path) -> None:
    """ConfigError naming every differing key when the given config is not the checkpointed run's."""
    diffs = config_differences(saved_yaml, given_yaml)
    if diffs:
        raise ConfigError(
            f"cannot resume '{run_dir}': the config differs from the checkpointed run's ("
            + "; ".join(diffs)
            + "); resume with the run's own config (its config.yaml)"
        )


def client_state_path(state_dir: str | Path, client_id: int) -> Path:
    """Where a client keeps its private model between messages (and across a resumption)."""
    return Path(state_dir) / f"{int(client_id)}.pt"


def check_fresh(run_dir: str | Path) -> None:
    """A new run writes into a folder of its own: ConfigError when ``run_dir`` already holds anything (an earlier
    run's results would mix with this one's: e.g. another strategy's figures beside this run's tables), naming
    ``--resume`` where that run can be continued, and how to move it aside."""
    path = Path(run_dir).expanduser()
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(
            f"results folder '{path}' is a file; remove it, or give this run another folder "
            "(--set run_name=NAME, or --output-dir DIR)"
        )
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    resumable = (path / CHECKPOINT).is_file() and not (path / "summary.json").is_file()
    how = f"continue that run (same config) with --resume {path}, or " if resumable else ""
    raise ConfigError(
        f"results folder '{path}' already holds a run ({shown}); a new run never writes into a used "
        f"folder. To go on: {how}move the old folder aside (mv '{path}' '{path}.old') or delete it, or "
        "give this run another folder (--set run_name=NAME, or --output-dir DIR)"
    )


def remove_resume_state(run_dir: str | Path) -> int:
    """Delete a finished run's resume state (:data:`RESUME_STATE`); the bytes freed."""
    import shutil

    freed = 0
    for name in RESUME_STATE:
        path = Path(run_dir) / name
        if path.is_dir():
            freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file():
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
    return freed
