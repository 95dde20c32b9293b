"""The figures the result sinks draw: accuracy curves, clients × classes heatmaps, cluster assignments.

Pure drawing from data a strategy or the round loop returned; nothing here knows an algorithm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def plot_accuracy(rows: list[Mapping[str, Any]], path: Path, title: str = "") -> None:
    """Accuracy against rounds: the deployed models (mean over clients and sample-weighted), the models right
    after local training, plus any other evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"acc_mean": "deployed model (mean over clients)", "acc_weighted": "deployed model (sample-weighted)",
              "acc_after_training_mean": "after local training (mean over clients)"}
    keys = list(labels) + sorted({k for r in rows for k in r if k.endswith("_acc_mean") and k != "acc_mean"})
    for key in keys:
        pts = [(r["round"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(float(r[key]))]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=labels.get(key, key),
                    linestyle=":" if key == "acc_after_training_mean" else "-")
    ax.set_xlabel("round (the models after it)")
    ax.set_ylabel("accuracy on the clients' own evaluation splits")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmaps(panels: list[tuple[str, list[int], np.ndarray]], path: Path) -> None:
    """Side-by-side heatmaps, one per (title, row labels, rows × columns matrix), rows labelled by client id."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4.2), squeeze=False)
    for ax, (title, ids_k, mat) in zip(axes[0], panels):
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(np.nanmax(mat)), 1e-6))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(ids_k) <= 40:
            ax.set_yticks(range(len(ids_k)), [str(c) for c in ids_k], fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_clusters(cluster_of: Mapping[int, int], groups: Sequence[int] | None, distances: np.ndarray | None,
                  distance_clients: list[int], path: Path, title: str) -> None:
    """Left: clients × (true group, found cluster); right: the per-sample distance matrix ordered by group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (integer ticks)

    ids = sorted(cluster_of)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    found = [cluster_of[i] for i in ids]
    ax.scatter(ids, found, c=found, cmap="tab10", s=60, marker="s", label="found cluster")
    if groups is not None:
        ax.scatter(ids, [int(groups[i]) for i in ids], facecolors="none", edgecolors="k", s=110, label="true group")
    ax.set_xlabel("client id")
    ax.set_ylabel("found cluster (filled) / true group (ring)")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xticks(ids[:: max(1, len(ids) // 25)])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    if distances is not None and len(distance_clients):
        order = np.argsort([int(groups[c]) if groups is not None else 0 for c in distance_clients], kind="stable")
        im = ax.imshow(distances[np.ix_(order, order)], cmap="viridis")
        labels = [str(distance_clients[i]) for i in order]
        step = max(1, len(labels) // 25)
        ax.set_xticks(range(0, len(labels), step), labels[::step], fontsize=6, rotation=90)
        ax.set_yticks(range(0, len(labels), step), labels[::step], fontsize=6)
        ax.set_title("distance per public sample (ordered by true group)", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    else:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
