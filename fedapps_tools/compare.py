"""`fedapps compare`: every config × seed through `flwr run` (skipping runs already complete WITH THE SAME
resolved config, so an interrupted comparison resumes and a changed one reruns), then comparison.csv,
comparison.md (mean ± SEM over seeds) and one plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from scipy import stats

from fedapps.config import ConfigError, config_hash, load_config
from fedapps.results import Progress, read_csv, write_csv

log = logging.getLogger("fedapps")


def mean_sem(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (``scipy.stats.sem``: sample std / sqrt(n); 0 for a single value)."""
    vals = np.asarray([float(v) for v in values], dtype=np.float64)
    if not vals.size:
        return math.nan, math.nan
    m = float(vals.mean())
    if vals.size < 2:
        return m, 0.0
    return m, float(stats.sem(vals))


def run_label(config_path: str) -> str:
    """A config's label in the table: its file stem."""
    return Path(config_path).stem


def stored_hash(result_dir: Path) -> str | None:
    """The config hash of a finished run under TODAY's rules: recomputed from the resolved config.yaml it wrote
    (so keys added since then at their defaults, and where the data lives, do not make an unchanged computation
    look changed); without a readable config.yaml, the hash it recorded (summary.json, else config.sha256)."""
    try:
        from strategies import resolve

        cfg = load_config(result_dir / "config.yaml")
        return config_hash(resolve(cfg).config(cfg))
    except (ConfigError, OSError, ValueError, TypeError, KeyError):
        pass
    try:
        value = json.loads((result_dir / "summary.json").read_text()).get("config_hash")
        if value:
            return str(value)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        return (result_dir / "config.sha256").read_text().strip() or None
    except OSError:
        return None


def resume_decision(result_dir: Path, rounds: int, expected_hash: str) -> tuple[bool, str]:
    """(skip?, why): a run is skipped only when summary.json exists, covers every round, records no problem,
    and was made from the config about to run (same ``config_hash``); otherwise it is (re)run."""
    f = result_dir / "summary.json"
    if not f.is_file():
        return False, "running"
    try:
        summary = json.loads(f.read_text())
    except (ValueError, OSError):
        return False, "rerunning (its summary.json is unreadable)"
    if not isinstance(summary, dict):
        return False, "rerunning (its summary.json is not a summary)"
    stored = stored_hash(result_dir)
    if stored is None:
        return False, "rerunning (the earlier run stored no config hash)"
    if stored != expected_hash:
        return False, f"rerunning (the config changed since the earlier run: hash {stored[:12]} -> {expected_hash[:12]})"
    if summary.get("problems"):
        return False, "rerunning (the earlier run failed: " + "; ".join(map(str, summary["problems"]))[:200] + ")"
    try:
        done = int(summary.get("rounds", 0))
    except (TypeError, ValueError):
        done = 0
    if done < rounds:
        return False, f"rerunning (the earlier run stopped after {done} of {rounds} rounds)"
    return True, "already complete with the same config, skipped"


def is_complete(result_dir: Path, rounds: int, expected_hash: str) -> bool:
    """A run counts as done when :func:`resume_decision` says it may be skipped."""
    return resume_decision(result_dir, rounds, expected_hash)[0]


