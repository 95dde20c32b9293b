"""COMET (Cho et al. 2023): clustered co-distillation on a public set, for heterogeneous client models.

Each round every client sends its predictions (softmax) on U. The server runs K-means, K fixed in the
config, on the clients' flattened prediction matrices (|U|·M each), warm-started from the previous
round's centroids (round 1: a deterministic k-means++ seeded by the experiment seed), and sends every
client the mean prediction of ITS cluster. The client distils on it (KL) as a regulariser next to its
local training, evaluates its own model and sends fresh predictions. The server trains no model.

Difference from the original, on purpose: the original adds the KL term to the local CE loss in one
objective; here the generic client's ``distill`` (KL on U) runs before ``train`` (CE on private data)
in the same message — the same client protocol as COSMOS, so the comparison isolates the server side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message

from fedapps import protocol, pseudolabels
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.protocol import ClientReply
from strategies.pseudolabel_base import DistillParams, PseudoLabelStrategy, collect_predictions, targets_record

log = logging.getLogger("fedapps")


# --------------------------------------------------------------------------- K-means (pure functions)


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """‖x_i − c_k‖² for every point and centroid (points×K), as one matrix product."""
    xx = (x * x).sum(axis=1)[:, None]
    cc = (centroids * centroids).sum(axis=1)[None, :]
    return np.maximum(xx + cc - 2.0 * x @ centroids.T, 0.0)


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (first centre uniform, then ∝ squared distance); deterministic for a seeded rng."""
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= number of points, got k={k}, n={n}")
    chosen = [int(rng.integers(n))]
    d2 = squared_distances(x, x[chosen]).min(axis=1)
    for _ in range(1, k):
        total = d2.sum()
        if total <= 0:  # all remaining points coincide with a centre: take the first unchosen one
            nxt = next(i for i in range(n) if i not in chosen)
        else:
            nxt = int(rng.choice(n, p=d2 / total))
        chosen.append(nxt)
        d2 = np.minimum(d2, squared_distances(x, x[[nxt]])[:, 0])
    return x[chosen].astype(np.float64)


def kmeans(x: np.ndarray, init: np.ndarray, max_iter: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's iterations from the given centroids; returns (labels, centroids).

    An emptied cluster is re-seeded at the point farthest from its assigned centroid (deterministic),
    so K clusters come back whenever there are at least K distinct points. Stops when labels repeat.
    """
    x = np.asarray(x, dtype=np.float64)
    centroids = np.array(init, dtype=np.float64)
    k = len(centroids)
    labels = np.full(len(x), -1)
    for _ in range(max(1, max_iter)):
        d2 = squared_distances(x, centroids)
        new = d2.argmin(axis=1)
        for j in range(k):
            if not np.any(new == j):
                own = d2[np.arange(len(x)), new]
                sizes = np.bincount(new, minlength=k)
                own = np.where(sizes[new] > 1, own, -1.0)  # never take a point from a singleton cluster
                far = int(own.argmax())
                if own[far] < 0:
                    continue
                new[far] = j
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = labels == j
            if members.any():
                centroids[j] = x[members].mean(axis=0)
    return labels, centroids


def cluster_means(stack: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Mean of the members' predictions per cluster (members×n×M → K×n×M); empty clusters are zeros."""
    out = np.zeros((k, *stack.shape[1:]), dtype=np.float64)
    for j in range(k):
        members = labels == j
        if members.any():
            out[j] = stack[members].astype(np.float64).mean(axis=0)
    return out.astype(np.float32)


# --------------------------------------------------------------------------- the strategy


@dataclass
class COMETParams(DistillParams):
    """COMET's parameters (beside the shared distillation settings)."""

    clusters: int = param(5, ge=1)  # K, fixed in advance (capped at the number of replying clients)
    kmeans_iters: int = param(100, ge=1)  # at most this many Lloyd iterations per round


class COMET(PseudoLabelStrategy):
    """K-means on clients' predictions on U; each client distils (KL) on its cluster's mean prediction."""

    name = "comet"
    Params = COMETParams

    @classmethod
    def check(cls, cfg: ExperimentConfig, params: COMETParams) -> None:
        super().check(cfg, params)
        if params.clusters > cfg.data.num_clients:
            raise ConfigError(f"'strategy.params.comet.clusters' ({params.clusters}) exceeds 'data.num_clients' "
                              f"({cfg.data.num_clients}); lower it or raise data.num_clients")

    def __init__(self, cfg: ExperimentConfig, params: Any = None, on_round: Any = None) -> None:
        super().__init__(cfg, params, on_round)
        self.centroids: np.ndarray | None = None
        self.assignment: dict[int, int] = {}  # client id -> cluster of the last clustering
        self.cluster_targets: dict[int, np.ndarray] = {}  # cluster -> encoded mean prediction

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        config = self.message_config(server_round, "kl", "probs", self.params.encoding)
        records = {k: targets_record(t) for k, t in self.cluster_targets.items()}
        messages = []
        for n in node_ids:
            cluster = self.assignment.get(self.node_to_client.get(n, -1))
            targets = records.get(cluster) if cluster is not None else None
            messages.append(protocol.build_message(n, server_round, self.round_ops(targets is not None), config,
                                                   targets=targets))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        used, stack = collect_predictions(replies, self.public_size, self.num_classes, "probs", server_round)
        if not used:
            log.warning("round %d: no usable predictions; clusters stay as they were", server_round)
            return {"clusters": len(self.cluster_targets)}
        x = stack.reshape(len(used), -1).astype(np.float64)
        k = min(self.params.clusters, len(used))
        if self.centroids is None or len(self.centroids) != k:
            init = kmeans_plus_plus(x, k, np.random.default_rng(self.cfg.seed))
        else:
            init = self.centroids
        labels, self.centroids = kmeans(x, init, self.params.kmeans_iters)
        means = cluster_means(stack, labels, k)
        self.assignment = {r.client_id: int(c) for r, c in zip(used, labels)}
        self.cluster_targets = {j: pseudolabels.encode(means[j], self.params.encoding, self.num_classes)
                                for j in range(k) if np.any(labels == j)}
        sizes = np.bincount(labels, minlength=k)
        log.info("round %d: COMET K=%d, cluster sizes %s", server_round, k, sizes.tolist())
        member_targets = means[labels].argmax(axis=-1)  # each client's target labels (clients×n)
        diag = [self.oracle_accuracy(t) for t in member_targets]
        return {"clusters": int((sizes > 0).sum()), "cluster_sizes": " ".join(str(int(s)) for s in sizes),
                "diag_target_acc_on_U": None if None in diag else float(np.mean(diag))}

    def final_summary(self) -> dict[str, Any]:
        return {"cluster_assignment": {str(c): k for c, k in sorted(self.assignment.items())}}
