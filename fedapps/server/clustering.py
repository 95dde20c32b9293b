"""Client clustering from predictions on the public set U (COSMOS): distances and greedy threshold clustering.

Distances are between clients' prediction matrices f_i(U) (|U|×M), normalised per public sample so that a
threshold B0 does not depend on |U|:
  ``l1`` (paper):  d(i,j) = ‖f_i(U) − f_j(U)‖₁ / |U|   (mean per-sample ℓ1 distance, in [0, 2] for probabilities)
  ``l2`` (code):   d(i,j) = ‖f_i(U) − f_j(U)‖_F / √|U|  (root-mean-square per-sample ℓ2 distance, in [0, √2])

Greedy threshold clustering (Algorithm 1 of the paper): neighbours N_i = {j ≠ i : d(i,j) ≤ B0}; while clients
remain, the remaining client with the most remaining neighbours (ties: lowest id) founds a cluster with its
remaining neighbours; they all leave the pool. K is whatever comes out. All functions are pure.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("fedapps")

DISTANCES = ("l1", "l2")
B0_MODES = ("auto", "fixed")


def _as_matrix(predictions: np.ndarray | torch.Tensor) -> tuple[np.ndarray, int]:
    """(N, n, M) or (N, n·M) predictions -> float32 C-contiguous (N, D) array and n (samples per client)."""
    x = predictions.detach().cpu().numpy() if isinstance(predictions, torch.Tensor) else np.asarray(predictions)
    if x.ndim not in (2, 3):
        raise ValueError(f"predictions must be clients×samples×classes (or clients×samples), got shape {x.shape}")
    return np.ascontiguousarray(x.reshape(x.shape[0], -1), dtype=np.float32), int(x.shape[1])


def l2_distance_matrix(x: np.ndarray) -> np.ndarray:
    """N×N Euclidean distances between the rows of x via one Gram matrix: ‖a−b‖² = ‖a‖² + ‖b‖² − 2a·b.

    The squared norms are the Gram matrix's own diagonal, so rounding largely cancels; for probability
    matrices the error is ~1e-3 per public sample at |U|·M = 10⁶, far below any useful threshold.
    """
    t = torch.from_numpy(x)
    gram = (t @ t.T).double().numpy()
    sq = np.diagonal(gram)
    dist = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0))
    np.fill_diagonal(dist, 0.0)
    return np.maximum(dist, dist.T)  # exactly symmetric


def pairwise_distances(
    predictions: np.ndarray | torch.Tensor, metric: str = "l1", threads: int | None = None
) -> np.ndarray:
    """N×N distances between clients' predictions on U, per public sample (see the module docstring).

    ℓ1 runs on ``threads`` threads (default: torch's intra-op thread count), ℓ2 on torch's matrix product.
    """
    if metric not in DISTANCES:
        raise ValueError(f"unknown distance '{metric}'; allowed: {', '.join(DISTANCES)}")
    x, n_samples = _as_matrix(predictions)
    if metric == "l1":
        # imported here: numba (its import cost: docs/performance.md) loads only in processes that compute an l1 matrix
        from fedapps.server.pairwise_l1 import l1_distance_matrix

        return l1_distance_matrix(x, threads or torch.get_num_threads()) / n_samples
    return l2_distance_matrix(x) / math.sqrt(n_samples)


def distance_to_centres(pred: np.ndarray, centres: np.ndarray, metric: str = "l1") -> np.ndarray:
    """Distance (same normalisation) from one client's predictions (n×M) to each of K centres (K×n×M)."""
    diff = centres.reshape(len(centres), -1) - pred.reshape(1, -1)
    n = pred.shape[0]
    if metric == "l1":
        return np.abs(diff).sum(axis=1) / n
    if metric == "l2":
        return np.sqrt((diff.astype(np.float64) ** 2).sum(axis=1)) / math.sqrt(n)
    raise ValueError(f"unknown distance '{metric}'; allowed: {', '.join(DISTANCES)}")


def isolated(dist: np.ndarray, factor: float) -> np.ndarray:
    """Which clients are outliers: their distance to their NEAREST other client exceeds ``factor`` × the median of
    every client's nearest-neighbour distance (``dist``: N×N, symmetric). With fewer than 3 clients nobody is (two
    clients are each other's nearest neighbour). A client far from all others then takes no part in a clustering."""
    dist = np.asarray(dist, dtype=np.float64)
    if dist.ndim != 2 or dist.shape[0] != dist.shape[1]:
        raise ValueError(f"distance matrix must be square, got shape {dist.shape}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    n = dist.shape[0]
    if n < 3:
        return np.zeros(n, dtype=bool)
    nearest = np.where(np.eye(n, dtype=bool), np.inf, dist).min(axis=1)
    return nearest > factor * np.median(nearest)


def greedy_threshold_clustering(dist: np.ndarray, b0: float) -> list[list[int]]:
    """Algorithm 1: clusters (lists of client indices, founder's cluster first) for threshold b0."""
    dist = np.asarray(dist, dtype=np.float64)
    if dist.ndim != 2 or dist.shape[0] != dist.shape[1]:
        raise ValueError(f"distance matrix must be square, got shape {dist.shape}")
    n = dist.shape[0]
    adj = dist <= b0
    np.fill_diagonal(adj, False)
    adj = adj | adj.T  # a neighbour relation is symmetric even if the matrix is not exactly
    remaining = np.ones(n, dtype=bool)
    counts = adj.sum(axis=1).astype(np.int64)  # remaining neighbours of every client
    clusters: list[list[int]] = []
    while remaining.any():
        founder = int(np.argmax(np.where(remaining, counts, -1)))  # argmax keeps the first max: lowest id wins ties
        members = np.flatnonzero(adj[founder] & remaining)
        taken = np.concatenate(([founder], members))
        remaining[taken] = False
        counts -= adj[:, taken].sum(axis=1)
        clusters.append(sorted(int(i) for i in taken))
    return clusters


def assignment(clusters: list[list[int]], n: int) -> np.ndarray:
    """Cluster index of every client (clusters numbered in the order they were formed)."""
    out = np.full(n, -1, dtype=np.int64)
    for k, members in enumerate(clusters):
        out[members] = k
    return out


@dataclass
class ClusteringResult:
    """What the clustering decided and why (B0, how it was chosen, K, sizes)."""

    clusters: list[list[int]]
    b0: float
    mode: str  # 'fixed' or 'auto'
    metric: str
    tried: list[tuple[float, int]] = field(default_factory=list)  # (B0, K) pairs examined by the auto rule

    @property
    def k(self) -> int:
        """Number of clusters."""
        return len(self.clusters)

    @property
    def sizes(self) -> list[int]:
        """Size of every cluster, in formation order."""
        return [len(c) for c in self.clusters]


def auto_threshold(
    dist: np.ndarray, max_clusters: int, start: float = 0.05, step: float = 0.05
) -> tuple[float, list[list[int]], list[tuple[float, int]]]:
    """Reference rule: raise B0 from ``start`` in steps of ``step`` until at most ``max_clusters`` clusters remain."""
    if max_clusters < 1 or step <= 0 or start < 0:
        raise ValueError(f"need max_clusters >= 1, step > 0, start >= 0; got {max_clusters}, {step}, {start}")
    top = float(np.max(dist)) if np.size(dist) else 0.0
    tried: list[tuple[float, int]] = []
    i = 0
    while True:
        b0 = round(start + i * step, 10)
        clusters = greedy_threshold_clustering(dist, b0)
        tried.append((b0, len(clusters)))
        if len(clusters) <= max_clusters or b0 >= top:
            return b0, clusters, tried
        i += 1


def cluster_clients(
    dist: np.ndarray,
    mode: str = "auto",
    b0: float = 0.5,
    max_clusters: int = 5,
    start: float = 0.05,
    step: float = 0.05,
    metric: str = "l1",
) -> ClusteringResult:
    """Cluster with an explicit B0 (mode 'fixed') or the automatic rule (mode 'auto'); logs K and sizes."""
    if mode == "fixed":
        result = ClusteringResult(greedy_threshold_clustering(dist, b0), float(b0), mode, metric)
    elif mode == "auto":
        chosen, clusters, tried = auto_threshold(dist, max_clusters, start, step)
        result = ClusteringResult(clusters, chosen, mode, metric, tried)
    else:
        raise ValueError(f"unknown B0 mode '{mode}'; allowed: {', '.join(B0_MODES)}")
    log.info(
        "clustering: %s distance, B0 = %.3f (%s%s) -> K = %d clusters, sizes %s",
        metric,
        result.b0,
        mode,
        f", at most {max_clusters} clusters" if mode == "auto" else "",
        result.k,
        result.sizes,
    )
    return result
