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
import csv
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedapps.config import ConfigError, apply_override, config_hash, load_config
from fedapps.reporting.results import read_csv

MAX_GRID_POINTS = 4  # evaluation.md: the same tuning budget for every method


PAPER_COLUMNS = {  # a method's ``paper_metric`` -> the report column it names
    "deployed": "accuracy, deployed model",
    "after-training": "after local training",
    "global": "global model",
}


@dataclass
class Method:
    name: str
    overrides: list[str] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    label: str = ""  # table row label (default: the method's name)
    settings: list[str] = field(default_factory=list)  # the settings it runs in (empty: all of the spec's)
    paper_metric: str = ""  # which column matches what the method's own paper reports (PAPER_COLUMNS)
    paper_note: str = ""  # why, in a sentence (the report's footnote)
    withdrawn_rows: str = ""  # why published rows of this method that carry no config hash no longer stand

    def runs_in(self, setting: str) -> bool:
        return not self.settings or setting in self.settings


@dataclass
class Spec:
    name: str
    title: str
    settings: dict[str, str]  # setting -> base config path
    methods: list[Method]
    seeds: list[int]
    tune_seeds: list[int]
    tune_on: dict[str, str] = field(default_factory=dict)  # setting -> setting whose tuning it reuses
    notes: str = ""
    path: Path = Path(".")
    common: list[str] = field(default_factory=list)  # overrides every setting gets, before each method's own
    setting_overrides: dict[str, list[str]] = field(default_factory=dict)  # setting -> its own overrides (after common)


def grid_points(grid: Mapping[str, list[Any]]) -> int:
    n = 1
    for values in grid.values():
        n *= len(values)
    return n