def summarise_runs(label: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: mean ± SEM over seeds of the final accuracies, bytes and wall time."""
    row: dict[str, Any] = {"config": label, "strategy": summaries[0]["strategy"], "seeds": len(summaries)}
    for key in ("accuracy_mean", "accuracy_weighted", "accuracy_after_training_mean", "bytes_up_per_client_round",
                "bytes_down_per_client_round", "wall_seconds"):
        vals = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        m, e = mean_sem(vals)
        row[key] = m
        row[key + "_sem"] = e
    extra_keys = sorted({k for s in summaries for k in s if k.startswith("final_") and k.endswith("_acc_mean")} | ({"clusters"} & {k for s in summaries for k in s}))
    for key in extra_keys:
        vals = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        if vals:
            row[key], row[key + "_sem"] = mean_sem(vals)
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """comparison.md: accuracy ± SEM (the deployed models after the last round; the models right after local
    training beside it), bytes per client per round (MiB), wall time."""
    lines = ["Protocol: deployed model after the last round (specs/evaluation.md), on each client's own evaluation "
             "split; mean ± SEM over seeds.", "",
             "| config | strategy | seeds | accuracy (mean over clients) | accuracy (sample-weighted) | "
             "after local training (mean) | up MiB/client/round | down MiB/client/round | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    mib = 1024 * 1024
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['strategy']} | {r['seeds']} | {r['accuracy_mean']:.4f} ± {r['accuracy_mean_sem']:.4f} | "
            f"{r['accuracy_weighted']:.4f} ± {r['accuracy_weighted_sem']:.4f} | "
            f"{_pm(r, 'accuracy_after_training_mean')} | "
            f"{r['bytes_up_per_client_round'] / mib:.3f} | {r['bytes_down_per_client_round'] / mib:.3f} | "
            f"{r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _pm(row: dict[str, Any], key: str) -> str:
    """'mean ± sem' of a table cell, or '-' where no run had the value."""
    m = row.get(key)
    return "-" if not isinstance(m, float) or math.isnan(m) else f"{m:.4f} ± {row[key + '_sem']:.4f}"


def plot_curves(curves: dict[str, list[list[dict[str, Any]]]], path: Path) -> None:
    """Accuracy (mean over clients) against rounds per config, mean ± SEM band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in curves.items():
        rounds = sorted({r["round"] for run in runs for r in run if isinstance(r.get("acc_mean"), float)})
        means, sems = [], []
        for rnd in rounds:
            vals = [r["acc_mean"] for run in runs for r in run if r["round"] == rnd and isinstance(r.get("acc_mean"), float)]
            m, e = mean_sem(vals)
            means.append(m)
            sems.append(e)
        if not rounds:
            continue
        ax.plot(rounds, means, label=label)
        ax.fill_between(rounds, [m - e for m, e in zip(means, sems)], [m + e for m, e in zip(means, sems)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("deployed-model accuracy, mean over clients (± SEM over seeds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(args: argparse.Namespace, execute: Callable[..., Path]) -> Path:
    """Run every config × seed (resuming), then write the table and the plot; returns the table folder."""
    base_out = Path(args.output_dir or "results").expanduser().resolve()
    folder = base_out / args.name
    runs_dir = folder / "runs"
    labels = [run_label(c) for c in args.configs]
    if len(set(labels)) != len(labels):
        raise ConfigError("compare: two configs share a file name; rename one (the name labels the table row)")
    from strategies import resolve  # local: tools sit above the strategies; `fedapps_tools.compare` stays light

    from fedapps.data import get_federation

    for config in args.configs:  # every config's strategy, params and data checked before the first run starts
        checked = load_config(Path(config).expanduser().resolve(), list(args.overrides))
        resolve(checked)
        get_federation(dataclasses.asdict(checked.data))  # a DataError (a ConfigError) here: exit 2
    rows, curves = [], {}
    total = len(args.configs) * len(args.seeds)
    done = 0
    progress = Progress(total)
    for config, label in zip(args.configs, labels):
        summaries, label_curves = [], []
        for seed in args.seeds:
            overrides = list(args.overrides) + [f"seed={seed}", f"run_name={label}-s{seed}"]
            cfg = load_config(Path(config).expanduser().resolve(), overrides)
            result_dir = runs_dir / cfg.resolved_run_name()
            done += 1
            skip, why = resume_decision(result_dir, cfg.rounds, config_hash(resolve(cfg).config(cfg)))
            print(f"[{done}/{total}] {label} seed {seed}: {why} ({progress.line()})", flush=True)
            if not skip:
                execute(config, overrides, str(runs_dir), args)
            progress.step(worked=not skip)
            summaries.append(json.loads((result_dir / "summary.json").read_text()))
            label_curves.append(read_csv(result_dir / "rounds.csv"))
        rows.append(summarise_runs(label, summaries))
        curves[label] = label_curves
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "comparison.csv", rows)  # header: the union of the rows' keys, first-seen order
    table = markdown_table(rows)
    (folder / "comparison.md").write_text(table)
    plot_curves(curves, folder / "comparison.png")
    print("\n" + table + f"\nwritten: {folder}/comparison.csv, comparison.md, comparison.png")
    return folder
