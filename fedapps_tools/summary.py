"""The end-of-run summary of `fedapps run` and `fedapps report RUN_DIR`: a run's summary.json for a person.

The headline, the deployed models' accuracy after the last measured round (mean over clients and sample-weighted),
is marked as such; fairness, the after-training accuracy, the strategy's own numbers, traffic and time follow in
human units (summary.json itself keeps the raw numbers). Beside a personalised run, FedAvg's number on the same
setting when such a run is on disk, else the overrides that make one: built and validated before they are shown.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from fedapps.config import ConfigError, ExperimentConfig, load_config
from fedapps.reporting.results import format_duration
from fedapps_tools import runnames

RULE = "-" * 78
MARK = ">>"  # the headline's lines start with it
# summary.json keys that start with "final_" but are bookkeeping of the final round, not a strategy's number
FINAL_BOOKKEEPING = ("final_round", "final_round_had_no_replies", "final_round_measured_clients")


def human_bytes(n: float) -> str:
    """Bytes in binary units: '950 B', '216.5 KiB', '2.2 MiB', '1.0 GiB' (one decimal below 100, none above)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"
            return f"{value:.1f} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """A duration as a person reads it: '2.5 s', '29 s', '1 min 29 s', '2 h 05 min'."""
    return format_duration(seconds, words=True)


def _acc(value: Any) -> str:
    """An accuracy with 4 decimals, or 'none' where the run measured none."""
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "none"


def strategy_numbers(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The strategy's own final numbers in summary.json (``final_*`` metrics, ``clusters``), in key order."""
    keys = sorted(k for k in summary if (k.startswith("final_") and k not in FINAL_BOOKKEEPING) or k == "clusters")
    return [(k, summary[k]) for k in keys if isinstance(summary[k], (int, float)) and not isinstance(summary[k], bool)]


def summary_lines(s: dict[str, Any], result_dir: Path) -> list[str]:
    """The summary of one run (its summary.json ``s``) as printed lines; the headline's lines start with MARK."""
    rounds = s.get("rounds")
    split = s.get("evaluated_on", "test")
    final = s.get("final_round")
    lines = [
        RULE,
        (
            f"{s.get('strategy')} on {s.get('dataset')} / {s.get('partition')}, model {s.get('model')}, "
            f"{s.get('num_clients')} clients, {rounds} round{'s' if rounds != 1 else ''}, seed {s.get('seed', '?')}"
        ),
    ]
    if s.get("deployed_model"):
        lines.append(f"deployed model: {s['deployed_model']}")
    measured = s.get("final_round_measured_clients")
    of = f", {measured} of {s.get('num_clients')} clients measured" if measured is not None else ""
    lines += [
        "",
        f"{MARK} HEADLINE: {split} accuracy of the deployed models after round {final}{of}",
        f"{MARK}   {_acc(s.get('accuracy_mean'))}  mean over clients   (accuracy_mean)",
        f"{MARK}   {_acc(s.get('accuracy_weighted'))}  sample-weighted     (accuracy_weighted)",
    ]
    if split == "validation":
        lines.append(f"{MARK}   (a tuning run: validation-split numbers, not test results)")
    lines.append("")
    rows: list[tuple[str, str]] = [
        (
            "fairness",
            (
                f"worst 10 % of clients {_acc(s.get('accuracy_worst10'))} (accuracy_worst10), "
                f"std over clients {_acc(s.get('accuracy_std'))} (accuracy_std)"
            ),
        ),
        (
            "not deployed",
            (
                f"right after local training {_acc(s.get('accuracy_after_training_mean'))} "
                "(accuracy_after_training_mean)"
            ),
        ),
    ]
    extra = strategy_numbers(s)
    if extra:
        rows.append(
            (
                str(s.get("strategy")),
                ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in extra),
            )
        )
    if isinstance(s.get("privacy"), dict):
        rows.append(("privacy", privacy_line(s["privacy"])))
    up, down = s.get("bytes_up_per_client_round"), s.get("bytes_down_per_client_round")
    if isinstance(up, (int, float)) and isinstance(down, (int, float)):
        rows.append(("traffic", f"up {human_bytes(up)}/client/round, down {human_bytes(down)}/client/round"))
    if isinstance(s.get("wall_seconds"), (int, float)):
        rows.append(("wall time", human_duration(s["wall_seconds"])))
    rows.append(("results", str(result_dir)))
    rows += config_digest_row(result_dir)
    lines += [f"   {label:<13} {text}" for label, text in rows]
    lines += [f"   {'attention':<13} {text}" for text in attention(s)]
    lines.append(RULE)
    return lines


def config_digest_row(result_dir: Path) -> list[tuple[str, str]]:
    """The digest of the run's config, as its folder name carries it (`fedapps run` derives the name from it)."""
    try:
        cfg = load_config(result_dir / "config.yaml")
    except (ConfigError, OSError):
        return []
    if not runnames.has_derived_name(cfg):
        return []
    return [("config", f"digest {runnames.digest(cfg)} (the folder's suffix: a run of another config gets another)")]


def privacy_line(p: dict[str, Any]) -> str:
    """summary.json's ``privacy`` in one line: the largest ε of a client at δ, and the mechanism's settings."""
    eps = p.get("epsilon_max")
    worst = f"ε ≤ {eps:.3g}" if isinstance(eps, (int, float)) else "no client reported ε"
    budget = f", budget ε {p['epsilon_budget']:g}" if p.get("epsilon_budget") else ""
    if p.get("mode") == "client":
        c = f"{p['clip_norm']:g}" if p.get("clip_norm") else "sqrt(rows)"
        return (
            f"client-level DP (the server's noise on the pseudo-label aggregates), {worst} at δ = "
            f"{p.get('delta'):g} (the largest over clients; σ {p.get('noise_multiplier'):g}, C {c}{budget})"
        )
    return (
        f"{p.get('mode')}-level DP, {worst} at δ = {p.get('delta'):g} (the largest over clients; σ "
        f"{p.get('noise_multiplier'):g}, C {p.get('max_grad_norm'):g}{budget})"
    )