def read_spec_mapping(
    path: str | os.PathLike, kind: str, known: Iterable[str], required: Sequence[str]
) -> dict[str, Any]:
    """A spec file's top level, checked: readable YAML, a mapping, no key outside ``known``, every ``required`` key
    set; each problem a ConfigError naming the file (``kind``: what it is, e.g. "tables spec") and the key."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{kind} '{path}' cannot be read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{kind} '{path}' must be a mapping with {', '.join(required)}, ...")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{kind} '{path}': unknown key(s) {unknown}; allowed: {sorted(known)}")
    for key in required:
        if not raw.get(key):
            raise ConfigError(f"{kind} '{path}': '{key}' is missing")
    return raw


def load_spec(path: str | os.PathLike) -> Spec:
    """Read and check a tables spec; every problem is a ConfigError naming the key."""
    p = Path(path)
    known = {"name", "title", "settings", "methods", "seeds", "tune_seeds", "tune_on", "notes", "set"}
    raw = read_spec_mapping(p, "tables spec", known, ("name", "settings", "methods"))
    settings, setting_overrides = read_settings(raw["settings"], path)
    methods = []
    allowed = ("set", "grid", "label", "settings", "paper_metric", "paper_note", "withdrawn_rows")
    for name, body in raw["methods"].items():
        body = body or {}
        bad = sorted(set(body) - set(allowed))
        if bad:
            raise ConfigError(
                f"tables spec '{path}': methods.{name} has unknown key(s) {bad}; allowed: " + ", ".join(allowed)
            )
        grid = {str(k): list(v) if isinstance(v, list) else [v] for k, v in (body.get("grid") or {}).items()}
        if grid_points(grid) > MAX_GRID_POINTS:
            raise ConfigError(
                f"tables spec '{path}': methods.{name}.grid has {grid_points(grid)} points; the equal "
                f"budget is at most {MAX_GRID_POINTS} (docs/evaluation.md): drop values"
            )
        only = [str(s) for s in body.get("settings") or []]
        if any(s not in settings for s in only):
            raise ConfigError(
                f"tables spec '{path}': methods.{name}.settings {only} names a setting the spec does "
                f"not have ({', '.join(settings)})"
            )
        metric = str(body.get("paper_metric") or "")
        if metric and metric not in PAPER_COLUMNS:
            raise ConfigError(
                f"tables spec '{path}': methods.{name}.paper_metric '{metric}' is not one of {', '.join(PAPER_COLUMNS)}"
            )
        methods.append(
            Method(
                name,
                [str(o) for o in body.get("set") or []],
                grid,
                str(body.get("label") or name),
                only,
                metric,
                str(body.get("paper_note") or ""),
                " ".join(str(body.get("withdrawn_rows") or "").split()),
            )
        )
    base = p.parent
    for setting, cfg in settings.items():
        if not (base / cfg).is_file() and not Path(cfg).is_file():
            raise ConfigError(f"tables spec '{path}': settings.{setting} -> '{cfg}' is not a file")
    tune_on = {str(k): str(v) for k, v in (raw.get("tune_on") or {}).items()}
    for s, t in tune_on.items():
        if s not in settings or t not in settings or t in tune_on:
            raise ConfigError(f"tables spec '{path}': tune_on.{s}: {t} must map a setting to another, tuned, setting")
    return Spec(
        str(raw["name"]),
        str(raw.get("title") or raw["name"]),
        settings,
        methods,
        [int(s) for s in raw.get("seeds") or [0, 1, 2]],
        [int(s) for s in raw.get("tune_seeds") or [0]],
        tune_on,
        str(raw.get("notes") or ""),
        p,
        [str(o) for o in raw.get("set") or []],
        setting_overrides,
    )


def read_settings(raw: Any, path: str | os.PathLike) -> tuple[dict[str, str], dict[str, list[str]]]:
    """A spec's ``settings``: each a base config path, or ``{config: PATH, set: [KEY=VALUE, ...]}`` (the base
    config with overrides of its own: one base file, several points of a study). Returns (setting -> path,
    setting -> its overrides)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tables spec '{path}': 'settings' must map a name to a config path (or {{config, set}})")
    paths: dict[str, str] = {}
    overrides: dict[str, list[str]] = {}
    for name, value in raw.items():
        if isinstance(value, Mapping):
            bad = sorted(set(value) - {"config", "set"})
            if bad or not value.get("config"):
                raise ConfigError(
                    f"tables spec '{path}': settings.{name} must be a config path or a mapping with 'config' (a "
                    f"path) and optionally 'set' (a list of KEY=VALUE overrides)"
                    + (f"; unknown key(s) {bad}" if bad else "; 'config' is missing")
                )
            sets = value.get("set") or []
            if not isinstance(sets, list) or not all(isinstance(o, str) and "=" in o for o in sets):
                raise ConfigError(
                    f"tables spec '{path}': settings.{name}.set must be a list of KEY=VALUE overrides, got {sets!r}"
                )
            paths[str(name)], overrides[str(name)] = str(value["config"]), [str(o) for o in sets]
        else:
            paths[str(name)] = str(value)
    return paths, overrides


def config_path(spec: Spec, setting: str) -> Path:
    cfg = Path(spec.settings[setting])
    return cfg if cfg.is_absolute() or cfg.is_file() else spec.path.parent / cfg


def with_overrides(base: Path, overrides: list[str]) -> dict[str, Any]:
    raw = yaml.safe_load(base.read_text()) or {}
    for item in overrides:
        apply_override(raw, item)
    return raw


