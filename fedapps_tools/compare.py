"""`fedapps compare`: every config × seed through `flwr run` (skipping runs already complete WITH THE SAME
resolved config; an interrupted run of the same config continues after its last checkpointed round, a changed one
reruns), then comparison.csv,
comparison.md (mean ± SEM over seeds, fairness across clients beside the mean) and one plot (comparison.png:
one line per config, labelled by its strategy — and its setting where the configs' settings differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedapps.config import ConfigError, ExperimentConfig, config_hash, load_config
from fedapps.reporting import plots
from fedapps.reporting.results import read_csv, write_csv
from fedapps_tools.options import add_run_options, add_seeds_option, parse_seeds, resolve_root
from fedapps_tools.progressbar import RunProgress

log = logging.getLogger("fedapps")


def mean_sem(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (``scipy.stats.sem``: sample std / sqrt(n); 0 for a single value)."""
    vals = np.asarray([float(v) for v in values], dtype=np.float64)
    if not vals.size:
        return math.nan, math.nan
    m = float(vals.mean())
    if vals.size < 2:
        return m, 0.0
    from scipy import stats  # local: scipy.stats takes seconds to import, and only a table needs it

    return m, float(stats.sem(vals))


def run_label(config_path: str) -> str:
    """A config's label in the table: its file stem."""
    return Path(config_path).stem


def setting_label(cfg: ExperimentConfig) -> str:
    """The data setting of a config in a few words (source, partition and its parameter, clients), e.g.
    ``mnist5k dirichlet α=0.1, 20 clients``: what a plot adds to a method's name when it mixes settings."""
    d = cfg.data
    detail = {
        "pathological": f" {d.classes_per_client} classes/client",
        "dirichlet": f" α={d.alpha:g}",
        "cosmos-groups": f" {d.groups} groups α={d.alpha:g}",
        "rotated": f" {d.groups} groups",
        "label-swap": f" {d.groups} groups",
    }.get(d.partition, "")
    return f"{d.source} {d.partition}{detail}, {d.num_clients} clients"


SETTING_COLUMNS = ("data_source", "partition", "clients", "rounds", "model")  # comparison.csv: each row's setting


def setting_columns(cfg: ExperimentConfig) -> dict[str, Any]:
    """A row's setting as comparison.csv records it: data source, partition (with its parameter), clients,
    rounds, model."""
    d, m = cfg.data, cfg.model
    return {
        "data_source": d.source,
        "partition": setting_label(cfg).removeprefix(f"{d.source} ").rsplit(",", 1)[0],
        "clients": d.num_clients,
        "rounds": cfg.rounds,
        "model": "+".join(m.per_client) if m.per_client else m.name,
    }


def setting_text(row: dict[str, Any]) -> str:
    """The setting columns of a row in a few words (comparison.md), '' for a row made before they were recorded."""
    if "data_source" not in row:
        return ""
    return f"{row['data_source']} {row['partition']}, {row['clients']} clients, {row['rounds']} rounds, {row['model']}"


def setting_differences(configs: Sequence[ExperimentConfig], labels: Sequence[str]) -> list[str]:
    """The keys outside the strategy and its parameters (client training aside: a method's tuned
    hyper-parameters) in which the configs differ: data (where the files are aside), model, rounds, privacy; each
    as "key (label value, ...)"."""

    def flat(cfg: ExperimentConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"rounds": cfg.rounds}
        for section in ("data", "model", "privacy"):
            for key, value in dataclasses.asdict(getattr(cfg, section)).items():
                if (section, key) != ("data", "root"):
                    out[f"{section}.{key}"] = value
        return out

    flats = [flat(c) for c in configs]
    return [
        f"{key} ({', '.join(f'{label} {f[key]!r}' for label, f in zip(labels, flats))})"
        for key in flats[0]
        if any(f[key] != flats[0][key] for f in flats[1:])
    ]


def check_same_setting(configs: Sequence[ExperimentConfig], labels: Sequence[str], allow_mixed: bool) -> None:
    """ConfigError, before any run, when the configs differ in their setting: such a table compares settings as
    much as strategies. ``allow_mixed``: tabulate them anyway (each row's setting is in the table)."""
    differences = setting_differences(configs, labels)
    if not differences or allow_mixed:
        if differences:
            log.warning("compare: the rows differ in their setting (--allow-mixed): %s", "; ".join(differences))
        return
    raise ConfigError(
        "compare: the configs differ in more than the strategy and its parameters: "
        + "; ".join(differences)
        + "; a table of mixed settings compares settings, not strategies. Give every config the same setting "
        f"(e.g. add {same_setting_hint(configs[0], differences)} to compare them all on {labels[0]}'s), or pass "
        "--allow-mixed to tabulate them anyway (each row's setting is shown)"
    )