def attention(s: dict[str, Any]) -> list[str]:
    """What makes the headline less than it seems: problems, skipped rounds, a last round without replies."""
    out = [str(p) for p in s.get("problems") or []]
    if s.get("skipped_rounds"):
        out.append(f"rounds {s['skipped_rounds']} were skipped (fewer usable replies than strategy.min_clients)")
    refused = (s.get("privacy") or {}).get("refused") if isinstance(s.get("privacy"), dict) else None
    if refused:
        out.append(
            f"{refused} training replies were refused past privacy.epsilon_budget (rejections.csv): those "
            "clients stopped training"
        )
    stopped = s.get("stopped_early")
    if isinstance(stopped, dict):
        out.append(f"the run ended after round {stopped.get('round')} of {stopped.get('of')}: {stopped.get('reason')}")
    if s.get("final_round_had_no_replies"):
        out.append(f"the last round got no usable reply: the headline is from round {s.get('final_round')}")
    return out


def print_summary(result_dir: Path) -> None:
    """The summary of a run folder's summary.json, then FedAvg's number beside a personalised run."""
    s = json.loads((result_dir / "summary.json").read_text())
    print("\n" + "\n".join(summary_lines(s, result_dir)))
    if s.get("strategy") != "fedavg":
        print(fedavg_reference(result_dir, s))


# --------------------------------------------------------------------------- FedAvg beside a personalised run


def fedavg_overrides(cfg: ExperimentConfig) -> list[str]:
    """The overrides that turn ``cfg`` (a run's resolved config) into FedAvg on the same setting (data, client
    training, rounds, seed) and whose run lands beside it under the name :func:`fedavg_twin_name` looks for.
    Model-agnostic configs run one architecture for every client (``model.name``): FedAvg averages one model. A run
    named by the user gets a FedAvg twin named like it would be derived; a derived name is derived again."""
    items = ["strategy.name=fedavg"]
    if cfg.model.per_client:
        items.append("model.per_client=[]")
    if cfg.run_name and not runnames.has_derived_name(cfg):
        items.append(f"run_name={fedavg_twin_name(cfg)}")
    return items


def fedavg_twin_name(cfg: ExperimentConfig) -> str:
    """The run folder of FedAvg on ``cfg``'s setting: the name `fedapps run` derives for the FedAvg config that
    :func:`fedavg_overrides` describes (strategy, data, seed and the digest of that resolved config)."""
    from strategies import resolve  # local: the tools reach the strategies only when needed

    target = dataclasses.replace(
        cfg,
        run_name="",
        strategy=dataclasses.replace(cfg.strategy, name="fedavg"),
        model=dataclasses.replace(cfg.model, per_client=[]) if cfg.model.per_client else cfg.model,
    )
    return runnames.derived_name(resolve(target).config(target))


def fedavg_config(config_path: Path, overrides: list[str]) -> ExperimentConfig:
    """The FedAvg config the hint describes, built from the run's config.yaml and checked as a run would be
    (ConfigError when it would not validate)."""
    from strategies import resolve  # local: the tools reach the strategies only when needed

    cfg = load_config(config_path, overrides)
    resolve(cfg)
    return cfg


def same_setting(a: ExperimentConfig, b: ExperimentConfig) -> bool:
    """Two configs compute on the same setting: data, model, client training, rounds and privacy."""
    return (a.data, a.model, a.client, a.rounds, a.privacy) == (b.data, b.model, b.client, b.rounds, b.privacy)


def fedavg_reference(result_dir: Path, summary: dict[str, Any]) -> str:
    """FedAvg's number beside a personalised run, from a FedAvg run of the same setting beside it on disk; else
    the command line that makes one, validated first."""
    config_path = result_dir / "config.yaml"
    try:
        cfg = load_config(config_path)
        hint = fedavg_overrides(cfg)
        target = fedavg_config(config_path, hint)
        twin = result_dir.parent / fedavg_twin_name(cfg)
    except ConfigError as exc:
        return f"FedAvg's number on the same setting: no valid FedAvg config follows from this run's ({exc})"
    if (twin / "config.yaml").is_file() and (twin / "summary.json").is_file():
        try:
            other = load_config(twin / "config.yaml")
        except ConfigError:
            other = None
        if other is not None and same_setting(other, target):
            ref = json.loads((twin / "summary.json").read_text())
            return (
                f"FedAvg on the same setting ({twin.name}): accuracy_mean {_acc(ref.get('accuracy_mean'))} "
                f"vs {summary.get('strategy')} {_acc(summary.get('accuracy_mean'))}"
            )
    args = " ".join(shlex.quote(item) for item in hint)
    again = "--overwrite " if twin.exists() else ""  # an unfinished FedAvg run of this config is in the way
    why = (
        f" (FedAvg averages one model: every client then runs model.name '{cfg.model.name}')"
        if cfg.model.per_client
        else ""
    )
    return (
        f"FedAvg's number on the same setting: add  {again}--set {args}  to the command{why} "
        f'(make run: ARGS="{again}--set {" ".join(hint)}"); it is then shown here.'
    )
