"""COMET (Cho et al. 2023): clustered co-distillation on a public set, for heterogeneous client models.

Each round every client sends its predictions (softmax) on U. The server runs K-means (scikit-learn's
KMeans), K fixed in the config, on the clients' flattened prediction matrices (|U|·M each), warm-started
from the previous round's centroids (round 1: scikit-learn's k-means++ seeding, its random_state drawn
from the experiment seed), and sends every client the mean prediction of ITS cluster. The client distils
on it (KL) as a regulariser next to its local training, evaluates its own model and sends fresh
predictions. The server trains no model.

Difference from the original, on purpose: the original adds the KL term to the local CE loss in one
objective; here the generic client's ``distill`` (KL on U) runs before ``train`` (CE on private data)
in the same message — the same client protocol as COSMOS, so the comparison isolates the server side.

Robust option ``outlier_factor`` (off by default): K is fixed, so a client whose predictions are far from everybody's
(one-hot votes for one class on every row) takes a centroid for itself and the honest clients share the other K − 1:
some are merged into a cluster that is not theirs. With ``outlier_factor`` = f > 0 a client whose nearest other client
is more than f × the median nearest-neighbour distance away (per public sample, L1: :func:`fedapps.server.clustering.
isolated`) is set aside for the round: it takes no centroid, counts in no cluster's mean, and gets no targets next
round (it trains on its own data only); each such reply is recorded (rejections.csv, phase aggregate). A client
that stays near the others to escape the guard can only send predictions close to theirs.

Under ``privacy.mode: client`` every cluster's mean is released with client-level DP (:meth:`COMET.private_means`,
docs/privacy.md); the K-means itself reads the raw predictions, and the guarantee does not cover the assignment.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.seeds import derive_rng
from fedapps.server import client_privacy, clustering
from fedapps.server.strategy import RunContext
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from strategies.pseudolabel_base import DistillParams, PseudoLabelStrategy, collect_predictions

log = logging.getLogger("fedapps")


# --------------------------------------------------------------------------- K-means (scikit-learn, pure functions)


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (scikit-learn's ``kmeans_plusplus``: first centre uniform, then greedy draws ∝ squared
    distance); deterministic for a seeded rng, which draws the integer ``random_state`` handed to scikit-learn.

    With fewer distinct points than k some centres coincide (k-means then returns fewer non-empty clusters).
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= number of points, got k={k}, n={n}")
    from sklearn.cluster import kmeans_plusplus  # server side only: kept out of the ClientApp's imports

    centres, _ = kmeans_plusplus(x, k, random_state=int(rng.integers(2**31 - 1)))
    return centres


def kmeans(x: np.ndarray, init: np.ndarray, max_iter: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's iterations (scikit-learn's ``KMeans``, one run) from the given centroids; returns (labels, centroids).

    Cluster j of the result grows from ``init[j]`` (a warm start keeps the cluster ids). An emptied cluster is
    re-seeded at the point farthest from its centroid (scikit-learn's rule, deterministic), so K clusters come
    back whenever there are at least K distinct points. Stops when labels repeat (tol = 0) or after max_iter.
    OpenMP runs on one thread here so that the centroid sums are added in a fixed order (bit-identical reruns).
    """
    x = np.asarray(x, dtype=np.float64)
    init = np.asarray(init, dtype=np.float64)
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    km = KMeans(
        n_clusters=len(init),
        init=init,
        n_init=1,
        max_iter=max(1, int(max_iter)),
        tol=0.0,
        algorithm="lloyd",
        random_state=0,
    )
    with warnings.catch_warnings(), threadpool_limits(limits=1, user_api="openmp"):
        warnings.simplefilter("ignore", ConvergenceWarning)  # fewer distinct points than K: reported by the caller
        km.fit(x)
    return km.labels_.astype(np.int64), km.cluster_centers_.astype(np.float64)


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

    clusters: int = param(5, ge=1, help="K, fixed in advance (capped at the number of replying clients)")
    kmeans_iters: int = param(100, ge=1, help="at most this many Lloyd iterations per round")
    outlier_factor: float = param(
        0.0,
        ge=0,
        help="robust option, 0 = off: a client whose nearest other client is "
        "more than this × the median nearest-neighbour distance away takes "
        "no part in the round's clustering and gets no targets (e.g. 3)",
    )


