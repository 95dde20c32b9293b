"""Partitioners: pure functions from a label array and a numpy Generator to per-client index arrays.

`iid`, `pathological` ("pat") and `dirichlet` ("dir") follow PFLlib's procedures (used by the cwFedAvg paper);
`cosmos-groups` follows the COSMOS paper; `rotated` (IFCA paper) and `label-swap` (CFL paper) deal samples IID to
clients split into groups (their per-group transforms are in ``transforms``). Every partitioner returns disjoint, sorted
int64 index arrays, one per client, and is deterministic for the state of the generator it is given.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .errors import DataError

log = logging.getLogger("fedapps.data")

PARTITIONS: tuple[str, ...] = ("iid", "pathological", "dirichlet", "cosmos-groups", "rotated", "label-swap")
GROUP_TRANSFORM_PARTITIONS: tuple[str, ...] = ("rotated", "label-swap")  # IID samples, a transform per client group
# data keys that only some partitions read -> those partitions (every other data key is read whatever the partition)
PARTITION_KEYS: dict[str, tuple[str, ...]] = {
    "classes_per_client": ("pathological",),
    "alpha": ("dirichlet", "cosmos-groups"),
    "min_samples": ("dirichlet",),
    "groups": ("cosmos-groups", "rotated", "label-swap"),
    "redistribute_fraction": ("cosmos-groups",),
    "swap_pairs": ("label-swap",),
}


# ----------------------------------------------------------------------------------------- checks
def _as_labels(labels: np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise DataError(f"labels must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise DataError("labels must be non-negative class indices")
    return arr.astype(np.int64, copy=False)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"data.{name}={value!r} must be an integer")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in {low}..{high}"
        raise DataError(f"data.{name}={value!r} must be {allowed}")
    return int(value)


def _check_fraction(name: str, value: object, *, allow_one: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise DataError(f"data.{name}={value!r} must be a number in [0, 1{']' if allow_one else ')'}")
    v = float(value)
    if not (0.0 <= v <= 1.0) or (not allow_one and v >= 1.0):
        raise DataError(f"data.{name}={value!r} must be in [0, 1{']' if allow_one else ')'}")
    return v


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise DataError(f"data.alpha={alpha!r} must be a positive number")
    a = float(alpha)
    if not (a > 0.0 and math.isfinite(a)):
        raise DataError(f"data.alpha={alpha!r} must be a positive finite number (e.g. 0.1 or 5)")
    return a


def _check_classes(labels: np.ndarray, num_classes: int) -> None:
    if labels.size and labels.max() >= num_classes:
        raise DataError(f"labels go up to {int(labels.max())} but num_classes={num_classes}")


def _finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    """Concatenate (lists of pieces) and sort every client's indices as int64."""
    out = []
    for p in parts:
        if isinstance(p, list):
            p = np.concatenate(p) if p else np.zeros(0, dtype=np.int64)
        out.append(np.sort(np.asarray(p, dtype=np.int64)))
    return out


