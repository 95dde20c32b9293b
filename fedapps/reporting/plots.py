"""The figures the result sinks, ``fedapps compare`` and ``fedapps report --html`` draw, in one style: accuracy
curves of a run, comparison curves of methods (mean ± SEM over seeds) against rounds and against traffic, the
spread of accuracy across clients, clients × classes heatmaps, cluster assignments.

Pure drawing from data a strategy or the round loop returned. The one thing here that names algorithms is the
style table (:data:`METHOD_ORDER`): every method has a fixed (colour, line style) pair, the same in every plot,
and no two of the project's methods share both (a test checks it for every registered strategy: one the table does
not list takes a free slot from its name).
Round axes carry integer ticks only. Every ``*_figure`` function returns the matplotlib Figure (tests inspect
it); ``plot_*`` draws it into a file.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# matplotlib's "tab10" palette (colour-blind-friendlier than the old default), as hex so no import is needed here
COLOURS: tuple[str, ...] = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
LINESTYLES: tuple[str, ...] = ("-", "--", ":", "-.")
STYLE_SLOTS = len(COLOURS) * len(LINESTYLES)  # 40 distinct (colour, line style) pairs
# The fixed style of each of the project's methods: its position here is its slot; slot i is colour i mod 10 and
# line style i div 10, so the first ten differ by colour alone. A new strategy may be appended at the end (a test
# asks where its name's free slot meets another's).
METHOD_ORDER: tuple[str, ...] = (
    "fedavg",
    "local",
    "cwfedavg",
    "cosmos",
    "fedprox",
    "ditto",
    "fedamp",
    "ifca",
    "cfl",
    "fedfomo",
    "fedper",
    "fedrep",
    "fedbabu",
    "fedmd",
    "fedct",
    "comet",
    "feduv",
    "fednh",
    "pfedhn",
    "fedselect",
    "pfedck",
)
DPI = 110


def style_of_slot(slot: int) -> dict[str, str]:
    """The (colour, line style) pair of palette slot ``slot`` (mod :data:`STYLE_SLOTS`), as plot keyword args."""
    slot %= STYLE_SLOTS
    return {"color": COLOURS[slot % len(COLOURS)], "linestyle": LINESTYLES[slot // len(COLOURS)]}


def method_slot(name: str) -> int:
    """A method's fixed palette slot: its position in :data:`METHOD_ORDER`; any other name a slot among those
    the table leaves free, from a CRC-32 of the name (the same in every process and plot; two such names may
    share one, which :func:`line_styles` separates within a plot)."""
    if name in METHOD_ORDER:
        return METHOD_ORDER.index(name)
    free = STYLE_SLOTS - len(METHOD_ORDER)
    return len(METHOD_ORDER) + zlib.crc32(name.encode("utf-8")) % free


def method_style(name: str) -> dict[str, str]:
    """The style of method (strategy) ``name`` in every plot: ``{"color": ..., "linestyle": ...}``."""
    return style_of_slot(method_slot(name))


def line_styles(methods: Sequence[str]) -> list[dict[str, str]]:
    """The styles of one plot's lines, line i showing method ``methods[i]``: each method its own
    :func:`method_style`; a line whose pair another line already holds (the same method twice, e.g. in two
    settings, or two unlisted names on one slot) takes the next free pair — the same colour first, and not a
    pair of another :data:`METHOD_ORDER` method while any other is free. Distinct pairs for up to
    :data:`STYLE_SLOTS` lines."""
    taken: set[int] = set()
    slots: list[int | None] = []
    for name in methods:  # first pass: every line that can have its method's own slot gets it
        own = method_slot(name)
        slots.append(None if own in taken else own)
        if own not in taken:
            taken.add(own)
    for i, name in enumerate(methods):
        if slots[i] is not None:
            continue
        own = method_slot(name)
        same_colour = [own % len(COLOURS) + len(COLOURS) * k for k in range(len(LINESTYLES))]
        candidates = same_colour + [(own + k) % STYLE_SLOTS for k in range(STYLE_SLOTS)]
        listed = range(len(METHOD_ORDER))  # another listed method's own pair: borrowed only when nothing else is free
        slot = next(
            (c for c in candidates if c not in taken and c not in listed),
            next((c for c in candidates if c not in taken), own),
        )
        taken.add(slot)
        slots[i] = slot
    filled = [s for s in slots if s is not None]
    assert len(filled) == len(slots)  # the second pass gave every line without its own slot a free one
    return [style_of_slot(s) for s in filled]


def legend_labels(lines: Sequence[tuple[str, str, str]]) -> list[str]:
    """Legend labels of one plot's lines, each given as (method, setting, fallback id — e.g. a config's file stem):
    the method's name; ``method (setting)`` on every line when the plot mixes settings; the fallback id added
    where two lines would still read the same (alone where it already names the method: ``cwfedavg`` and
    ``cwfedavg (paper's setting)``, not ``cwfedavg (cwfedavg)``). A fallback that reads as a variant of its method
    (``fedavg (cwFedAvg paper's setting, 300 rounds)``, ``cosmos, centred by architecture``: tables labels) is the
    label even on a line of its own, so that a variant is never shown under its bare method's name."""
    mixed = len({setting for _, setting, _ in lines}) > 1
    labels = [f"{m} ({setting})" if mixed else m for m, setting, _ in lines]
    out = []
    for label, (m, setting, fallback) in zip(labels, lines):
        variant = fallback.startswith((f"{m} (", f"{m}, "))  # "cosmos (…)", "cosmos, centred …": a label of the method
        if not mixed and variant:
            label = fallback
        elif labels.count(label) > 1:
            if mixed:
                label = f"{m} ({setting}; {fallback})"
            elif fallback == m or variant:
                label = fallback
            else:
                label = f"{m} ({fallback})"
        out.append(label)
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed; safe in Ray workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def round_axis(ax: Any, label: str = "round") -> None:
    """An x axis of rounds: labelled, integer ticks only (no round 1.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save(fig: Any, path: Path) -> None:
    """Write a figure (every plot at the same resolution, nothing cut off) and free it."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    _pyplot().close(fig)


def png_bytes(fig: Any) -> bytes:
    """A figure as PNG bytes, at the resolution and cropping of :func:`save`, and freed: for embedding in a page."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def _legend(ax: Any, entries: int) -> None:
    """A legend beside the axes once there are many lines (it would hide curves inside), inside otherwise."""
    if entries > 6:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=8)


def _points(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[Any, float]]:
    return [
        (r["round"], float(r[key]))
        for r in rows
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and not math.isnan(float(r[key]))
    ]


# one run's curves: (rounds.csv column, legend label, line style); all in the run's method colour but the
# other evaluations', which take the palette's next colours
RUN_SERIES: tuple[tuple[str, str, str], ...] = (
    ("acc_mean", "deployed model (mean over clients)", "-"),
    ("acc_weighted", "deployed model (sample-weighted)", "--"),
    ("acc_worst10", "deployed model (worst 10 % of clients)", "-."),
    ("acc_after_training_mean", "after local training (mean over clients)", ":"),
)


def accuracy_figure(rows: Sequence[Mapping[str, Any]], title: str = "", method: str = "") -> Any:
    """A run's accuracy against rounds: the deployed models (mean over clients, sample-weighted, worst 10 % of
    clients), the models right after local training, plus any other evaluation (mean over clients); drawn in
    ``method``'s colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colour = method_style(method)["color"] if method else COLOURS[0]
    others = sorted({k for r in rows for k in r if k.endswith("_acc_mean") and k != "acc_mean"})
    spare = [c for c in COLOURS if c != colour]
    series = [(key, label, {"color": colour, "linestyle": ls}) for key, label, ls in RUN_SERIES]
    series += [
        (
            key,
            f"{key[: -len('_acc_mean')]} evaluation (mean over clients)",
            {"color": spare[i % len(spare)], "linestyle": "-"},
        )
        for i, key in enumerate(others)
    ]
    drawn = 0
    for key, label, style in series:
        pts = _points(rows, key)
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=label, **style)
            drawn += 1
    round_axis(ax, "round (the models after it)")
    ax.set_ylabel("accuracy on the clients' own evaluation splits")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if drawn:
        _legend(ax, drawn)
    ax.set_title(f"{title} ({method})" if method and method not in title else title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_accuracy(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "", method: str = "") -> None:
    """:func:`accuracy_figure` into ``path``."""
    save(accuracy_figure(rows, title, method), path)


@dataclass
class Curve:
    """One method's line in a comparison: per round, the mean over seeds and its SEM, of the deployed models'
    accuracy as mean over clients (``mean``/``sem``) and, where measured, of the worst 10 % of clients
    (``worst``/``worst_sem``, aligned with ``worst_rounds``)."""

    label: str
    method: str
    rounds: list[int]
    mean: list[float]
    sem: list[float]
    worst_rounds: list[int] = field(default_factory=list)
    worst: list[float] = field(default_factory=list)
    worst_sem: list[float] = field(default_factory=list)


def accuracy_limits(values: Sequence[float], step: float = 0.05) -> tuple[float, float]:
    """y-limits of an accuracy panel: from the lowest value (less a small margin, down to a multiple of ``step``,
    never below 0) to 1 — methods that end within a few points of each other stay apart on the page."""
    finite = [float(v) for v in values if math.isfinite(float(v))]
    if not finite:
        return 0.0, 1.0
    low = math.floor((min(finite) - step / 2) / step) * step
    return max(0.0, round(low, 10)), 1.0


def comparison_figure(curves: Sequence[Curve]) -> Any:
    """Methods against rounds, mean ± SEM band over seeds: the deployed models' accuracy as mean over clients
    (left) and, when the runs measured it, over the worst 10 % of clients (right); one style per method
    (:func:`line_styles`), one legend."""
    plt = _pyplot()
    curves = [c for c in curves if c.rounds]
    worst = any(c.worst_rounds for c in curves)
    fig, axes = plt.subplots(1, 2 if worst else 1, figsize=(12, 4.5) if worst else (7.5, 4.5), squeeze=False)
    panels = [(axes[0][0], "mean over clients", lambda c: (c.rounds, c.mean, c.sem))]
    if worst:
        panels.append((axes[0][1], "worst 10 % of clients", lambda c: (c.worst_rounds, c.worst, c.worst_sem)))
    styles = line_styles([c.method for c in curves])
    for ax, what, pick in panels:
        for c, style in zip(curves, styles):
            rounds, mean, sem = pick(c)
            if not rounds:
                continue
            ax.plot(rounds, mean, label=c.label, **style)
            ax.fill_between(
                rounds,
                [m - e for m, e in zip(mean, sem)],
                [m + e for m, e in zip(mean, sem)],
                color=style["color"],
                alpha=0.15,
                linewidth=0,
            )
        round_axis(ax)
        ax.set_ylabel(f"deployed-model accuracy, {what}\n(mean ± SEM over seeds)")
        ax.set_ylim(*accuracy_limits([m - e for c in curves for m, e in zip(pick(c)[1], pick(c)[2])]))
        ax.grid(alpha=0.3)
    if curves:  # many lines: beside the last panel; a few: inside the first
        _legend(panels[-1][0] if len(curves) > 6 else panels[0][0], len(curves))
    fig.tight_layout()
    return fig


def plot_comparison(curves: Sequence[Curve], path: Path) -> None:
    """:func:`comparison_figure` into ``path``."""
    save(comparison_figure(curves), path)


MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def epsilon_ticks(lo: float, hi: float) -> list[float]:
    """The 1-2-5 values (…, 1, 2, 5, 10, 20, …) between ``lo`` and ``hi`` on a log ε axis, at least ``lo`` rounded
    down to one such value when none lies between (a single ε)."""
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise ValueError(f"epsilon_ticks: need 0 < lo <= hi < inf, got {lo}, {hi}")
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1) for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    return inside or [max(t for t in ticks if t <= lo)]


def privacy_curves_figure(rows: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """Accuracy against ε (``fedapps privacy-curves``): per method (``rows``' ``method``/``label``), its private
    points (finite ``epsilon_mean``, with ``accuracy_mean`` ± ``accuracy_mean_sem`` over seeds) joined in order of ε
    on a log axis, in the method's own style (:func:`line_styles`) and a marker of its own; its non-private accuracy
    (ε = ∞) is the same marker, hollow, at the "no DP" tick right of the largest ε, past a dotted separator."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    methods = list(dict.fromkeys(str(r["method"]) for r in rows))

    def is_private(r: Mapping[str, Any]) -> bool:  # a finite ε; the non-private reference has ε = ∞
        return math.isfinite(float(r["epsilon_mean"]))

    finite = [float(r["epsilon_mean"]) for r in rows if is_private(r)]
    lo, hi = (min(finite), max(finite)) if finite else (1.0, 1.0)
    no_dp = hi * 2.5  # where ε = ∞ is drawn
    for i, (name, style) in enumerate(zip(methods, line_styles(methods))):
        mine = [r for r in rows if r["method"] == name]
        label = str(mine[0].get("label") or name)
        marker = MARKERS[i % len(MARKERS)]
        private = sorted((r for r in mine if is_private(r)), key=lambda r: float(r["epsilon_mean"]))
        if private:
            ax.errorbar(
                [float(r["epsilon_mean"]) for r in private],
                [float(r["accuracy_mean"]) for r in private],
                yerr=[float(r["accuracy_mean_sem"]) for r in private],
                marker=marker,
                capsize=3,
                label=label,
                **style,
            )
        for reference in [r for r in mine if not is_private(r)]:
            ax.errorbar(
                [no_dp],
                [float(reference["accuracy_mean"])],
                yerr=[float(reference["accuracy_mean_sem"])],
                marker=marker,
                fillstyle="none",
                markersize=8,
                linestyle="none",
                capsize=3,
                color=style["color"],
                label=None if private else label,
            )
    ax.set_xscale("log")
    ticks = [*epsilon_ticks(lo / 1.4, hi), no_dp]  # the values the visible range shows
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["no DP"])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.axvline(math.sqrt(hi * no_dp), color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlim(lo / 1.4, no_dp * 1.4)
    ax.set_xlabel("ε (largest over clients; δ as in the spec)")
    ax.set_ylabel("deployed-model accuracy, mean over clients\n(mean ± SEM over seeds)")
    note = "hollow marker at 'no DP': the same method without privacy"
    ax.set_title(title + ("\n" if title else "") + note, fontsize=9)
    ax.grid(alpha=0.3, which="major")
    _legend(ax, len(methods))
    fig.tight_layout()
    return fig


def plot_privacy_curves(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> None:
    """:func:`privacy_curves_figure` into ``path``."""
    save(privacy_curves_figure(rows, title), path)


def traffic_figure(curves: Sequence[Curve], megabytes: Sequence[Sequence[float]], over_seeds: bool = True) -> Any:
    """The deployed models' accuracy (mean over clients; mean ± SEM band over seeds) against the traffic spent:
    curve i's point j sits at ``megabytes[i][j]``, the cumulative traffic up to and including round
    ``curves[i].rounds[j]``; one style per method (:func:`line_styles`). The x axis is logarithmic when the
    traffic spans more than two decades (a method sending pseudo-labels next to one sending models), linear near 0.
    ``over_seeds=False``: the curves are single runs (the y label says no mean over seeds)."""
    plt = _pyplot()
    pairs = [(c, list(mb)) for c, mb in zip(curves, megabytes) if c.rounds]
    for c, mb in pairs:
        if len(mb) != len(c.rounds):
            raise ValueError(f"traffic_figure: {c.label} has {len(c.rounds)} rounds but {len(mb)} traffic values")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = line_styles([c.method for c, _ in pairs])
    for (c, mb), style in zip(pairs, styles):
        ax.plot(mb, c.mean, marker="o", markersize=3, label=c.label, **style)
        ax.fill_between(
            mb,
            [m - e for m, e in zip(c.mean, c.sem)],
            [m + e for m, e in zip(c.mean, c.sem)],
            color=style["color"],
            alpha=0.15,
            linewidth=0,
        )
    positive = [x for _, mb in pairs for x in mb if x > 0]
    if positive and max(positive) > 100 * min(positive):
        if len(positive) < sum(len(mb) for _, mb in pairs):
            ax.set_xscale("symlog", linthresh=min(positive))
        else:
            ax.set_xscale("log")
    ax.set_xlabel("cumulative traffic, all clients, up + down (MB = 10⁶ bytes)")
    ax.set_ylabel("deployed-model accuracy, mean over clients" + ("\n(mean ± SEM over seeds)" if over_seeds else ""))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if pairs:
        _legend(ax, len(pairs))
    fig.tight_layout()
    return fig


def client_accuracy_figure(groups: Sequence[tuple[str, str, Sequence[float]]]) -> Any:
    """The spread of accuracy across clients, per (label, method, per-client accuracies): a box (quartiles,
    median, whiskers to the furthest value within 1.5 IQR) with every client beside it as a dot in the method's
    colour (:func:`line_styles`), so a few badly served clients stand out; y from 0 to 1."""
    plt = _pyplot()
    groups = [(label, method, [float(v) for v in values]) for label, method, values in groups]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(groups) + 2.5), 4.5))
    styles = line_styles([method for _, method, _ in groups])
    rng = np.random.default_rng(0)  # the dots' horizontal jitter: the same picture every time
    for i, ((_, _, values), style) in enumerate(zip(groups, styles)):
        if not values:
            continue
        ax.boxplot(
            [values],
            positions=[i],
            widths=0.45,
            showfliers=False,
            medianprops={"color": style["color"], "linewidth": 2},
            boxprops={"color": "0.35"},
            whiskerprops={"color": "0.35"},
            capprops={"color": "0.35"},
        )
        ax.scatter(
            i + 0.32 + rng.uniform(-0.06, 0.06, len(values)),
            values,
            s=14,
            color=style["color"],
            alpha=0.75,
            linewidths=0,
            zorder=3,
        )
    ax.set_xticks(
        range(len(groups)),
        [label for label, _, _ in groups],
        rotation=20 if len(groups) > 4 else 0,
        ha="right" if len(groups) > 4 else "center",
        fontsize=8,
    )
    ax.set_xlim(-0.6, len(groups) - 0.2)
    ax.set_ylabel("deployed-model accuracy of each client\n(after the last round)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def plot_heatmaps(panels: list[tuple[str, list[int], np.ndarray]], path: Path) -> None:
    """Side-by-side heatmaps, one per (title, row labels, rows × columns matrix), rows labelled by client id."""
    plt = _pyplot()
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
    save(fig, path)


def plot_clusters(
    cluster_of: Mapping[int, int],
    groups: Sequence[int] | None,
    distances: np.ndarray | None,
    distance_clients: list[int],
    path: Path,
    title: str,
) -> None:
    """Left: clients × (true group, found cluster); right: the per-sample distance matrix ordered by group."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    ids = sorted(cluster_of)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    found = [cluster_of[i] for i in ids]
    ax.scatter(ids, found, c=found, cmap="tab10", s=60, marker="s", label="found cluster")
    if groups is not None:
        ax.scatter(ids, [int(groups[i]) for i in ids], facecolors="none", edgecolors="k", s=110, label="true group")
    ax.set_xlabel("client id")
    ax.set_ylabel("found cluster (filled) / true group (ring)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
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
    save(fig, path)