def same_setting_hint(first: ExperimentConfig, differences: Sequence[str]) -> str:
    """``--set KEY=VALUE ...`` giving every config ``first``'s value of each differing key (as the override parser
    reads it back), to paste after the command."""
    sets = []
    for difference in differences:
        key = difference.split(" ", 1)[0]
        value: Any = first.rounds if key == "rounds" else getattr(getattr(first, key.split(".")[0]), key.split(".")[1])
        text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
        sets.append(shlex.quote(f"{key}={text}"))
    return "--set " + " ".join(sets)


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
    """(skip?, why): a run is skipped only when summary.json exists, covers every round, records no problem, lost
    no reply (:func:`lost_replies`) and was made from the config about to run (same ``config_hash``); otherwise it
    is (re)run."""
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
        return (
            False,
            f"rerunning (the config changed since the earlier run: hash {stored[:12]} -> {expected_hash[:12]})",
        )
    if summary.get("problems"):
        return False, "rerunning (the earlier run failed: " + "; ".join(map(str, summary["problems"]))[:200] + ")"
    try:
        done = int(summary.get("rounds", 0))
    except (TypeError, ValueError):
        done = 0
    if done < rounds:
        return False, f"rerunning (the earlier run stopped after {done} of {rounds} rounds)"
    lost = lost_replies(result_dir)
    if lost:
        return False, f"rerunning (the earlier run lost replies: {lost}; it trained less than its config asks)"
    return True, "already complete with the same config, skipped"


def lost_replies(result_dir: Path) -> str:
    """The rounds of a run whose replies went missing (a round that timed out: the machine was paused or too busy,
    a client failed), as "N in round r, ..."; "" when none did or the run has no rounds.csv. Nothing in a config
    drops replies on purpose, so such a run trained less than its config asks and is not a seed to compare."""
    try:
        rows = read_csv(result_dir / "rounds.csv")
    except (OSError, ValueError):
        return ""
    lost = [(r.get("round"), int(r.get("replies_missing") or 0)) for r in rows]
    return ", ".join(f"{n} in round {rnd}" for rnd, n in lost if n)


def checkpointed_round(result_dir: Path, resolved: ExperimentConfig) -> int | None:
    """The last round an unfinished run of this same config checkpointed (the comparison resumes it there rather
    than train those rounds again); None without a readable checkpoint, for another config's, or when the
    checkpoint already covers every round (that run failed at its end: it runs again from the start)."""
    from fedapps import checkpoint
    from fedapps.config import dump_yaml

    if not (result_dir / checkpoint.CHECKPOINT).is_file():
        return None
    try:
        saved = checkpoint.load_checkpoint(result_dir)
        checkpoint.check_same_config(str(saved["config"]), dump_yaml(resolved), result_dir)
        done = int(saved["round"])
    except Exception:  # noqa: BLE001 - unreadable, truncated or foreign: the run starts over, as it did before
        return None
    return done if done < resolved.rounds else None


def plan_run(result_dir: Path, cfg: ExperimentConfig) -> tuple[bool, int | None, str]:
    """(skip?, resume after round, why) for the run of ``cfg`` in ``result_dir``: skipped when complete with the same
    config (:func:`resume_decision`), else resumed after its checkpointed round (:func:`checkpointed_round`), else
    (None) run from the start."""
    from strategies import resolve  # local: tools sit above the strategies; this module stays light

    resolved = resolve(cfg).config(cfg)
    skip, why = resume_decision(result_dir, cfg.rounds, config_hash(resolved))
    after = None if skip else checkpointed_round(result_dir, resolved)
    if after is not None:
        why = f"resuming after round {after} (its checkpoint; delete {result_dir} to start over)"
    return skip, after, why


def make_run(
    execute: Callable[..., Path],
    config: str,
    overrides: list[str],
    result_dir: Path,
    after: int | None,
    args: argparse.Namespace,
) -> None:
    """The run :func:`plan_run` decided on: resumed from its checkpoint, or from the start in an emptied folder."""
    if after is not None:
        execute(
            config, overrides, str(result_dir.parent), argparse.Namespace(**{**vars(args), "resume": str(result_dir)})
        )
    else:
        clear_for_rerun(result_dir)
        execute(config, overrides, str(result_dir.parent), args)


def clear_for_rerun(result_dir: Path) -> None:
    """The folder of a run this tool decided to run again (:func:`resume_decision`) is emptied first: a new run
    never writes into a used folder (`fedapps run` refuses one), and the earlier run's files would mix with it."""
    import shutil

    if result_dir.is_dir():
        shutil.rmtree(result_dir)


# summary.json entries averaged over seeds into comparison.csv (each with its ``_sem``), in column order
SUMMARISED = (
    "accuracy_mean",
    "accuracy_weighted",
    "accuracy_worst10",
    "accuracy_std",
    "accuracy_after_training_mean",
    "accuracy_after_training_worst10",
    "accuracy_after_training_std",
    "bytes_up_per_client_round",
    "bytes_down_per_client_round",
    "wall_seconds",
)


