"""CFL — clustered federated learning (Sattler, Müller & Samek, IEEE TNNLS 2021).

All clients start in one cluster with one model. Each round a sampled client receives its cluster's model,
evaluates it on its test split (as FedAvg's global model is evaluated), trains it and sends it back; the
server averages each cluster's models by sample count. Then, for every cluster whose training has stalled as
a whole while some clients still pull hard — the norm of the mean update Δθ̄ below ``eps1`` and the largest
client update norm above ``eps2`` — and that has more than ``min_split_size`` members this round, the
clients are bi-partitioned by the cosine similarity of their updates Δθ_i = θ_i − θ_cluster: complete-linkage
agglomerative clustering into two groups, i.e. the split that keeps the most dissimilar updates apart.
Both halves start from the cluster's new model. Clients never sampled yet belong to the first cluster.
The update norms are written to rounds.csv so that ``eps1``/``eps2`` can be set for a model and learning rate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from fedapps.config import ExperimentConfig
from fedapps.params import param
from fedapps.server.aggregation import average_matching, weighted_average
from fedapps.server.dropin import PersonalisedFlowerStrategy, array_record, numpy_arrays, only_arrays, only_metrics
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import initial_model_arrays

log = logging.getLogger("fedapps")


# --------------------------------------------------------------------------- the maths (pure functions)


def update_vector(new: dict[str, np.ndarray], old: dict[str, np.ndarray], keys: list[str]) -> np.ndarray:
    """Δθ = new − old over the given (parameter) keys, flattened, float64."""
    return np.concatenate([(new[k].astype(np.float64) - old[k].astype(np.float64)).reshape(-1) for k in keys])


def cosine_similarities(updates: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of the rows (a zero row is similar to nothing but itself)."""
    norms = np.linalg.norm(updates, axis=1)
    unit = updates / np.where(norms > 0, norms, 1.0)[:, None]
    sim = unit @ unit.T
    np.fill_diagonal(sim, 1.0)
    return np.clip(sim, -1.0, 1.0)


def should_split(updates: np.ndarray, weights: np.ndarray, eps1: float, eps2: float) -> tuple[bool, float, float]:
    """CFL's criterion: ‖weighted mean update‖ < eps1 and max ‖update‖ > eps2; returns (split?, mean, max)."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    mean_norm = float(np.linalg.norm(w @ updates))
    max_norm = float(np.linalg.norm(updates, axis=1).max())
    return mean_norm < eps1 and max_norm > eps2, mean_norm, max_norm


def bipartition(similarity: np.ndarray) -> tuple[list[int], list[int]]:
    """Two groups (row indices) by complete-linkage clustering on the distance 1 − similarity; the group
    holding row 0 comes first."""
    from sklearn.cluster import AgglomerativeClustering  # server side only: kept out of the ClientApp's imports

    labels = (
        AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete").fit(1.0 - similarity).labels_
    )
    first = [i for i in range(len(labels)) if labels[i] == labels[0]]
    return first, [i for i in range(len(labels)) if labels[i] != labels[0]]


# --------------------------------------------------------------------------- the strategy


@dataclass
class CFLParams:
    """CFL's parameters (the norms depend on the model and the learning rate: read them in rounds.csv)."""

    # read off rounds.csv on configs/cfl.yaml's setting (CNN, SGD lr 0.005): mean 0.08, max 0.38 in round 5
    eps1: float = param(
        0.09, gt=0, help="split a cluster only when its mean update norm is below this (it has converged as a whole)"
    )
    eps2: float = param(0.2, gt=0, help="... and some client's update norm is above this (that client still disagrees)")
    min_split_size: int = param(
        2, ge=2, help="split only clusters with more replying members than this (at least two halves)"
    )
    warmup_rounds: int = param(5, ge=0, help="no split before this round")


class CFL(PersonalisedStrategy):
    """One model per cluster; clusters split recursively by the cosine similarity of client updates."""

    name = "cfl"
    robust_aggregation = True
    Params = CFLParams
    deployed = DeployedModel(
        "the model of client i's cluster aggregated in round r (after round r's splits)", source="message"
    )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.models = [initial_model_arrays(cfg)]  # one model per cluster
        self.parameter_keys = list(initial_model_arrays(cfg, "params"))
        self.cluster_of: dict[int, int] = {}  # client id -> cluster (unknown clients: cluster 0)
        self.splits: list[tuple[int, int, int]] = []  # (round, parent cluster, new cluster)

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            ["train"],
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="state"),
            keep=protocol.Keep(persist=False),
        )
        records = {}
        messages = []
        for n in node_ids:
            k = self.cluster_of.get(self.nodes.node_to_client.get(n, -1), 0)
            if k not in records:
                records[k] = self.models[k]
            messages.append(protocol.Draft(n, request, arrays=records[k]))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        members: dict[int, list[ClientReply]] = {}
        for r in replies:
            if r.arrays is not None and set(r.arrays) == set(self.models[0]):
                members.setdefault(self.cluster_of.get(r.client_id, 0), []).append(r)
        mean_norms, max_norms = [], []
        for k, group in sorted(members.items()):
            sent = self.models[k]
            updates = np.stack([update_vector(r.required_arrays, sent, self.parameter_keys) for r in group])
            weights = np.array([max(r.num_examples, 1) for r in group], dtype=np.float64)
            split, mean_norm, max_norm = should_split(updates, weights, self.params.eps1, self.params.eps2)
            mean_norms.append(mean_norm)
            max_norms.append(max_norm)
            self.models[k] = average_matching(group, sent, self.rule)
            if split and server_round >= self.params.warmup_rounds and len(group) > self.params.min_split_size:
                self._split(server_round, k, group, cosine_similarities(updates))
        for r in replies:
            self.cluster_of.setdefault(r.client_id, 0)
        sizes = np.bincount(list(self.cluster_of.values()), minlength=len(self.models))
        return {
            "clusters": len(self.models),
            "cluster_sizes": " ".join(str(int(s)) for s in sizes),
            "update_norm_mean_max": max(mean_norms) if mean_norms else None,
            "update_norm_max_max": max(max_norms) if max_norms else None,
        }

    def _split(self, server_round: int, k: int, group: list[ClientReply], similarity: np.ndarray) -> None:
        """Move the second half of the bipartition into a new cluster that starts from cluster k's model."""
        first, second = bipartition(similarity)
        new = len(self.models)
        self.models.append({name: value.copy() for name, value in self.models[k].items()})
        for i in second:
            self.cluster_of[group[i].client_id] = new
        for i in first:
            self.cluster_of[group[i].client_id] = k
        self.splits.append((server_round, k, new))
        cross = float(similarity[np.ix_(first, second)].max())
        log.info(
            "round %d: CFL split cluster %d into %d + %d clients (new cluster %d); max cross-similarity %.3f",
            server_round,
            k,
            len(first),
            len(second),
            new,
            cross,
        )

    def final_summary(self) -> dict[str, Any]:
        return {
            "cluster_assignment": {str(c): k for c, k in sorted(self.cluster_of.items())},
            "splits": [list(s) for s in self.splits],
        }


