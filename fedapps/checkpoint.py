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
import re
import types
from collections import Counter, OrderedDict
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
RESUME_FIX = (
    "restore the run folder whole from a copy you trust, or start the run again in a new folder "
    "(the rounds it finished are in its rounds.csv)"
)


def ndarray_from_tensor(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array saved by :class:`ArrayPickler`, back as numpy (sharing the loaded tensor's memory)."""
    return tensor.numpy()


def ndarray_from_bytes(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy array of a dtype torch lacks (uint64, a non-native byte order, fixed-width text), saved by
    :class:`ArrayPickler` as its raw bytes; only plain dtypes are rebuilt (never objects)."""
    kind = np.dtype(dtype)
    if kind.hasobject or kind.kind not in PLAIN_KINDS or kind.fields is not None:
        raise ValueError(f"refusing to rebuild an array of dtype {dtype!r} (not a plain numeric or text dtype)")
    return np.frombuffer(raw.numpy().tobytes(), dtype=kind).reshape(shape)


def numpy_scalar(array: np.ndarray) -> Any:
    """A numpy scalar saved by :class:`ArrayPickler` as a 0-d array, back as the scalar."""
    return array[()]


# what else a state file may hold (the builtins pickle handles itself never reach the check): torch's own values and
# the containers torch's weights-only loader rebuilds — exact types, so a subclass (a defaultdict, a named tuple)
# is refused when saved rather than when a resumption tries to load it
SAVABLE_TYPES = frozenset(
    {
        torch.Size,
        torch.dtype,
        torch.device,
        dict,
        OrderedDict,
        Counter,
        list,
        tuple,
        set,
        complex,
        bytearray,
        int,
        float,
        str,
        bytes,
        bool,
        type(None),
    }
)
PLAIN_KINDS = "biufcUS"  # numpy dtype kinds a state file may hold: numbers, booleans, fixed-width text
# Everything a state file may rebuild besides what torch's weights-only loader allows by itself (tensors, dicts,
# lists, tuples, sets, str, bytes, numbers, None): the three functions above, which make numpy values of plain dtypes
# only. So loading runs no code of the file's choosing: a pickle naming any other callable is refused.
SAFE_GLOBALS = (ndarray_from_tensor, ndarray_from_bytes, numpy_scalar)


class ArrayPickler(pickle.Pickler):
    """torch.save's pickler, with every numpy value (anywhere in the object) stored through torch's own types, so that
    the file loads with ``weights_only=True`` (:func:`load`): an array as a tensor (torch writes a tensor's storage as
    raw bytes, numpy's own pickling copies it through Python bytes first — 4.6 s against 0.5 s for 400 MB here;
    cwFedAvg's per-client stack is checkpointed every round), a dtype torch lacks as its raw bytes, a scalar as a
    0-d array. Object arrays are refused: nothing we write holds one."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.kind not in PLAIN_KINDS or obj.dtype.fields is not None:
                raise TypeError(f"cannot save a numpy array of dtype {obj.dtype} in a state file")
            dense = obj if obj.flags.c_contiguous else obj.copy(order="C")  # (np.ascontiguousarray makes 0-d 1-d)
            if obj.dtype.isnative and obj.dtype.kind in "biufc" and obj.dtype != np.uint64:
                try:
                    return ndarray_from_tensor, (torch.from_numpy(dense),)
                except (TypeError, ValueError):  # a dtype this torch does not know
                    pass
            raw = torch.from_numpy(np.frombuffer(dense.tobytes(), dtype=np.uint8).copy())  # (frombuffer: not if empty)
            return ndarray_from_bytes, (raw, obj.dtype.str, tuple(obj.shape))
        if isinstance(obj, np.generic):
            return numpy_scalar, (np.asarray(obj),)
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            return NotImplemented  # pickled by name: the loader refuses any name outside its allow-list
        if type(obj) not in SAVABLE_TYPES and not isinstance(obj, torch.Tensor):
            raise TypeError(
                f"cannot save a {type(obj).__module__}.{type(obj).__qualname__} in a state file: only tensors, numpy "
                "arrays and scalars, dicts, lists, tuples, sets and plain values load without running code "
                "(store its fields instead)"
            )
        return NotImplemented


class _ArrayPickleModule:
    """What torch.save needs of a pickle module: ours only differs in its Pickler."""

    Pickler = ArrayPickler
    Unpickler = pickle.Unpickler
    dump, load, loads = pickle.dump, pickle.load, pickle.loads


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file next to ``path``, flushed to disk, then renamed over it: a reader (or a
    resumed run after SIGKILL) sees the old file or the new one, never half of one. Numpy values are written
    through torch's types (:class:`ArrayPickler`) and read back as numpy."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        torch.save(obj, fh, pickle_module=_ArrayPickleModule)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class StateFileError(ConfigError):
    """A state file (checkpoint, server state, a client's private model) that cannot be loaded safely: damaged,
    truncated, not ours, or a pickle asking to run code. Its message names the file and what to do."""


def load(path: str | Path, what: str = "state file", fix: str = "restore the run folder from a copy") -> Any:
    """A file written by :func:`atomic_save`, loaded with torch's weights-only unpickler: tensors, containers,
    numbers, text and the numpy values of :data:`SAFE_GLOBALS` — no other class or callable is built, so a
    tampered file runs no code. Any failure is a :class:`StateFileError` naming the file, ``what`` it is, and
    ``fix``."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateFileError(f"{what} {path} is missing; {fix}") from None
    except Exception as exc:  # noqa: BLE001 - truncated zip, foreign format, a pickle naming a forbidden global, ...
        size = path.stat().st_size if path.is_file() else None
        shape = "empty" if size == 0 else "damaged, foreign or unsafe"
        raise StateFileError(
            f"{what} {path} cannot be loaded ({shape}: {load_failure(exc)}); nothing in it was run. {fix}"
        ) from None


_FORBIDDEN_GLOBAL = re.compile(r"(?:unsupported|Unsupported) (?:GLOBAL|global:?)\s+(?:GLOBAL\s+)?([\w.]+)")


def load_failure(exc: BaseException) -> str:
    """Why torch could not load a state file, in a line: the callable a hostile pickle asked for, else the error's
    first line (never torch's advice to retry with ``weights_only=False``, which would run the file's code)."""
    text = str(exc)
    found = _FORBIDDEN_GLOBAL.search(text)
    if found:
        return f"it asks to call or build {found.group(1)}, which no state file of ours holds"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if "weights_only" in first or not first:
        first = "not a state file written by fedapps"
    return f"{type(exc).__name__}: {first[:200]}"


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
    data = load(path, "checkpoint", RESUME_FIX)
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
        return {key: load(self.directory / name, "server-state file", RESUME_FIX) for key, name in self.names.items()}


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
