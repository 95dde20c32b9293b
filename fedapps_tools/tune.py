"""`fedapps tune CONFIG --grid KEY=V1,V2,... --seeds 0`: choose hyper-parameters on the validation split.

The rule (docs/evaluation.md#splits, docs/evaluation.md#equal-tuning-budget): every point of the cartesian grid runs
at every seed with ``data.evaluate_on=validation`` (each client trains on the fit share of its train split and is
scored on the validation share; the test split is never built); the point with the highest final-round validation
accuracy of the deployed model (summary.json ``accuracy_mean``, averaged over the seeds) is chosen, ties going to the
first point in grid order. At most ``--max-points`` points (default 4, the equal-budget rule). Runs finished with the
same resolved config (same config hash) are reused, so an interrupted tuning resumes (``fedapps compare``'s rule).

Writes ``tuning.csv`` (one row per point × seed), ``tuning.md`` (the table, the chosen values, the grid and the
protocol) and ``chosen.yaml`` (the input config with the ``--set`` overrides and the chosen values applied, and
``data.evaluate_on: test``: the final run). No test accuracy is read: only summary.json files that say
``"evaluated_on": "validation"`` are opened.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from fedapps.config import (
    ConfigError,
    apply_override,
    config_from_dict,
    config_hash,
    load_config,
    parse_yaml,
    read_config_text,
    split_overrides,
)
from fedapps.reporting.results import write_csv
from fedapps_tools.compare import make_run, mean_sem, plan_run
from fedapps_tools.options import add_run_options, add_seeds_option, parse_seeds, resolve_root
from fedapps_tools.progressbar import RunProgress

# docs/evaluation.md#equal-tuning-budget: the same number of grid points (at most 4) for every method
DEFAULT_MAX_POINTS = 4

# keys the tuning itself sets or that would change what is measured; they cannot be tuned
NOT_TUNABLE: dict[str, str] = {
    "seed": "the seeds come from --seeds",
    "run_name": "tune names every run itself",
    "output_dir": "use --output-dir (or --out for the tuning's folder itself)",
    "data.evaluate_on": "tuning always evaluates on the validation split",
    "data.validation_fraction": "every point must be scored on the same validation split",
    "data.seed": "the partition stays fixed while tuning (docs/evaluation.md)",
    "strategy.name": "tune one method at a time, each with its own budget (run tune once per strategy)",
}
NOT_SETTABLE = ("seed", "run_name", "data.evaluate_on")  # set by tune for every run; --set may not change them

# YAML 1.1 (PyYAML) reads "1e-3" as a string; a grid value in that form is meant as a number
_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)[eE][+-]?\d+")


def normalise_key(key: str) -> str:
    """A dotted config key as the overrides read it ('-' -> '_')."""
    return key.strip().replace("-", "_")


def parse_value(text: str, key: str) -> Any:
    """One grid value as a YAML scalar (0.01, true, norm, 5; also 1e-3 as a number)."""
    t = text.strip()
    if not t:
        raise ConfigError(f"--grid {key}: an empty value; write the values separated by commas, e.g. {key}=0.01,0.1")
    if _EXPONENT_NUMBER.fullmatch(t):
        return float(t)
    try:
        value = parse_yaml(t)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--grid {key}: value {t!r} is not a YAML scalar ({exc})") from exc
    if value is None or isinstance(value, (list, dict)):
        raise ConfigError(f"--grid {key}: value {t!r} must be a scalar (number, true/false or a word)")
    return value


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``["client.lr=0.01,0.1", ...]`` -> ``[("client.lr", [0.01, 0.1]), ...]`` in the order given."""
    if not items:
        raise ConfigError("tune needs at least one --grid KEY=V1,V2,... (e.g. --grid client.lr=0.01,0.05)")
    grid: list[tuple[str, list[Any]]] = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--grid '{item}' must look like KEY=V1,V2,... (e.g. client.lr=0.01,0.05)")
        raw_key, _, text = item.partition("=")
        key = normalise_key(raw_key)
        if not key:
            raise ConfigError(f"--grid '{item}' has an empty key")
        if key in NOT_TUNABLE:
            raise ConfigError(f"--grid {key}: cannot be tuned ({NOT_TUNABLE[key]})")
        if any(key == k for k, _ in grid):
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid {key}=V1,V2,...")
        values = [parse_value(v, key) for v in text.split(",")]
        if len(set(map(_yaml_text, values))) != len(values):
            raise ConfigError(f"--grid {key}: a value is repeated ({text}); list each value once")
        grid.append((key, values))
    return grid