def dotted(raw: Mapping[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.replace("-", "_").split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def yaml_scalar(value: Any) -> str:
    """A value as YAML text that reads back as the same value (1e-09 is a string to YAML 1.1; 1.0e-09 is not)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def write_yaml(path: Path, raw: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(raw), sort_keys=False)
    if not path.is_file() or path.read_text() != text:  # unchanged files keep their config hash and mtime
        path.write_text(text)
    return path


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


def grid_text(m: Method) -> str:
    """A method's grid as the report (and ``<name>-tuning.csv``'s ``grid`` column) writes it."""
    return "; ".join(f"{k} ∈ {{{', '.join(map(str, v))}}}" for k, v in m.grid.items())


def withdrawn_reason(m: Method, row: Mapping[str, Any], recorded_choice: Mapping[str, Any] | None) -> str:
    """Why a published row of a method no longer stands for the spec's method, or "" when it does: the method is
    now tuned over another grid (``recorded_choice``: the published choice over today's grid, None when there is
    none), or the spec withdraws the method's rows that carry no config hash (``withdrawn_rows``: a change such a
    row cannot show, e.g. the method's round count)."""
    if m.grid and recorded_choice is None:
        return f"{m.label} is now tuned over {grid_text(m)}"
    return "" if row.get("config_hash") else m.withdrawn_rows


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


def published_choice(row: Mapping[str, Any], keys: Iterable[str]) -> dict[str, str]:
    """The chosen values a published row records for ``keys`` (its ``chosen:<key>`` columns, as written);
    keys without a value are left out."""
    return {k: row[f"chosen:{k}"] for k in keys if row.get(f"chosen:{k}")}


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
        if not m.grid:
            return
        if not any(self.tune_dir(setting, m).glob("chosen*.yaml")) and self.recorded_choice(setting, m) is not None:
            print(
                f"{m.name} on {setting}: the published choice is reused (tuned over the same grid; no work folder "
                f"here)",
                flush=True,
            )
            return
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


# ------------------------------------------------------------------------------------------------ the report
def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def number(value: Any, digits: int = 3) -> str:
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return "—"


def finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def pm(row: Mapping[str, Any], key: str) -> str:
    """'mean ± SEM' of a column, or '—' where the row has no value (rows measured before the column existed)."""
    return f"{number(row[key])} ± {number(row.get(key + '_sem'))}" if finite(row.get(key)) else "—"


def published(
    out: Path, spec: Spec
) -> tuple[dict[tuple[str, str], dict[str, str]], dict[tuple[str, str], list[dict[str, str]]]]:
    """The rows of an earlier report in ``out`` (``<name>.csv``, ``<name>-tuning.csv``), keyed by (setting, method).

    The published CSVs are the durable record of a table: a setting whose work folder is gone (another machine, a
    fresh clone) keeps its published rows when the report is regenerated for the settings that did run."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    scores: dict[tuple[str, str], list[dict[str, str]]] = {}
    f = out / f"{spec.name}.csv"
    if f.is_file():
        listed = read_rows(f)
        if any(not r.get("commit") and not r.get("published_in") for r in listed):
            blamed = line_commits(f)  # data row k is line k + 2 (after the header)
            for k, r in enumerate(listed):
                if not r.get("commit") and not r.get("published_in") and blamed.get(k + 2):
                    r["published_in"] = blamed[k + 2]
        rows = {(r["setting"], r["method"]): r for r in listed}
    f = out / f"{spec.name}-tuning.csv"
    if f.is_file():
        for r in read_rows(f):
            scores.setdefault((r["setting"], r["method"]), []).append(r)
    return rows, scores


def line_commits(path: Path) -> dict[int, str]:
    """Line number -> the (short) commit that last wrote that line of a committed file (git blame); {} outside git
    or for uncommitted lines. The provenance of published rows measured before rows recorded their own commit."""
    try:
        out = subprocess.run(
            ["git", "blame", "--porcelain", path.name], cwd=path.parent, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    lines = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and len(parts[0]) == 40 and parts[1].isdigit() and parts[2].isdigit():
            if set(parts[0]) != {"0"}:  # all zeros: not committed yet
                lines[int(parts[2])] = parts[0][:10]
    return lines


def report_header(spec: Spec, out: Path) -> list[str]:
    """The report's opening: how to regenerate it, and the protocol (linked to docs/evaluation.md)."""
    protocol = Path(os.path.relpath(REPO / "docs" / "evaluation.md", out.resolve()))
    spec_path = os.path.relpath(spec.path.resolve(), REPO) if spec.path.resolve().is_relative_to(REPO) else spec.path
    return [
        f"# {spec.title}",
        "",
        (
            f"Generated by `fedapps tables {spec_path} --out {os.path.relpath(out.resolve(), REPO)}` "
            "(fedapps_tools/tables.py); do not edit by hand. Each table ends with the commit and machine its rows "
            "were measured with."
        ),
        "",
        (
            f"**Protocol** ([evaluation protocol]({protocol.as_posix()})): accuracy of each client's *deployed model* "
            "after the LAST round on its own test split, mean over clients (± SEM over "
            f'{len(spec.seeds)} seeds: {", ".join(map(str, spec.seeds))}; the partition is fixed). "After local '
            "training\": the client's model right after its local update, where the method has one. Every method was "
            f"tuned with at most {MAX_GRID_POINTS} grid points at seed(s) {', '.join(map(str, spec.tune_seeds))} on a "
            "validation split carved from the clients' training data (deployed model, final round); the test split "
            "was not read while choosing."
        ),
        "",
    ]


def paper_metric_lines(methods: list[Method]) -> list[str]:
    """The footnote saying, per method, which column matches the metric its own paper reports."""
    named = [m for m in methods if m.paper_metric]
    if not named:
        return []
    return [
        "",
        "**Which column matches what each method's paper reports:** "
        + "; ".join(
            f"{m.label}: *{PAPER_COLUMNS[m.paper_metric]}*" + (f" ({m.paper_note.strip()})" if m.paper_note else "")
            for m in named
        )
        + ".",
    ]


def provenance_lines(rows: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """'Measured with commit C on M: methods …' per distinct (commit, machine) of the rows."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name, r in rows.items():
        if r.get("commit"):
            key = f"commit `{r['commit']}` on {r.get('machine') or 'an unrecorded machine'}" + (
                f", {r['date']}" if r.get("date") else ""
            )
        elif r.get("published_in"):
            key = f"runs published in commit `{r['published_in']}` (their own commit was not recorded)"
        else:
            key = "a commit not recorded"
        groups[key].append(labels[name])
    return ["", "Measured with " + "; ".join(f"{k} ({', '.join(v)})" for k, v in groups.items()) + "."]


def report(spec: Spec, work: Path, out: Path) -> Path:
    """``<out>/<name>.md``, ``.csv`` and ``-tuning.csv`` from the finished comparisons and tunings; a setting ×
    method with no result in ``work`` keeps the row of the published CSV, and the report says which."""
    tables = Tables(spec, work, "inprocess", 1, out)
    old_rows = tables.record_rows
    lines = report_header(spec, out)
    if spec.tune_on:
        lines += [
            "**CPU cut:** "
            + "; ".join(f"`{s}` reuses the values tuned on `{t}`" for s, t in spec.tune_on.items())
            + " (no tuning of its own).",
            "",
        ]
    if spec.common:
        lines += ["**Every setting and method here with:** " + ", ".join(f"`{o}`" for o in spec.common) + ".", ""]
    if spec.notes:
        lines += [spec.notes.strip(), ""]
    csv_rows, carried = [], []
    mib = 1024 * 1024
    for setting in spec.settings:
        methods = [m for m in spec.methods if m.runs_in(setting)]
        rows: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}
        carried_here: list[str] = []
        withdrawn: dict[str, str] = {}  # method -> why its published row no longer stands
        changed: list[str] = []  # carried rows whose config hash differs from today's final config
        short: dict[str, list[str]] = {}  # method label -> its runs that lost replies
        for m in methods:
            f = tables.compare_dir(setting, m) / "comparison.csv"
            found = {r["config"]: r for r in read_rows(f)} if f.is_file() else {}
            if m.name in found:
                row: dict[str, Any] = {**found[m.name], "config_hash": tables.final_hash(setting, m)}
                if not finite(row.get("accuracy_worst10")):  # runs made before summary.json recorded it
                    row.update(fairness_from_runs(run_folders(tables, setting, m)))
                row.update(read_provenance(tables.compare_dir(setting, m)))
                rows[m.name] = (row, tables.chosen(setting, m) if m.grid else {})
            elif (setting, m.name) in old_rows:
                r = old_rows[(setting, m.name)]
                why = withdrawn_reason(m, r, tables.recorded_choice(spec.tune_on.get(setting, setting), m))
                if why:
                    withdrawn[m.name] = why
                    continue
                rows[m.name] = (r, published_choice(r, m.grid))
                carried_here.append(m.name)
                if config_changed(tables, setting, m, r):
                    changed.append(m.label)
        if carried_here:
            carried.append(
                f"{setting} (" + ("all methods" if len(carried_here) == len(methods) else ", ".join(carried_here)) + ")"
            )
        if not rows:
            lines += (
                [f"## {setting}", "", "not run yet", ""]
                + [
                    f"- {m.label}: the published row was withdrawn ({withdrawn[m.name]})."
                    for m in methods
                    if m.name in withdrawn
                ]
                + ([""] if withdrawn else [])
            )
            continue
        with_global = any(finite(r.get("final_generic_acc_mean")) for r, _ in rows.values())
        lines += [
            f"## {setting} (`{spec.settings[setting]}`"
            + "".join(f", `{o}`" for o in spec.setting_overrides.get(setting, []))
            + ")",
            "",
            "| method | accuracy, deployed model | sample-weighted | worst 10 % of clients | std over clients | "
            "after local training | "
            + ("global model | " if with_global else "")
            + "up MiB/client/round | down MiB/client/round | wall s | chosen (validation) |",
            "|---|---|---|---|---|---|" + ("---|" if with_global else "") + "---|---|---|---|",
        ]
        for m in methods:
            if m.name not in rows:
                note = (
                    f"not run yet; the published row was withdrawn ({withdrawn[m.name]})"
                    if m.name in withdrawn
                    else "not run yet"
                )
                lines.append(f"| {m.label} | {note} |" + " |" * (8 + with_global))
                continue
            r, chosen = rows[m.name]
            lost = delivery_shortfalls(run_folders(tables, setting, m))
            if lost:
                short[m.label] = lost
            marks = (" ⚠" if lost else "") + (" †" if m.label in changed else "")
            lines.append(
                f"| {m.label}{marks} | {pm(r, 'accuracy_mean')} | {pm(r, 'accuracy_weighted')} | "
                f"{pm(r, 'accuracy_worst10')} | {pm(r, 'accuracy_std')} | {pm(r, 'accuracy_after_training_mean')} | "
                + (f"{pm(r, 'final_generic_acc_mean')} | " if with_global else "")
                + f"{float(r['bytes_up_per_client_round']) / mib:.3f} | "
                f"{float(r['bytes_down_per_client_round']) / mib:.3f} | "
                f"{number(r['wall_seconds'], 0)} | {', '.join(f'{k}={v}' for k, v in chosen.items()) or '(no grid)'} |"
            )
            measured = {k: v for k, v in r.items() if k not in ("setting", "method") and not k.startswith("chosen:")}
            csv_rows.append(
                {
                    "setting": setting,
                    "method": m.name,
                    **measured,
                    **({"lost_replies": "; ".join(lost)} if lost else {}),
                    **{f"chosen:{k}": v for k, v in chosen.items()},
                }
            )
        if short:
            lines += [
                "",
                "⚠ **Runs that lost replies** (less training than the protocol's budget, e.g. a round that "
                "timed out; rerun them before citing the row): "
                + "; ".join(f"{label}: {', '.join(runs)}" for label, runs in short.items())
                + ".",
            ]
        if changed:
            lines += [
                "",
                "† **Carried over with a changed configuration**: measured with a config whose hash differs "
                "from the one the spec makes today (a parameter added or a default changed since; the algorithm "
                "pages say where that changed a method's runs); `--rerun-published` refreshes them: "
                + ", ".join(changed)
                + ".",
            ]
        lines += paper_metric_lines([m for m in methods if m.name in rows])
        lines += provenance_lines({n: r for n, (r, _) in rows.items()}, {m.name: m.label for m in methods})
        lines += figure_lines(tables, setting, out, [m.label for m in methods if m.name in carried_here])
        lines.append("")
    if carried:
        lines += [
            f"**Carried over** from the published `{spec.name}.csv` (their work folder was not present when this "
            "report was written; same spec and protocol): " + "; ".join(carried) + ".",
            "",
        ]
    lines += [
        "## Tuning grids and validation scores",
        "",
        "| method | tuned on | grid | validation accuracy per point (mean over tune seeds) |",
        "|---|---|---|---|",
    ]
    score_rows = []
    for m in spec.methods:
        for setting in spec.settings:
            if setting in spec.tune_on or not m.grid or not m.runs_in(setting):
                continue
            grid = grid_text(m)
            scores = tuning_scores(tables.tune_dir(setting, m)) or next(
                (r["validation_scores"] for r in tables.record_scores.get((setting, m.name), []) if r["grid"] == grid),
                "",
            )
            lines.append(f"| {m.label} | {setting} | {grid} | {scores or 'not run'} |")
            if scores:
                score_rows.append({"setting": setting, "method": m.name, "grid": grid, "validation_scores": scores})
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{spec.name}.md"
    md.write_text("\n".join(lines) + "\n")
    if csv_rows:
        keys: list[str] = []
        for r in csv_rows:
            keys += [k for k in r if k not in keys]
        write_csv(out / f"{spec.name}.csv", keys, csv_rows)
    if score_rows:
        write_csv(out / f"{spec.name}-tuning.csv", ["setting", "method", "grid", "validation_scores"], score_rows)
    return md


def figure_lines(tables: Tables, setting: str, out: Path, carried: list[str]) -> list[str]:
    """The report's link to the setting's figure. Drawn from the runs in the work folder; a setting whose rows are
    all carried over keeps the published figure (its runs are elsewhere), and a figure that lacks carried methods
    says which."""
    caption = f"{setting}: accuracy of the deployed models per round, mean ± SEM over seeds"
    figure = setting_figure(tables, setting, out)
    if figure is None:
        published_figure = figure_path(tables.spec, setting, out)
        if not carried or not published_figure.is_file():
            return []
        return ["", published_link(out / f"{tables.spec.name}.md", published_figure.name, caption)]
    missing = f" (not drawn: {', '.join(carried)}, carried over without their runs)" if carried else ""
    return ["", f"![{caption}{missing}]({figure.name})"]


def published_link(md: Path, figure: str, caption: str) -> str:
    """The link to a figure the report keeps as published: the published report's own line for it (its caption says
    what the figure draws and lacks), else ``caption`` marked as published with the carried-over rows."""
    if md.is_file():
        for line in md.read_text().splitlines():
            if line.startswith("![") and line.endswith(f"]({figure})"):
                return line
    return f"![{caption} (published with the carried-over rows)]({figure})"


def setting_lines(tables: Tables, setting: str) -> list[Any]:
    """One ``fedapps_tools.compare.Line`` per method of the setting that ran in the work folder: its runs at the
    spec's seeds (rounds.csv rows), labelled by the method's table label."""
    from fedapps_tools.compare import Line  # local: the plotting stack only when a report is written

    lines = []
    for m in tables.spec.methods:
        folders = run_folders(tables, setting, m)
        if folders:
            strategy = str(json.loads((folders[0] / "summary.json").read_text()).get("strategy", m.name))
            lines.append(Line(strategy, "", m.label, [read_csv(d / "rounds.csv") for d in folders]))
    return lines


def run_folders(tables: Tables, setting: str, m: Method) -> list[Path]:
    """The finished run folders of (setting, method) at the spec's seeds, in the work folder."""
    runs_dir = tables.compare_dir(setting, m) / "runs"
    return [
        d
        for seed in tables.spec.seeds
        for d in sorted(runs_dir.glob(f"*-s{seed}"))
        if (d / "rounds.csv").is_file() and (d / "summary.json").is_file()
    ]


def delivery_shortfalls(folders: list[Path]) -> list[str]:
    """The runs among ``folders`` that lost replies, each as "seed <s>: <n> replies missing, rounds skipped [...]":
    a run whose round timed out (or whose clients failed) trained less than the protocol's budget."""
    out = []
    for d in folders:
        rows = read_csv(d / "rounds.csv")
        missing = sum(int(r.get("replies_missing") or 0) for r in rows)
        skipped = [int(r["round"]) for r in rows if r.get("skipped")]
        if missing or skipped:
            seed = d.name.rpartition("-s")[2]
            out.append(f"seed {seed}: {missing} replies missing" + (f", rounds skipped {skipped}" if skipped else ""))
    return out


def final_client_accuracies(rows: list[dict[str, Any]]) -> list[float]:
    """The per-client accuracies (``acc_client_<i>``) of the last round whose deployed models were measured."""
    measured = [r for r in rows if isinstance(r.get("acc_mean"), (int, float))]
    if not measured:
        return []
    last = measured[-1]
    return [float(v) for k, v in last.items() if k.startswith("acc_client_") and isinstance(v, (int, float))]


def fairness_from_runs(folders: list[Path]) -> dict[str, float]:
    """Worst 10 % of clients and the std over clients of the final deployed models, mean ± SEM over the runs,
    recomputed from each run's per-client accuracies (for runs made before summary.json recorded them)."""
    from fedapps.reporting.results import client_std, worst_share_mean
    from fedapps_tools.compare import mean_sem

    per_run = [final_client_accuracies(read_csv(d / "rounds.csv")) for d in folders]
    per_run = [accs for accs in per_run if accs]
    if not per_run:
        return {}
    out = {}
    for key, stat in (("accuracy_worst10", worst_share_mean), ("accuracy_std", client_std)):
        out[key], out[key + "_sem"] = mean_sem([stat(accs) for accs in per_run])
    return out


def figure_path(spec: Spec, setting: str, out: Path) -> Path:
    """Where a setting's figure is written (and, once published, found)."""
    return out / f"{spec.name}-{setting}.png"


def setting_figure(tables: Tables, setting: str, out: Path) -> Path | None:
    """``<out>/<name>-<setting>.png``: every method's deployed-model accuracy per round (mean over clients, and
    worst 10 % of clients where recorded), mean ± SEM over the spec's seeds — ``fedapps compare``'s plot with one
    line per method; None when no method of the setting ran in this work folder."""
    from fedapps_tools.compare import plot_curves

    lines = setting_lines(tables, setting)
    if not lines:
        return None
    path = figure_path(tables.spec, setting, out)
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(lines, path)
    return path


def write_csv(path: Path, keys: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def tuning_scores(folder: Path) -> str:
    """'key=value …: 0.912' per grid point, from tuning.csv (validation accuracy, mean over seeds)."""
    f = folder / "tuning.csv"
    if not f.is_file():
        return ""
    rows = read_rows(f)
    acc_key = "val_accuracy_mean"  # fedapps_tools/tune.py's column: validation accuracy of the deployed model
    if not rows or acc_key not in rows[0]:
        return ""
    skip = {acc_key, "val_accuracy_weighted", "seed", "wall_seconds", "run_dir", "point", "reused"}
    by_point: dict[str, list[float]] = {}
    for r in rows:
        label = " ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        try:
            by_point.setdefault(label, []).append(float(r[acc_key]))
        except (TypeError, ValueError):
            continue
    return "; ".join(f"{p}: {sum(v) / len(v):.3f}" for p, v in by_point.items())


def build_parser() -> argparse.ArgumentParser:
    """The ``fedapps tables`` parser (built without side effects: the CLI reference is generated from it)."""
    ap = argparse.ArgumentParser(prog="fedapps tables", description=__doc__.splitlines()[0].strip("`"))
    ap.add_argument("spec", help="the tables spec, e.g. experiments/param-sharing.yaml")
    ap.add_argument("--work", default="results/tables", help="where tunings and runs go (resumable)")
    ap.add_argument("--out", default="docs/results", help="where the report goes")
    ap.add_argument("--settings", default="", help="comma-separated subset of the spec's settings")
    ap.add_argument("--methods", default="", help="comma-separated subset of the spec's methods")
    ap.add_argument("--stages", default="tune,final,report", help="any of tune, final, report")
    ap.add_argument("--engine", default="inprocess", choices=("inprocess", "flower"))
    ap.add_argument("--jobs", type=int, default=1, help="fedapps sub-processes at a time (one thread each)")
    ap.add_argument(
        "--rerun-published",
        action="store_true",
        help="run the seeds of rows the published CSV already holds (reproduce them; draw their curves)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args.spec)
        settings = [s for s in args.settings.split(",") if s] or list(spec.settings)
        methods = [m for m in spec.methods if not args.methods or m.name in args.methods.split(",")]
        bad = [s for s in settings if s not in spec.settings]
        if bad:
            raise ConfigError(f"--settings: {bad} not in the spec ({', '.join(spec.settings)})")
        stages = set(args.stages.split(","))
        work = Path(args.work).resolve() / spec.name
        Tables(spec, work, args.engine, args.jobs, Path(args.out), args.rerun_published).run(settings, methods, stages)
        if "report" in stages:
            print("written:", report(spec, work, Path(args.out)))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"tables failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
