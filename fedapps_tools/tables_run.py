"""`fedapps tables` orchestration: per setting × method, the method's config, its tuning (``fedapps tune``), its
final config and its runs over the seeds (``fedapps compare``), each a ``fedapps`` sub-process, ``--jobs`` at a
time, resumable; the provenance (commit, machine, date) recorded beside each comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fedapps.config import ConfigError, config_hash, load_config
from fedapps_tools.tables_spec import (
    Method,
    Spec,
    config_path,
    dotted,
    grid_text,
    published,
    published_choice,
    with_overrides,
    write_yaml,
    yaml_scalar,
)


def fedapps(args: list[str], log: Path, jobs: int = 1) -> None:
    """One ``fedapps`` sub-command, its output appended to ``log``; a failure stops the tables with its tail. With
    ``jobs`` sub-commands at a time, each in-process engine serves its clients on its share of the cores (one torch
    thread per client), so the jobs together do not oversubscribe the machine."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("FEDAPPS_INPROCESS_WORKERS", str(max(1, (os.cpu_count() or 1) // max(1, jobs))))
    with open(log, "a") as out:
        out.write(f"\n$ fedapps {' '.join(args)}\n")
        out.flush()
        rc = subprocess.run(
            [sys.executable, "-m", "fedapps_tools.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    if rc != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"`fedapps {' '.join(args[:3])} ...` exited {rc}; log {log}:\n{tail}")


PROVENANCE = "provenance.json"  # in a comparison folder: the code and machine its runs were made with
REPO = Path(__file__).resolve().parent.parent  # the checkout: its commit, and where docs/evaluation.md lives


def provenance() -> dict[str, str]:
    """The code (git commit of this checkout, ``+dirty`` with uncommitted changes to tracked files) and the machine
    (cores, GPU) a comparison runs with: the report prints them beside its rows."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short=10", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    gpu = "no GPU"
    try:
        import torch  # local: only to name the GPU

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "commit": commit,
        "machine": f"{os.cpu_count()} CPU cores, {gpu}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def record_provenance(folder: Path, made: Mapping[str, str], since: float) -> None:
    """``folder/provenance.json`` = ``made`` (:func:`provenance`) once a run under ``folder/runs`` has finished since
    ``since`` (a time.time()); an invocation that finished nothing (every run already done) leaves the record as it
    was. Where runs finished earlier with other code stay beside the new ones (a resumed comparison), the record
    names both commits: "old, new"."""
    summaries = list((folder / "runs").glob("*/summary.json"))
    fresh = [f for f in summaries if f.stat().st_mtime >= since]
    if not fresh:
        return
    record = dict(made)
    old = read_provenance(folder)
    if old.get("commit") and len(fresh) < len(summaries):
        commits = [c.strip() for c in str(old["commit"]).split(",") if c.strip()]
        record["commit"] = ", ".join([*commits, *([made["commit"]] if made["commit"] not in commits else [])])
    (folder / PROVENANCE).write_text(json.dumps(record, indent=1))


def read_provenance(folder: Path) -> dict[str, str]:
    """What :func:`record_provenance` wrote for ``folder``; empty when nothing was recorded."""
    path = folder / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def config_changed(tables: Tables, setting: str, m: Method, row: Mapping[str, Any]) -> bool:
    """Whether a published row's config hash differs from the final config the spec makes today (a parameter added
    or a default changed since it was measured). Such a row is carried with a mark, not withdrawn: most such changes
    (a new option, off by default) leave the method's runs as they were."""
    if not row.get("config_hash"):
        return False
    try:
        return tables.final_hash(setting, m) != row["config_hash"]
    except (ConfigError, RuntimeError, ValueError):
        return True


class Tables:
    def __init__(
        self, spec: Spec, work: Path, engine: str, jobs: int, out: Path | None = None, rerun_published: bool = False
    ) -> None:
        """``out``: where the published report lives; its records stand in for tunings whose work folder is gone.
        ``rerun_published``: run the seeds of rows the published CSV already holds (to reproduce them, or to draw
        their curves); their published tuning choices still stand."""
        self.spec, self.work, self.engine, self.jobs = spec, work, engine, jobs
        self.rerun_published = rerun_published
        self.record_rows, self.record_scores = published(out, spec) if out is not None else ({}, {})

    def method_config(self, setting: str, m: Method) -> Path:
        raw = with_overrides(
            config_path(self.spec, setting),
            [
                f"strategy.name={m.name}",
                *self.spec.common,
                *self.spec.setting_overrides.get(setting, []),
                *m.overrides,
                *self.spec.extra,
            ],
        )
        return write_yaml(self.work / setting / "methods" / f"{m.name}.yaml", raw)

    def tune_dir(self, setting: str, m: Method) -> Path:
        return self.work / self.spec.tune_on.get(setting, setting) / "tune" / m.name

    def recorded_choice(self, setting: str, m: Method) -> dict[str, Any] | None:
        """The choice published for (setting, method) in ``<out>/<name>.csv``, if it was tuned over the same grid
        (``<out>/<name>-tuning.csv`` holds the grid it was tuned over); None otherwise."""
        row = self.record_rows.get((setting, m.name))
        tuned = [r for r in self.record_scores.get((setting, m.name), []) if r.get("grid") == grid_text(m)]
        values = published_choice(row, m.grid) if row is not None else {}
        if not tuned or len(values) < len(m.grid):
            return None
        return {k: yaml.safe_load(v) for k, v in values.items()}

    def tune(self, setting: str, m: Method) -> None:
        """The method's grid on the setting's validation split (``fedapps tune``), unless a tuning is there or the
        published record stands in for it: a choice over the same grid whose row was measured with the config that
        choice makes today (same hash; a row without a hash is taken at its word). A choice made for another config
        of the method (an option or default changed since: another method, in effect) is tuned again."""
        if not m.grid:
            return
        row = self.record_rows.get((setting, m.name))
        if not any(self.tune_dir(setting, m).glob("chosen*.yaml")) and self.recorded_choice(setting, m) is not None:
            if row is None or not config_changed(self, setting, m, row):
                print(
                    f"{m.name} on {setting}: the published choice is reused (tuned over the same grid; no work "
                    "folder here)",
                    flush=True,
                )
                return
            print(
                f"{m.name} on {setting}: the published choice was made for another config of the method (its row's "
                "hash differs from today's): tuned again",
                flush=True,
            )
        args = [
            "tune",
            str(self.method_config(setting, m)),
            "--out",
            str(self.tune_dir(setting, m)),
            "--seeds",
            ",".join(map(str, self.spec.tune_seeds)),
            "--engine",
            self.engine,
        ]
        for key, values in m.grid.items():
            args += ["--grid", f"{key}=" + ",".join(yaml_scalar(v) for v in values)]
        started = time.monotonic()
        fedapps(args, self.work / "logs" / f"tune-{setting}-{m.name}.log", self.jobs)
        print(f"tuned {m.name} on {setting} ({time.monotonic() - started:.0f} s)", flush=True)

    def chosen(self, setting: str, m: Method) -> dict[str, Any]:
        """The grid keys' chosen values (read from the tuning's chosen config)."""
        if not m.grid:
            return {}
        chosen_files = sorted(self.tune_dir(setting, m).glob("chosen*.yaml"))
        if not chosen_files:
            recorded = self.recorded_choice(self.spec.tune_on.get(setting, setting), m)
            if recorded is not None:
                return recorded
            raise RuntimeError(f"no chosen config in {self.tune_dir(setting, m)}: run the tuning stage first")
        raw = yaml.safe_load(chosen_files[0].read_text())
        return {key: dotted(raw, key) for key in m.grid}

    def final_config(self, setting: str, m: Method) -> Path:
        chosen = self.chosen(setting, m)
        raw = with_overrides(self.method_config(setting, m), [f"{k}={yaml_scalar(v)}" for k, v in chosen.items()])
        return write_yaml(self.work / setting / "final" / f"{m.name}.yaml", raw)

    def compare_dir(self, setting: str, m: Method) -> Path:
        return self.work / "compare" / f"{setting}--{m.name}"

    def final_hash(self, setting: str, m: Method) -> str:
        """The config hash of the method's final config, resolved (what its runs compute)."""
        from strategies import resolve  # local: the tool stays light until a hash is needed

        cfg = load_config(self.final_config(setting, m))
        return config_hash(resolve(cfg).config(cfg))

    def compare(self, setting: str, m: Method) -> None:
        """The method's final config over the seeds (one ``fedapps compare`` per setting × method, so they run
        ``--jobs`` at a time). A published row of the same final config (same hash) stands when its work folder
        is gone: the record of a run made on another machine or in an earlier clone (unless ``rerun_published``)."""
        row = self.record_rows.get((setting, m.name))
        if (
            not self.rerun_published
            and not (self.compare_dir(setting, m) / "comparison.csv").is_file()
            and row is not None
            and row.get("config_hash") == self.final_hash(setting, m)
        ):
            print(
                f"{m.name} on {setting}: the published row of the same config stands (no work folder here)", flush=True
            )
            if m.withdrawn_rows:  # the hash cannot show a change of the algorithm's code under the same config
                print(
                    f"  note: the spec withdraws {m.name}'s earlier rows ({m.withdrawn_rows}); a config hash cannot "
                    "show a change of the code under the same config: if this row was measured before that change, "
                    "measure it again with --rerun-published",
                    flush=True,
                )
            return
        args = [
            "compare",
            str(self.final_config(setting, m)),
            "--seeds",
            *map(str, self.spec.seeds),
            "--name",
            self.compare_dir(setting, m).name,
            "--output-dir",
            str(self.work / "compare"),
            "--engine",
            self.engine,
            "--quiet",
        ]
        started, since = time.monotonic(), time.time()
        before = provenance()
        fedapps(args, self.work / "logs" / f"compare-{setting}-{m.name}.log", self.jobs)
        if self.compare_dir(setting, m).is_dir():  # the comparison's own folder (absent only when mocked in tests)
            record_provenance(self.compare_dir(setting, m), before, since)
        print(
            f"ran {m.name} on {setting} over seeds {self.spec.seeds} ({time.monotonic() - started:.0f} s)", flush=True
        )

    def run(self, settings: list[str], methods: list[Method], stages: set[str]) -> None:
        """One task per (setting, method): its tuning (on the setting it is tuned on, see ``tune_on``), then its
        runs over the seeds; ``--jobs`` tasks at a time, in the order given. A method's rows are there as soon as
        its own task ends (no waiting for every tuning), and a tuning two tasks share runs once."""
        locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        tuned: set[tuple[str, str]] = set()

        def task(setting: str, m: Method) -> None:
            if "tune" in stages:
                key = (self.spec.tune_on.get(setting, setting), m.name)
                with locks[key]:
                    if key not in tuned:
                        self.tune(key[0], m)
                        tuned.add(key)
            if "final" in stages:
                self.compare(setting, m)

        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            list(pool.map(lambda sm: task(*sm), [(s, m) for s in settings for m in methods if m.runs_in(s)]))