def grid_points(grid: Sequence[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """The cartesian product in grid order (the first key varies slowest): one {key: value} per point."""
    keys = [k for k, _ in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(values for _, values in grid))]


def check_budget(grid: Sequence[tuple[str, list[Any]]], max_points: int) -> int:
    """The number of points; ConfigError when it exceeds ``max_points`` (the equal-budget rule)."""
    n = math.prod(len(values) for _, values in grid)
    if n > max_points:
        shape = " × ".join(f"{k}: {len(v)}" for k, v in grid)
        raise ConfigError(
            f"the grid has {n} points ({shape}), more than --max-points {max_points}. The equal-budget rule "
            f"of a comparison (docs/evaluation.md) gives every method the same number of grid points, at most "
            f"{DEFAULT_MAX_POINTS}: drop values or keys (raise --max-points only for a study that is not a "
            "comparison)"
        )
    return n


def _yaml_text(value: Any) -> str:
    """A scalar as YAML text that reads back as the same value (1e-09 -> '1.0e-09', which PyYAML reads)."""
    text = yaml.safe_dump(value, default_flow_style=True)
    return text[: -len("\n...\n")] if text.endswith("\n...\n") else text.strip()


def point_overrides(point: dict[str, Any]) -> list[str]:
    """A point as ``key=value`` overrides."""
    return [f"{k}={_yaml_text(v)}" for k, v in point.items()]


def point_label(point: dict[str, Any]) -> str:
    """``client.lr=0.1, client.epochs=2``."""
    return ", ".join(f"{k}={_yaml_text(v)}" for k, v in point.items())


def choose_point(scores: Sequence[float]) -> int:
    """Index of the highest score; a tie goes to the first point in grid order; a NaN (a point with no
    validation accuracy) is never chosen. ConfigError-free: raises ValueError when no score is a number."""
    best = -1
    for i, value in enumerate(scores):
        if math.isfinite(value) and (best < 0 or value > scores[best]):
            best = i
    if best < 0:
        raise ValueError("no grid point produced a validation accuracy")
    return best


def validation_numbers(result_dir: Path) -> dict[str, Any]:
    """The numbers tune reads from a finished run: validation accuracy (mean, weighted) and wall time. Refuses a
    run whose summary.json does not say it was evaluated on the validation split."""
    summary = json.loads((result_dir / "summary.json").read_text())
    split = summary.get("evaluated_on")
    if split != "validation":
        raise ConfigError(
            f"{result_dir}/summary.json says evaluated_on={split!r}: tune reads validation runs only "
            "(delete the folder so that it is rerun)"
        )

    def num(key: str) -> float:
        v = summary.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    return {
        "val_accuracy_mean": num("accuracy_mean"),
        "val_accuracy_weighted": num("accuracy_weighted"),
        "wall_seconds": num("wall_seconds"),
    }


def _check_set(overrides: Sequence[str]) -> None:
    for item in overrides:
        key = normalise_key(item.partition("=")[0])
        if key in NOT_SETTABLE:
            raise ConfigError(
                f"--set {item}: tune sets '{key}' for every run itself "
                f"({NOT_TUNABLE.get(key, 'the seeds come from --seeds')}); remove it"
            )


def _check_points(
    config_path: Path, base: list[str], grid: list[tuple[str, list[Any]]], points: list[dict[str, Any]]
) -> None:
    """Every point loads, resolves and builds its data before anything runs; points that compute the same thing
    (a repeated value, a key the strategy ignores) are an error."""
    from fedapps.data import get_federation
    from strategies import resolve  # local: tools sit above the strategies

    first = load_config(config_path, base + ["data.evaluate_on=validation"])
    for key, _ in grid:
        parts = key.split(".")
        if parts[:2] == ["strategy", "params"] and len(parts) >= 4 and parts[2] != first.strategy.name:
            raise ConfigError(
                f"--grid {key}: strategy '{first.strategy.name}' ignores the section "
                f"strategy.params.{parts[2]}; tune strategy.params.{first.strategy.name}.* instead"
            )
    seen: dict[str, int] = {}
    for n, point in enumerate(points, 1):
        try:
            cfg = load_config(config_path, base + point_overrides(point) + ["data.evaluate_on=validation"])
            cfg = resolve(cfg).config(cfg)
            get_federation(dataclasses.asdict(cfg.data))
        except ConfigError as exc:
            raise ConfigError(f"--grid point {n} ({point_label(point)}): {exc}") from exc
        h = config_hash(cfg)
        if h in seen:
            raise ConfigError(
                f"--grid points {seen[h]} and {n} ({point_label(point)}) resolve to the same config; "
                "a value is repeated, or the key has no effect on this strategy"
            )
        seen[h] = n


def chosen_config_text(config_path: Path, base: list[str], point: dict[str, Any], header: str) -> str:
    """The input YAML with the --set overrides and the chosen point applied and ``data.evaluate_on: test``."""
    raw = parse_yaml(read_config_text(config_path)) or {}
    for item in split_overrides(base) + point_overrides(point) + ["data.evaluate_on=test"]:
        apply_override(raw, item)
    config_from_dict(copy.deepcopy(raw))  # validated (on a copy: data.root is made absolute there)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + yaml.safe_dump(raw, sort_keys=False)


def markdown(
    config_path: Path,
    grid: list[tuple[str, list[Any]]],
    points: list[dict[str, Any]],
    per_point: list[dict[str, Any]],
    chosen: int,
    seeds: list[int],
    validation_fraction: float,
    max_points: int,
) -> str:
    """tuning.md: the table, the chosen values, the grid and the protocol sentence."""
    keys = [k for k, _ in grid]
    lines = [
        f"# Tuning of `{config_path.name}`",
        "",
        "| point | "
        + " | ".join(f"`{k}`" for k in keys)
        + " | seeds | validation accuracy, mean over clients (± SEM over seeds; 1 seed: none) | sample-weighted "
        "| wall s | |",
        "|---|" + "---|" * len(keys) + "---|---|---|---|---|",
    ]
    for n, (point, agg) in enumerate(zip(points, per_point), 1):
        spread = f" ± {agg['sem']:.4f}" if agg["seeds"] > 1 else ""  # one seed: no spread to show
        lines.append(
            f"| {n} | "
            + " | ".join(_yaml_text(point[k]) for k in keys)
            + f" | {agg['seeds']} | {agg['mean']:.4f}{spread} | {agg['weighted']:.4f} | "
            f"{agg['wall']:.0f} | {'**chosen**' if n - 1 == chosen else ''} |"
        )
    grid_text = "; ".join(f"`{k}` ∈ {{{', '.join(_yaml_text(v) for v in values)}}}" for k, values in grid)
    lines += [
        "",
        (
            f"**Chosen** (point {chosen + 1}): `{point_label(points[chosen])}` — written to `chosen.yaml` "
            "(with `data.evaluate_on: test`, for the final runs)."
        ),
        "",
        f"**Grid**: {grid_text} — {len(points)} point(s) (budget {max_points}), seeds {', '.join(map(str, seeds))}.",
        "",
        (
            "**Protocol**: every point was trained on the fit share of each client's train split and scored on the "
            f"validation share (`data.validation_fraction` = {validation_fraction}, stratified, seeded from "
            "`data.seed`); "
            "the point with the highest final-round validation accuracy of the deployed model (mean over clients, "
            "averaged over the seeds) was chosen, a tie going to the first point in grid order. The test split was "
            "never built while choosing (docs/evaluation.md)."
        ),
        "",
    ]
    return "\n".join(lines)


def looks_like_tuning(folder: Path) -> bool:
    """A folder an earlier `fedapps tune` wrote into (its table, its choice, or its runs p<point>-s<seed>)."""
    return (
        (folder / "tuning.csv").is_file() or (folder / "chosen.yaml").is_file() or any((folder / "runs").glob("p*-s*"))
    )


def tuning_folder(args: argparse.Namespace, config_output_dir: str, config_path: Path) -> Path:
    """Where the tuning goes: ``--out DIR`` itself, else ``<--output-dir>/<--name>`` (the results root as in run and
    compare; defaults: the config's output_dir and ``tune-<config file name>``). ``--output-dir`` once named the
    tuning's folder itself: a folder holding such a tuning is refused (ConfigError naming both meanings) rather
    than a new tuning started silently under it."""
    out, root, name = getattr(args, "out", None), getattr(args, "output_dir", None), getattr(args, "name", None)
    if out:
        if root or name:
            raise ConfigError("tune: --out names the tuning's folder itself; drop --output-dir / --name, or drop --out")
        return Path(out).expanduser().resolve()
    base = resolve_root(root, config_output_dir)
    if root and looks_like_tuning(base):
        raise ConfigError(
            f"tune: --output-dir is the results root (as in run and compare), so this tuning would go "
            f"to {base / (name or f'tune-{config_path.stem}')}; but {base} holds an earlier tuning "
            f"(tuning.csv / chosen.yaml / runs): to continue that one pass --out {base}"
        )
    return base / (name or f"tune-{config_path.stem}")


def tune(args: argparse.Namespace, execute: Callable[..., Path]) -> Path:
    """Run the grid (resuming), choose, write tuning.csv / tuning.md / chosen.yaml; return the folder."""

    config_path = Path(args.config).expanduser().resolve()
    if not config_path.is_file():
        raise ConfigError(f"config file '{args.config}' not found; pass the path of a YAML file")
    base = split_overrides(list(args.overrides))
    _check_set(base)
    grid = parse_grid(args.grid)
    max_points = int(args.max_points)
    if max_points < 1:
        raise ConfigError(f"--max-points must be >= 1, got {max_points}")
    check_budget(grid, max_points)
    seeds = parse_seeds(args.seeds)
    points = grid_points(grid)
    _check_points(config_path, base, grid, points)  # every point checked before the first run starts

    first = load_config(config_path, base + ["data.evaluate_on=validation"])
    folder = tuning_folder(args, first.output_dir, config_path)
    print(f"tuning folder: {folder}", flush=True)
    runs_dir = folder / "runs"
    keys = [k for k, _ in grid]
    rows: list[dict[str, Any]] = []
    per_point: list[dict[str, Any]] = []
    progress = RunProgress(len(points) * len(seeds))
    for n, point in enumerate(points, 1):
        numbers = []
        for seed in seeds:
            overrides = (
                base
                + point_overrides(point)
                + ["data.evaluate_on=validation", f"seed={seed}", f"run_name=p{n}-s{seed}"]
            )
            cfg = load_config(config_path, overrides)
            result_dir = runs_dir / cfg.resolved_run_name()
            skip, after, why = plan_run(result_dir, cfg)
            progress.start(f"point {n} ({point_label(point)}) seed {seed}: {why}")
            if not skip:
                make_run(execute, str(config_path), overrides, result_dir, after, args)
            progress.finish(worked=not skip)
            got = validation_numbers(result_dir)
            numbers.append(got)
            rows.append(
                {
                    "point": n,
                    "seed": seed,
                    **{k: point[k] for k in keys},
                    **got,
                    "reused": skip,
                    "run_dir": str(result_dir),
                }
            )
        means = [g["val_accuracy_mean"] for g in numbers]
        m, e = mean_sem(means) if all(math.isfinite(v) for v in means) else (math.nan, math.nan)
        w = mean_sem([g["val_accuracy_weighted"] for g in numbers])[0]
        per_point.append(
            {"seeds": len(numbers), "mean": m, "sem": e, "weighted": w, "wall": sum(g["wall_seconds"] for g in numbers)}
        )
    progress.close()
    try:
        chosen = choose_point([p["mean"] for p in per_point])
    except ValueError as exc:
        raise ConfigError(f"tune: {exc} (every run ended without a final-round accuracy); see {runs_dir}") from exc

    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "tuning.csv", rows)
    table = markdown(config_path, grid, points, per_point, chosen, seeds, first.data.validation_fraction, max_points)
    (folder / "tuning.md").write_text(table)
    header = (
        f"chosen by `fedapps tune {config_path.name}` on the validation split: {point_label(points[chosen])}\n"
        f"(see {folder / 'tuning.md'}); data.evaluate_on: test for the final runs"
    )
    (folder / "chosen.yaml").write_text(chosen_config_text(config_path, base, points[chosen], header))
    print("\n" + table + f"\nwritten: {folder}/tuning.csv, tuning.md, chosen.yaml")
    return folder


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="run a grid on the validation split and choose by validation accuracy",
        description="Run every point of a grid on the validation split, choose the point with the "
        "best validation accuracy and write it as chosen.yaml (for the final runs).",
    )
    p.add_argument(
        "config", metavar="CONFIG", help="the YAML file whose keys the grid varies, e.g. configs/fedavg.yaml"
    )
    p.add_argument(
        "--grid",
        nargs="+",
        action="extend",
        default=[],
        required=True,
        metavar="KEY=V1,V2,...",
        help="a key and its values (YAML scalars, comma-separated); repeat for more keys: the cartesian "
        "grid runs, e.g. --grid client.lr=0.01,0.05 --grid client.epochs=1,2",
    )
    add_seeds_option(p, [0], "the seeds every grid point runs at (one seed is the tuning rule of the published tables)")
    p.add_argument(
        "--max-points",
        type=int,
        default=4,
        metavar="N",
        help="refuse a grid with more points (default 4: every method gets the same budget of grid "
        "points in a comparison)",
    )
    p.add_argument(
        "--name", default=None, help="the tuning's folder under --output-dir (default: tune-<config file name>)"
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="the tuning's folder itself, instead of --output-dir and --name"
    )
    add_run_options(p, "DIR/<name>/: tuning.csv, tuning.md, chosen.yaml and the runs (runs/)")
    return p


def run(args: argparse.Namespace) -> int:
    from fedapps_tools import launch

    launch.start_logging(args)
    tune(args, launch.execute)
    return 0
