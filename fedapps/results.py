"""Results on disk: resolved config, partition statistics, rounds.csv (rewritten every round, so an
interrupted run keeps what it did), summary.json and accuracy.png, under ``<output-dir>/<run-name>/``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from fedapps.config import ExperimentConfig, dump_yaml

log = logging.getLogger("fedapps")

BASE_COLUMNS = ["round", "clients", "acc_mean", "acc_weighted", "loss", "train_loss", "bytes_up", "bytes_down",
                "eval_bytes_up", "eval_bytes_down", "wall_seconds"]


def accuracy_stats(metrics: Iterable[Mapping[str, Any]], tag: str) -> dict[str, float]:
    """Mean-over-clients and sample-weighted accuracy, and weighted loss, of evaluation ``tag``."""
    rows = [m for m in metrics if f"{tag}-acc" in m]
    if not rows:
        return {}
    n = sum(float(m[f"{tag}-n"]) for m in rows)
    correct = sum(float(m[f"{tag}-correct"]) for m in rows)
    return {
        "acc_mean": sum(float(m[f"{tag}-acc"]) for m in rows) / len(rows),
        "acc_weighted": correct / n if n else 0.0,
        "loss": sum(float(m[f"{tag}-loss"]) * float(m[f"{tag}-n"]) for m in rows) / n if n else 0.0,
    }


def eval_tags(metrics: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every evaluation tag present in the replies (keys '<tag>-acc')."""
    tags: list[str] = []
    for m in metrics:
        for k in m:
            if k.endswith("-acc") and k[:-4] not in tags:
                tags.append(k[:-4])
    return tags


def round_row(entry: Any, report_tag: str, num_clients: int) -> dict[str, Any]:
    """One row of rounds.csv from a RoundLog."""
    metrics = [r.metrics for r in entry.replies]
    row: dict[str, Any] = {
        "round": entry.round,
        "clients": len(entry.replies),
        "bytes_up": entry.bytes_up,
        "bytes_down": entry.bytes_down,
        "eval_bytes_up": entry.eval_bytes_up,
        "eval_bytes_down": entry.eval_bytes_down,
        "wall_seconds": round(entry.wall_seconds, 3),
    }
    row.update(accuracy_stats(metrics, report_tag))
    losses = [float(m["train-loss"]) for m in metrics if "train-loss" in m]
    row["train_loss"] = sum(losses) / len(losses) if losses else ""
    for tag in eval_tags(metrics):
        if tag != report_tag:
            for k, v in accuracy_stats(metrics, tag).items():
                if k != "loss":
                    row[f"{tag}_{k}"] = v
    for k, v in entry.extra.items():
        if isinstance(v, (int, float, str)):
            row[k] = v
    per_client = {int(r.client_id): r.metrics.get(f"{report_tag}-acc") for r in entry.replies}
    for i in range(num_clients):
        v = per_client.get(i)
        row[f"acc_client_{i}"] = "" if v is None else v
    return row