# ------------------------------------------------------------------------------------- helpers
def _apportion(quotas: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Integer counts summing to `total` closest to `quotas` (largest remainder, random tie-break)."""
    floors = np.floor(quotas).astype(np.int64)
    remaining = int(total - floors.sum())
    if remaining > 0:
        rema = quotas - floors
        order = rng.permutation(len(quotas))
        ranked = order[np.argsort(-rema[order], kind="stable")]
        floors[ranked[:remaining]] += 1
    return floors


def stratified_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Take `fraction` of each class (total = round(fraction·N), per class by largest remainder): (taken, rest)."""
    y = _as_labels(labels)
    f = _check_fraction("fraction", fraction)
    classes, inverse = np.unique(y, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(classes))
    take = _apportion(f * counts, int(round(f * y.size)), rng)
    taken, rest = [], []
    for k in range(len(classes)):
        idx = rng.permutation(np.flatnonzero(inverse == k))
        taken.append(idx[: take[k]])
        rest.append(idx[take[k] :])
    t = np.sort(np.concatenate(taken)).astype(np.int64) if taken else np.zeros(0, np.int64)
    r = np.sort(np.concatenate(rest)).astype(np.int64) if rest else np.zeros(0, np.int64)
    return t, r


def group_classes(num_classes: int, groups: int) -> list[np.ndarray]:
    """Consecutive class groups, sizes as even as possible, earlier groups larger (47/5 → 10,10,9,9,9)."""
    _check_int("groups", groups, 1, num_classes)
    return [np.asarray(g, dtype=np.int64) for g in np.array_split(np.arange(num_classes), groups)]


# --------------------------------------------------------------------------------- partitioners
def partition_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all samples and cut them into `num_clients` near-equal parts."""
    y = _as_labels(labels)
    m = _check_int("num_clients", num_clients, 1, max(1, y.size))
    return _finish(list(np.array_split(rng.permutation(y.size), m)))


def partition_pathological(
    labels: np.ndarray, num_clients: int, num_classes: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """PFLlib "pat": classes in order, each to the next ceil(M/K·cpc) clients with free slots, skewed counts.

    With M·cpc divisible by K every client gets exactly `classes_per_client` classes. Otherwise the
    greedy in-order assignment of PFLlib is kept as is: some clients end with fewer classes, and classes
    left when every client's slots are full are not assigned at all (logged as a warning). A client left
    without any class, or a class with fewer samples than the clients it is split over, is a DataError.
    Within a class, the first k−1 selected clients draw counts uniformly in [max(n/k/10, 1), n/k) and
    the last takes the rest, so every selected client holds at least one sample of the class.
    """
    y = _as_labels(labels)
    m = _check_int("num_clients", num_clients, 1)
    k_classes = _check_int("num_classes", num_classes, 1)
    cpc = _check_int("classes_per_client", classes_per_client, 1, k_classes)
    _check_classes(y, k_classes)
    per_class = int(math.ceil(m / k_classes * cpc))
    slots = np.full(m, cpc, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(m)]
    dropped: list[int] = []
    for c in range(k_classes):
        selected = np.flatnonzero(slots > 0)[:per_class]
        if selected.size == 0:
            dropped.append(c)
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        n, k = idx.size, selected.size
        if n < k:
            raise DataError(
                f"pathological partition: class {c} has {n} samples, fewer than the {k} clients "
                f"it is split over; lower num_clients or raise classes_per_client"
            )
        num_per = n / k
        low = max(int(num_per / 10), 1)
        high = max(int(num_per), low + 1)
        counts = rng.integers(low, high, size=k - 1) if k > 1 else np.zeros(0, np.int64)
        counts = np.append(counts, n - counts.sum())
        for client, piece in zip(selected, np.split(idx, np.cumsum(counts)[:-1])):
            parts[client].append(piece)
        slots[selected] -= 1
    if dropped:
        log.warning(
            "pathological partition: no free client slots left for classes %s "
            "(num_clients=%d, classes_per_client=%d, num_classes=%d); their samples are unused",
            dropped,
            m,
            cpc,
            k_classes,
        )
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise DataError(
            f"pathological partition: clients {empty} received no class "
            f"(num_clients={m}, num_classes={k_classes}, classes_per_client={cpc}); "
            f"choose num_clients·classes_per_client divisible by num_classes"
        )
    return _finish(parts)


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """PFLlib "dir": per class Dir(α·1_M) shares, zeroed for clients holding ≥ N/M, redrawn until all ≥ min_samples."""
    y = _as_labels(labels)
    m = _check_int("num_clients", num_clients, 1)
    k_classes = _check_int("num_classes", num_classes, 1)
    a = _check_alpha(alpha)
    least = _check_int("min_samples", min_samples, 0)
    _check_classes(y, k_classes)
    n_total = y.size
    if least * m > n_total:
        raise DataError(
            f"dirichlet partition: min_samples={least} × num_clients={m} exceeds the {n_total} "
            f"samples available; lower data.min_samples or data.num_clients"
        )
    by_class = [np.flatnonzero(y == c) for c in range(k_classes)]
    cap = n_total / m
    for attempt in range(1, max_tries + 1):
        batches: list[list[np.ndarray]] = [[] for _ in range(m)]
        sizes = np.zeros(m, dtype=np.int64)
        for c in range(k_classes):
            idx = rng.permutation(by_class[c])
            p = rng.dirichlet(np.full(m, a))
            p = np.where(sizes < cap, p, 0.0)
            s = p.sum()
            p = p / s if (s > 0 and np.isfinite(s)) else (sizes < cap) / max(1, int((sizes < cap).sum()))
            cuts = (np.cumsum(p) * idx.size).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(idx, cuts)):
                batches[j].append(piece)
                sizes[j] += piece.size
        if sizes.min() >= least:
            if attempt > 1:
                log.info("dirichlet partition: every client has >= %d samples after %d draws", least, attempt)
            return _finish(batches)
    raise DataError(
        f"dirichlet partition: after {max_tries} draws some client still had fewer than "
        f"min_samples={least} samples (alpha={a}, num_clients={m}, {n_total} samples); "
        f"raise data.alpha or lower data.min_samples / data.num_clients"
    )


def _cosmos_group_split(
    y: np.ndarray, num_clients: int, num_classes: int, alpha: float, groups: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """COSMOS step 1: class groups ↔ client groups; each class spread over its group's clients by Dir(α)."""
    class_groups = group_classes(num_classes, groups)
    client_groups = np.array_split(np.arange(num_clients), groups)
    group_of_client = np.empty(num_clients, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for g, (cls, members) in enumerate(zip(class_groups, client_groups)):
        group_of_client[members] = g
        for c in cls:
            idx = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(members.size, alpha))
            if not np.all(np.isfinite(p)):
                p = np.full(members.size, 1.0 / members.size)
            cuts = (np.cumsum(p) * idx.size).astype(np.int64)[:-1]
            for client, piece in zip(members, np.split(idx, cuts)):
                parts[client].append(piece)
    return _finish(parts), group_of_client


def _redistribute(parts: list[np.ndarray], fraction: float, rng: np.random.Generator) -> list[np.ndarray]:
    """COSMOS step 2: round(fraction·n_i) random samples of every client pooled, shuffled, dealt evenly."""
    kept, pooled = [], []
    for p in parts:
        shuffled = rng.permutation(p)
        give = int(round(fraction * p.size))
        pooled.append(shuffled[:give])
        kept.append(shuffled[give:])
    pool = rng.permutation(np.concatenate(pooled)) if pooled else np.zeros(0, np.int64)
    dealt = np.array_split(pool, len(parts))
    return _finish([np.concatenate([k, d]) for k, d in zip(kept, dealt)])


def partition_cosmos_groups(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    alpha: float,
    groups: int,
    redistribute_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], np.ndarray]:
    """COSMOS partition: grouped classes/clients with Dir(α) inside a group, then a shared pool dealt to all.

    Returns (indices per client, group index of each client). Clients are split over groups as evenly as
    possible (earlier groups get one more), classes likewise (47 classes / 5 groups → 10,10,9,9,9).
    """
    y = _as_labels(labels)
    m = _check_int("num_clients", num_clients, 1)
    k_classes = _check_int("num_classes", num_classes, 1)
    a = _check_alpha(alpha)
    g = _check_int("groups", groups, 1, min(m, k_classes))
    f = _check_fraction("redistribute_fraction", redistribute_fraction)
    _check_classes(y, k_classes)
    parts, group_of_client = _cosmos_group_split(y, m, k_classes, a, g, rng)
    return _redistribute(parts, f, rng), group_of_client


def client_groups(num_clients: int, groups: int) -> np.ndarray:
    """Group of each client: consecutive ids, sizes as even as possible, earlier groups larger (25/4 → 7,6,6,6)."""
    m = _check_int("num_clients", num_clients, 1)
    g = _check_int("groups", groups, 1, m)
    out = np.empty(m, dtype=np.int64)
    for k, members in enumerate(np.array_split(np.arange(m), g)):
        out[members] = k
    return out


def partition_groups_iid(
    labels: np.ndarray, num_clients: int, groups: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """`rotated` / `label-swap`: samples dealt IID (as the IFCA and CFL papers do), clients split into groups.

    Returns (indices per client, group index of each client). The groups differ only by the transform the
    federation applies afterwards (rotation of the images, or a permutation of the labels)."""
    y = _as_labels(labels)
    m = _check_int("num_clients", num_clients, 1, max(1, y.size))
    return partition_iid(y, m, rng), client_groups(m, groups)
