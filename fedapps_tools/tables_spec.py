"""The tables spec (``experiments/*.yaml``) read and checked, the configs it makes, and the published record of a
table (``<out>/<name>.csv`` and ``<name>-tuning.csv``): what `fedapps tables` (:mod:`fedapps_tools.tables`) runs
from. Orchestration is :mod:`fedapps_tools.tables_run`, the report :mod:`fedapps_tools.tables_report`."""

from __future__ import annotations

import csv
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedapps.config import ConfigError, apply_override

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
    extra: list[str] = field(default_factory=list)  # the command line's --set: after each method's own
    per_round: dict[str, str] = field(default_factory=dict)  # rounds.csv column -> what it is (a table per round)


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
    known = {"name", "title", "settings", "methods", "seeds", "tune_seeds", "tune_on", "notes", "set", "per_round"}
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
    per_round = raw.get("per_round") or {}
    if not isinstance(per_round, Mapping) or not all(isinstance(v, str) and v.strip() for v in per_round.values()):
        raise ConfigError(
            f"tables spec '{path}': 'per_round' must map a rounds.csv column to what it is, "
            "e.g. {cluster_group_ari: adjusted Rand index of the clusters against the true groups}"
        )
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
        per_round={str(k): " ".join(v.split()) for k, v in per_round.items()},
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


def published_choice(row: Mapping[str, Any], keys: Iterable[str]) -> dict[str, str]:
    """The chosen values a published row records for ``keys`` (its ``chosen:<key>`` columns, as written);
    keys without a value are left out."""
    return {k: row[f"chosen:{k}"] for k in keys if row.get(f"chosen:{k}")}


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


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


def write_csv(path: Path, keys: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