class COMET(PseudoLabelStrategy):
    """K-means on clients' predictions on U; each client distils (KL) on its cluster's mean prediction."""

    name = "comet"
    Params = COMETParams

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: COMETParams) -> None:
        super().check_config(cfg, params)
        cls.require_at_most_clients(cfg, "clusters", params.clusters)
        if cfg.privacy.mode == client_privacy.CLIENT_MODE and params.outlier_factor > 0:
            raise ConfigError(
                "'strategy.params.comet.outlier_factor' under privacy.mode client: the clip already bounds how far "
                "one client moves its cluster's target, and setting a client aside by its distance to the others "
                "is one more data-dependent choice outside the guarantee; set outlier_factor to 0"
            )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.centroids: np.ndarray | None = None
        self.assignment: dict[int, int] = {}  # client id -> cluster of the last clustering
        self.cluster_targets: dict[int, np.ndarray] = {}  # cluster -> encoded mean prediction

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        records = {k: protocol.Targets(t).encode() for k, t in self.cluster_targets.items()}
        requests = {
            with_targets: self.round_request(
                server_round, self.round_ops(with_targets), "kl", "probs", self.params.encoding
            )
            for with_targets in (False, True)
        }
        messages = []
        for n in node_ids:
            cluster = self.assignment.get(self.nodes.node_to_client.get(n, -1))
            targets = records.get(cluster) if cluster is not None else None
            messages.append(protocol.Draft(n, requests[targets is not None], targets=targets))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        used, stack = collect_predictions(replies, self.public_size, self.num_classes, "probs")
        if not used:
            self.replies.skip_round(server_round, "no usable predictions; clusters stay as they were")
            return {"clusters": len(self.cluster_targets)}
        set_aside = 0
        if self.params.outlier_factor > 0:
            used, stack, set_aside = self.without_outliers(server_round, used, stack)
        x = stack.reshape(len(used), -1).astype(np.float64)
        k = min(self.params.clusters, len(used))
        if self.centroids is None or len(self.centroids) != k:
            init = kmeans_plus_plus(x, k, derive_rng(self.cfg.seed, "comet-kmeans-init", server_round))
        else:
            init = self.centroids
        labels, self.centroids = kmeans(x, init, self.params.kmeans_iters)
        means = (
            cluster_means(stack, labels, k)
            if self.client_dp is None
            else self.private_means(server_round, stack, labels, k)
        )
        self.assignment = {r.client_id: int(c) for r, c in zip(used, labels)}
        self.cluster_targets = {
            j: pseudolabels.encode(means[j], self.params.encoding, self.num_classes)
            for j in range(k)
            if np.any(labels == j)
        }
        sizes = np.bincount(labels, minlength=k)
        log.info("round %d: COMET K=%d, cluster sizes %s", server_round, k, sizes.tolist())
        member_targets = means[labels].argmax(axis=-1)  # each client's target labels (clients×n)
        diag = [self.oracle_accuracy(t) for t in member_targets]
        known = [d for d in diag if d is not None]
        out = {
            "clusters": int((sizes > 0).sum()),
            "cluster_sizes": " ".join(str(int(s)) for s in sizes),
            "diag_target_acc_on_U": float(np.mean(known)) if len(known) == len(diag) else None,
        }
        if self.client_dp is not None:
            out.update(self.client_dp.record(r.client_id for r in used))
        return {**out, "set_aside": set_aside} if self.params.outlier_factor > 0 else out

    def private_means(self, server_round: int, stack: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
        """privacy.mode client: :func:`cluster_means` as one release of :class:`fedapps.server.client_privacy.
        ClientLevelDP`: per cluster its members' predictions clipped, summed, noised, divided by its size and made
        probability rows again. The clusters are disjoint, so one client enters one sum: the round's sensitivity is
        C. The sizes come from the K-means on the raw predictions, which the guarantee does not cover."""
        dp = self.client_dp
        assert dp is not None
        out = np.zeros((k, *stack.shape[1:]), dtype=np.float32)
        for j in range(k):
            members = stack[labels == j]
            if len(members):
                mean = dp.noisy_mean(list(members), len(members), dp.noise_rng(server_round, j))
                out[j] = client_privacy.as_probabilities(mean)
        return out

    def without_outliers(
        self, server_round: int, used: list[ClientReply], stack: np.ndarray
    ) -> tuple[list[ClientReply], np.ndarray, int]:
        """``outlier_factor``: the replies (and their predictions) without the clients :func:`fedapps.server.clustering.
        isolated` finds, each recorded as left out; everybody when that would leave nobody."""
        far = clustering.isolated(clustering.pairwise_distances(stack, "l1"), float(self.params.outlier_factor))
        if far.all() or not far.any():
            return used, stack, 0
        for r in (r for r, f in zip(used, far) if f):
            self.replies.skip_reply(
                server_round,
                r,
                f"outlier_factor {self.params.outlier_factor:g}: its predictions are far "
                "from every other client's; set aside this round (no centroid, no "
                "targets)",
            )
        keep = ~far
        return [r for r, k in zip(used, keep) if k], stack[keep], int(far.sum())

    def final_summary(self) -> dict[str, Any]:
        return {"cluster_assignment": {str(c): k for c, k in sorted(self.assignment.items())}}