class RunRecorder:
    """Writes one run's results folder as the run goes."""

    def __init__(self, cfg: ExperimentConfig, output_dir: str | Path, report_tag: str = "eval") -> None:
        self.cfg = cfg
        self.report_tag = report_tag
        self.dir = Path(output_dir).expanduser().resolve() / cfg.resolved_run_name()
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "rounds.csv"):
            (self.dir / stale).unlink(missing_ok=True)
        (self.dir / "config.yaml").write_text(dump_yaml(cfg))
        self.rows: list[dict[str, Any]] = []
        self.total_wall = 0.0

    def write_partition(self, rows: list[Mapping[str, Any]]) -> None:
        """Samples per client per class (train and test) as partition.csv."""
        write_csv(self.dir / "partition.csv", rows)

    def on_round(self, entry: Any) -> None:
        """Append a round and rewrite rounds.csv; log a progress line."""
        row = round_row(entry, self.report_tag, self.cfg.data.num_clients)
        self.rows.append(row)
        write_csv(self.dir / "rounds.csv", self.rows)
        acc = row.get("acc_mean")
        log.info("round %d/%d  clients %d  acc_mean %s  acc_weighted %s  up %.2f MB  down %.2f MB  %.1f s",
                 entry.round, self.cfg.rounds, row["clients"], _fmt(acc), _fmt(row.get("acc_weighted")),
                 entry.bytes_up / 1e6, entry.bytes_down / 1e6, entry.wall_seconds)

    def finish(self, wall_seconds: float, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write summary.json and accuracy.png; return the summary."""
        summary = summarise(self.cfg, self.rows, wall_seconds)
        summary.update(extra or {})
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        try:
            plot_accuracy(self.rows, self.dir / "accuracy.png", title=self.cfg.resolved_run_name())
        except Exception as exc:  # a plot must never lose the results
            log.warning("could not draw accuracy.png: %s", exc)
        log.info("results written to %s", self.dir)
        return summary


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else "-"


def summarise(cfg: ExperimentConfig, rows: list[Mapping[str, Any]], wall_seconds: float) -> dict[str, Any]:
    """summary.json content: final-round accuracies, totals, and the best round as a labelled extra."""
    scored = [r for r in rows if isinstance(r.get("acc_mean"), float)]
    final = scored[-1] if scored else {}
    last = scored[-5:]
    clients = cfg.data.num_clients
    rounds = len(rows)
    up = sum(int(r["bytes_up"]) for r in rows)
    down = sum(int(r["bytes_down"]) for r in rows)
    summary: dict[str, Any] = {
        "run_name": cfg.resolved_run_name(),
        "strategy": cfg.strategy.name,
        "dataset": cfg.data.source,
        "partition": cfg.data.partition,
        "model": cfg.model.name if not cfg.model.per_client else "+".join(cfg.model.per_client),
        "num_clients": clients,
        "seed": cfg.seed,
        "rounds": rounds,
        "final_round": final.get("round"),
        "accuracy_mean": final.get("acc_mean"),
        "accuracy_weighted": final.get("acc_weighted"),
        "accuracy_mean_last5": sum(r["acc_mean"] for r in last) / len(last) if last else None,
        "bytes_up": up,
        "bytes_down": down,
        "eval_bytes_up": sum(int(r["eval_bytes_up"]) for r in rows),
        "eval_bytes_down": sum(int(r["eval_bytes_down"]) for r in rows),
        "bytes_up_per_client_round": up / max(1, sum(int(r["clients"]) for r in rows)),
        "bytes_down_per_client_round": down / max(1, sum(int(r["clients"]) for r in rows)),
        "wall_seconds": round(wall_seconds, 2),
    }
    for key in final:
        if key.endswith("_acc_mean") or key.endswith("_acc_weighted"):
            summary[f"final_{key}"] = final[key]
    if scored:
        best = max(scored, key=lambda r: r["acc_mean"])
        summary["best_round_on_test_set_NOT_the_result"] = {"round": best["round"], "accuracy_mean": best["acc_mean"]}
    return summary


def write_csv(path: Path, rows: list[Mapping[str, Any]]) -> None:
    """Rows with possibly different keys -> one CSV whose header is the union (in first-seen order)."""
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, restval="")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def read_csv(path: Path) -> list[dict[str, Any]]:
    """rounds.csv back as dicts with numbers parsed."""
    def parse(v: str) -> Any:
        if v == "":
            return None
        try:
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        except ValueError:
            return v
    with Path(path).open() as fh:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def plot_accuracy(rows: list[Mapping[str, Any]], path: Path, title: str = "") -> None:
    """Accuracy against rounds: mean over clients and sample-weighted, plus any other evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = ["acc_mean", "acc_weighted"] + sorted({k for r in rows for k in r if k.endswith("_acc_mean") and k != "acc_mean"})
    for key in keys:
        pts = [(r["round"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(float(r[key]))]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=key)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (clients' local test splits)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