class FlowerCFL(PersonalisedFlowerStrategy):
    """CFL as a drop-in Flower strategy (``fedapps.flower_strategies.CFL``): each node is sent its cluster's model
    and trains it; the server averages each cluster's uploads (:func:`fedapps.server.aggregation.weighted_average`, the
    app's mean) and splits a cluster by the app's criterion and bipartition (:func:`should_split`,
    :func:`cosine_similarities`, :func:`bipartition`) on the updates of its floating arrays. A node never heard from
    is in cluster 0, whose model ``aggregate_train`` returns. ``eps1``, ``eps2``, ``min_split_size`` and
    ``warmup_rounds`` mean what they mean in the app (defaults: the app's); every other argument is Flower's
    FedAvg's."""

    def __init__(
        self,
        *,
        eps1: float = CFLParams.eps1,
        eps2: float = CFLParams.eps2,
        min_split_size: int = CFLParams.min_split_size,
        warmup_rounds: int = CFLParams.warmup_rounds,
        **flower_args: Any,
    ) -> None:
        super().__init__(**flower_args)
        if eps1 <= 0 or eps2 <= 0 or min_split_size < 2 or warmup_rounds < 0:
            raise ValueError("CFL: eps1 and eps2 must be > 0, min_split_size >= 2 and warmup_rounds >= 0")
        self.eps1, self.eps2, self.min_split_size, self.warmup_rounds = eps1, eps2, min_split_size, warmup_rounds
        self.models: list[dict[str, np.ndarray]] = []  # one model per cluster, set from the initial arrays
        self.cluster_of: dict[int, int] = {}  # node id -> cluster (nodes never heard from: cluster 0)

    def settings(self) -> list[tuple[str, object]]:
        return [("eps1, eps2", (self.eps1, self.eps2)), ("min_split_size", self.min_split_size),
                ("warmup_rounds", self.warmup_rounds)]  # fmt: skip

    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        if not self.models:
            initial = numpy_arrays(arrays)
            self.keys = list(initial)
            self.float_keys = [k for k, v in initial.items() if np.issubdtype(v.dtype, np.floating)]
            self.models = [initial]
        return array_record(self.models[self.cluster_of.get(node_id, 0)], self.keys)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """Each cluster's matching uploads averaged, then split where CFL's criterion says; cluster 0's model."""
        members: dict[int, list[tuple[int, dict[str, np.ndarray], float]]] = {}
        for msg in replies:
            node, arrays = msg.metadata.src_node_id, numpy_arrays(only_arrays(msg))
            if list(arrays) != self.keys or any(arrays[k].shape != self.models[0][k].shape for k in self.keys):
                log.warning(
                    "CFL round %d: node %d sent arrays that do not match the model; left out", server_round, node
                )
                continue
            weight = float(only_metrics(msg)[self.weighted_by_key])  # type: ignore[arg-type]  # checked: a number
            members.setdefault(self.cluster_of.get(node, 0), []).append((node, arrays, weight))
        if not members:
            return None
        for k, group in sorted(members.items()):
            sent = self.models[k]
            updates = np.stack([update_vector(a, sent, self.float_keys) for _, a, _ in group])
            weights = np.array([max(w, 1.0) for _, _, w in group])
            split, _, _ = should_split(updates, weights, self.eps1, self.eps2)
            self.models[k] = weighted_average([a for _, a, _ in group], [w for _, _, w in group])
            if split and server_round >= self.warmup_rounds and len(group) > self.min_split_size:
                first, second = bipartition(cosine_similarities(updates))
                self.models.append({name: value.copy() for name, value in self.models[k].items()})
                self.cluster_of.update({group[i][0]: len(self.models) - 1 for i in second})
                self.cluster_of.update({group[i][0]: k for i in first})
                log.info("CFL round %d: cluster %d split into %d + %d nodes", server_round, k, len(first), len(second))
        for group in members.values():
            for node, _, _ in group:
                self.cluster_of.setdefault(node, 0)
        return array_record(self.models[0], self.keys)