def summarise_runs(
    label: str, summaries: list[dict[str, Any]], setting: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One table row: mean ± SEM over seeds of the final accuracies (mean over clients, sample-weighted, worst
    10 % of clients, std over clients; deployed and after local training), bytes and wall time. A value no run
    recorded (a run made before the fairness columns existed) is NaN."""
    row: dict[str, Any] = {"config": label, "strategy": summaries[0]["strategy"], **(setting or {})}
    row["seeds"] = len(summaries)
    for key in SUMMARISED:
        vals = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        m, e = mean_sem(vals)
        row[key] = m
        row[key + "_sem"] = e
    extra_keys = sorted(
        {k for s in summaries for k in s if k.startswith("final_") and k.endswith("_acc_mean")}
        | ({"clusters"} & {k for s in summaries for k in s})
    )
    for key in extra_keys:
        vals = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        if vals:
            row[key], row[key + "_sem"] = mean_sem(vals)
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """comparison.md: accuracy ± SEM (the deployed models after the last round: mean over clients,
    sample-weighted, worst 10 % of clients, std over clients; the models right after local training beside it),
    bytes per client per round (MiB), wall time."""
    lines = [
        (
            "Protocol: deployed model after the last round (docs/evaluation.md), on each client's own evaluation "
            "split; mean ± SEM over seeds (a row of 1 seed: its value alone). Worst 10 %: the mean accuracy of the "
            "worst ceil(10 % of n) of the n clients; std: the population standard deviation over clients."
        ),
        "",
        (
            "| config | strategy | setting | seeds | accuracy (mean over clients) | accuracy (sample-weighted) | "
            "worst 10 % of clients | std over clients | "
            "after local training (mean) | up MiB/client/round | down MiB/client/round | wall s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 1024 * 1024
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['strategy']} | {setting_text(r)} | {r['seeds']} | "
            f"{_pm(r, 'accuracy_mean')} | {_pm(r, 'accuracy_weighted')} | "
            f"{_pm(r, 'accuracy_worst10')} | {_pm(r, 'accuracy_std')} | "
            f"{_pm(r, 'accuracy_after_training_mean')} | "
            f"{r['bytes_up_per_client_round'] / mib:.3f} | {r['bytes_down_per_client_round'] / mib:.3f} | "
            f"{r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _pm(row: dict[str, Any], key: str) -> str:
    """'mean ± sem' of a table cell, the mean alone for a row of one seed (its seeds column says 1: no spread to
    show), or '-' where no run had the value."""
    m = row.get(key)
    if not isinstance(m, float) or math.isnan(m):
        return "-"
    return f"{m:.4f}" if row.get("seeds", 2) == 1 else f"{m:.4f} ± {row[key + '_sem']:.4f}"


@dataclasses.dataclass
class Line:
    """One config's runs in the comparison plot: its strategy, setting (:func:`setting_label`), table label
    (config stem) and each seed's rounds.csv rows."""

    method: str
    setting: str
    config: str
    runs: list[list[dict[str, Any]]]


def _measured(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) else None


def per_round_mean_sem(runs: list[list[dict[str, Any]]], key: str) -> tuple[list[int], list[float], list[float]]:
    """(rounds, mean, SEM) over the seeds' runs of rounds.csv column ``key``, at every round any run measured."""
    rounds = sorted({int(r["round"]) for run in runs for r in run if _measured(r, key) is not None})
    means, sems = [], []
    for rnd in rounds:
        m, e = mean_sem(
            [v for run in runs for r in run if int(r["round"]) == rnd for v in [_measured(r, key)] if v is not None]
        )
        means.append(m)
        sems.append(e)
    return rounds, means, sems


def comparison_curves(lines: list[Line]) -> list[plots.Curve]:
    """The plot's curves: per line, the deployed models' accuracy (mean over clients; worst 10 % of clients)
    as mean ± SEM over seeds per round, labelled by :func:`fedapps.reporting.plots.legend_labels`."""
    labels = plots.legend_labels([(ln.method, ln.setting, ln.config) for ln in lines])
    out = []
    for ln, label in zip(lines, labels):
        rounds, mean, sem = per_round_mean_sem(ln.runs, "acc_mean")
        worst_rounds, worst, worst_sem = per_round_mean_sem(ln.runs, "acc_worst10")
        out.append(plots.Curve(label, ln.method, rounds, mean, sem, worst_rounds, worst, worst_sem))
    return out


def plot_curves(lines: list[Line], path: Path) -> None:
    """comparison.png: every config's curves (:func:`comparison_curves`) in the project's plot style."""
    plots.plot_comparison(comparison_curves(lines), path)


FORMER_DEFAULT_ROOT = "results"  # compare's results root before it followed the configs' output_dir


def comparison_root(output_dir: str | None, configs: Sequence[ExperimentConfig], name: str) -> Path:
    """The results root: ``--output-dir``, else the configs' ``output_dir`` (as `fedapps run` and `tune`); configs
    that name different ones need --output-dir. An earlier comparison of this name under the former default root
    (./results, whatever the configs said) is not left behind silently: ConfigError naming both places."""
    if output_dir:
        return resolve_root(output_dir, "")
    roots = sorted({resolve_root(None, c.output_dir) for c in configs})
    if len(roots) > 1:
        raise ConfigError(
            f"compare: the configs name different output_dir ({', '.join(map(str, roots))}); pass "
            "--output-dir DIR for the comparison's results root"
        )
    root = roots[0]
    former = resolve_root(FORMER_DEFAULT_ROOT, "") / name
    if root != former.parent and ((former / "comparison.csv").is_file() or (former / "runs").is_dir()):
        raise ConfigError(
            f"compare writes under the configs' output_dir, here {root / name} (as run and tune do), "
            f"but an earlier comparison '{name}' is in {former} (the former default, ./results); "
            f"to continue that one pass --output-dir {former.parent}, or --name another name"
        )
    return root


def compare(args: argparse.Namespace, execute: Callable[..., Path]) -> Path:
    """Run every config × seed (resuming), then write the table and the plot; returns the table folder."""
    labels = [run_label(c) for c in args.configs]
    if len(set(labels)) != len(labels):
        raise ConfigError("compare: two configs share a file name; rename one (the name labels the table row)")
    from fedapps.data import get_federation
    from strategies import report_ignored, resolve  # local: tools sit above the strategies; this module stays light

    seeds = parse_seeds(args.seeds)
    checked_configs = []
    for config in args.configs:  # every config's strategy, params and data checked before the first run starts
        checked = load_config(Path(config).expanduser().resolve(), list(args.overrides))
        resolve(checked)
        report_ignored(checked, list(args.overrides))
        get_federation(dataclasses.asdict(checked.data))  # a DataError (a ConfigError) here: exit 2
        checked_configs.append(checked)
    check_same_setting(checked_configs, labels, getattr(args, "allow_mixed", False))
    folder = comparison_root(args.output_dir, checked_configs, args.name) / args.name
    runs_dir = folder / "runs"
    rows, lines = [], []
    progress = RunProgress(len(args.configs) * len(seeds))
    for config, label in zip(args.configs, labels):
        summaries, label_curves = [], []
        for seed in seeds:
            overrides = list(args.overrides) + [f"seed={seed}", f"run_name={label}-s{seed}"]
            cfg = load_config(Path(config).expanduser().resolve(), overrides)
            result_dir = runs_dir / cfg.resolved_run_name()
            skip, after, why = plan_run(result_dir, cfg)
            progress.start(f"{label} seed {seed}: {why}")
            if not skip:
                make_run(execute, config, overrides, result_dir, after, args)
            progress.finish(worked=not skip)
            summaries.append(json.loads((result_dir / "summary.json").read_text()))
            label_curves.append(read_csv(result_dir / "rounds.csv"))
        rows.append(summarise_runs(label, summaries, setting_columns(cfg)))
        lines.append(
            Line(str(summaries[0].get("strategy", cfg.strategy.name)), setting_label(cfg), label, label_curves)
        )
    progress.close()
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "comparison.csv", rows)  # header: the union of the rows' keys, first-seen order
    table = markdown_table(rows)
    (folder / "comparison.md").write_text(table)
    plot_curves(lines, folder / "comparison.png")
    print("\n" + table + f"\nwritten: {folder}/comparison.csv, comparison.md, comparison.png")
    return folder


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="run configs × seeds, then tabulate mean ± SEM",
        description="Run every config at every seed (runs already complete with the same config are "
        "skipped), then write comparison.csv, comparison.md and comparison.png.",
    )
    p.add_argument(
        "configs",
        nargs="+",
        metavar="CONFIG",
        help="YAML files, one row of the table each (e.g. configs/fedavg.yaml configs/local.yaml)",
    )
    add_seeds_option(p, [0, 1, 2], "the seeds every config runs at")
    p.add_argument(
        "--name", default="comparison", help="the comparison's folder under --output-dir (default: comparison)"
    )
    p.add_argument(
        "--allow-mixed",
        action="store_true",
        help="tabulate configs that differ in more than the strategy and its parameters (data, model, rounds, "
        "privacy); default: refuse before any run, naming the keys",
    )
    add_run_options(p, "DIR/<name>/: the table, the plot and the runs (runs/)")
    return p


def run(args: argparse.Namespace) -> int:
    from fedapps_tools import launch

    launch.start_logging(args)
    compare(args, launch.execute)
    return 0
