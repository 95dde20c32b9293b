"""pFedCK (Zhang & Shi, Electronics 13(5), 857, 2024): clustered interactive models, personalised by distillation.

Every client keeps two models: a personalised model (its private model, never sent) and an interactive model,
which it receives each round from the server — the model of its cluster — and sends back after training. On
each local batch both models learn from the labels and from each other, through the soft predictions and through
the middle-layer features (h: what the model's classifier receives):

    L_personal    = CE(z_p, y) + α·T²·KL(softmax(z_i/T) ‖ softmax(z_p/T)) + γ·MSE(h_p, h_i)   (z_i, h_i detached)
    L_interactive = CE(z_i, y) + β·T²·KL(softmax(z_p/T) ‖ softmax(z_i/T)) + γ·MSE(h_i, h_p)   (z_p, h_p detached)

each KL summed over the classes and averaged over the batch (``batchmean``), each MSE averaged over the batch and
the feature entries; one optimiser steps on L_personal + L_interactive, whose gradient with respect to each model
is that model's own loss (:func:`mutual_losses`, :func:`feature_losses`). The server clusters the round's replying
clients by the change of their interactive model, Δ_i = θ_i(trained) − θ_i(received) over the parameters, each Δ_i
scaled to unit length: K-means with K = ``clusters`` (capped at the number of replies; k-means++ seeding from the
experiment seed, later rounds warm-started from the previous centroids, as COMET's). Each cluster's new interactive
model is the sample-weighted mean of its members' trained interactive models; every member receives it next round.
Clients not heard from keep the model they had (at first the common initial model). The deployed model is client i's
personalised model after its local training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, client_op
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.models import classifier_name
from fedapps.params import param
from fedapps.seeds import derive_rng
from fedapps.server.aggregation import average_matching
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.cfl import update_vector
from strategies.comet import kmeans, kmeans_plus_plus
from strategies.fedavg import initial_model_arrays

log = logging.getLogger("fedapps")

TRAIN_OP = "pfedck-train"
SECTION = "pfedck"  # the message's settings section of the operation (pfedck.*):
ALPHA = "alpha"  # ... the two distillation weights and the temperature
BETA = "beta"
TEMPERATURE = "temperature"
FEATURE_WEIGHT = "feature-weight"  # γ: weight of the middle-layer feature terms
KL_PERSONAL = "pfedck-kl-personal"  # reply metrics: each KL term's mean over the local batches (before its weight)
KL_INTERACTIVE = "pfedck-kl-interactive"
FEATURE_MSE = "pfedck-feature-mse"  # reply metric: the feature MSE's mean over the local batches (before γ)


# --------------------------------------------------------------------------- the maths (pure functions)


def mutual_losses(
    z_personal: Tensor, z_interactive: Tensor, y: Tensor, alpha: float, beta: float, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(total, KL of the personal model, KL of the interactive model). Each KL is KL(other ‖ own) on softmax(z/T),
    summed over classes and averaged over the batch, times T², with the other model's logits detached: the personal
    model's term trains only the personal model, and the other way round. total = CE_p + α·KL_p + CE_i + β·KL_i."""
    t = float(temperature)
    kl_p = ops.kl_to_targets(z_personal / t, F.softmax(z_interactive.detach() / t, dim=-1)) * t * t
    kl_i = ops.kl_to_targets(z_interactive / t, F.softmax(z_personal.detach() / t, dim=-1)) * t * t
    total = F.cross_entropy(z_personal, y) + alpha * kl_p + F.cross_entropy(z_interactive, y) + beta * kl_i
    return total, kl_p, kl_i


def feature_losses(h_personal: Tensor, h_interactive: Tensor) -> tuple[Tensor, Tensor]:
    """(MSE of the personal model, MSE of the interactive model): each the mean over the batch and the feature
    entries of (own − other)², the other model's features detached, so each term trains only its own model. The
    two values are equal; their gradients go to different models. Features of different sizes are refused (the
    two models of a client must then share the size of the layer their classifiers read)."""
    if h_personal.shape != h_interactive.shape:
        raise ConfigError(
            f"pFedCK's feature distillation compares the features the two models' classifiers receive, but they "
            f"differ in shape: personal {tuple(h_personal.shape)}, interactive {tuple(h_interactive.shape)}. Give "
            "both the same architecture, or set 'strategy.params.pfedck.feature_weight: 0'"
        )
    mse_p = F.mse_loss(h_personal, h_interactive.detach())
    mse_i = F.mse_loss(h_interactive, h_personal.detach())
    return mse_p, mse_i


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (an all-zero row stays zero)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def cluster_updates(
    updates: np.ndarray, k: int, previous: np.ndarray | None, rng: np.random.Generator, max_iter: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """K-means on the unit-length update rows: (labels, centroids). Warm-started from ``previous`` when it has k
    rows, else k-means++ seeding from ``rng``; k is capped at the number of rows."""
    x = unit_rows(updates)
    k = min(int(k), len(x))
    init = previous if previous is not None and len(previous) == k else kmeans_plus_plus(x, k, rng)
    return kmeans(x, init, max_iter)


# --------------------------------------------------------------------------- client side


class ModelPair(nn.Module):
    """The personalised and the interactive model as one module, so that one loop trains both."""

    def __init__(self, personal: nn.Module, interactive: nn.Module) -> None:
        super().__init__()
        self.personal = personal
        self.interactive = interactive


class FeatureTap:
    """Records, on each forward pass, what a model's classifier receives (its middle-layer features h, with their
    gradient), through a forward pre-hook; :meth:`close` removes the hook."""

    def __init__(self, model: nn.Module) -> None:
        self.features: Tensor | None = None
        head = model.get_submodule(classifier_name(model))
        self.handle = head.register_forward_pre_hook(self._record)

    def _record(self, _module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        self.features = inputs[0].flatten(1)

    def take(self) -> Tensor:
        out, self.features = self.features, None
        if out is None:
            raise ProtocolError("pFedCK: the model's classifier was not reached on the forward pass")
        return out

    def close(self) -> None:
        self.handle.remove()


@client_op(TRAIN_OP, default_tag="train")
def pfedck_train(w, tag: str) -> None:
    """Mutual distillation between the private (personalised) model and the message's interactive model on the local
    data (``train.*`` settings over ``client.*``; ``pfedck.alpha``, ``.beta``, ``.temperature``); the trained
    interactive model is what goes back (``return-arrays``); the personalised one stays."""
    if w.received is None:
        raise ProtocolError(f"{TRAIN_OP} needs the interactive model in the message's arrays")
    own = w.request.training.section(SECTION).extra
    alpha, beta = float(own.get(ALPHA, 1.0)), float(own.get(BETA, 1.0))
    temperature = float(own.get(TEMPERATURE, 1.0))
    gamma = float(own.get(FEATURE_WEIGHT, 0.0))
    pair = ModelPair(w.model, w.model_from(w.received))
    taps = (FeatureTap(pair.personal), FeatureTap(pair.interactive)) if gamma > 0 else None
    sums: dict[str, Any] = {"p": 0.0, "i": 0.0, "f": 0.0, "n": 0}  # summed on the device: no host sync per step

    def loss_fn(m: nn.Module, xb: Tensor, yb: Tensor, _w: Tensor | None) -> Tensor:
        assert isinstance(m, ModelPair)  # run_epochs passes the model it trains: ``pair``
        total, kl_p, kl_i = mutual_losses(m.personal(xb), m.interactive(xb), yb, alpha, beta, temperature)
        if taps is not None:
            mse_p, mse_i = feature_losses(taps[0].take(), taps[1].take())
            total = total + gamma * (mse_p + mse_i)
            sums["f"] = sums["f"] + mse_p.detach()
        sums["p"] = sums["p"] + kl_p.detach()
        sums["i"] = sums["i"] + kl_i.detach()
        sums["n"] += 1
        return total

    try:
        result = ops.run_epochs(pair, w.train_x, w.train_y, loss_fn, w.settings("train"), generator=w.generator)
    finally:
        for tap in taps or ():
            tap.close()
    w.outgoing = pair.interactive
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]
    if sums["n"]:
        w.metrics[KL_PERSONAL] = float(sums["p"]) / sums["n"]
        w.metrics[KL_INTERACTIVE] = float(sums["i"]) / sums["n"]
        if taps is not None:
            w.metrics[FEATURE_MSE] = float(sums["f"]) / sums["n"]


# --------------------------------------------------------------------------- server side


@dataclass
class PFedCKParams:
    """pFedCK's parameters (the paper's abstract names the two distillation channels, not their weights: see
    docs/algorithms/pfedck.md)."""

    clusters: int = param(2, ge=1, help="K: clusters of interactive models (capped at the number of replies)")
    alpha: float = param(
        1.0, ge=0, help="α: weight of the KL term that distils the interactive model into the personalised one"
    )
    beta: float = param(
        1.0, ge=0, help="β: weight of the KL term that distils the personalised model into the interactive one"
    )
    temperature: float = param(1.0, gt=0, help="T: softmax temperature of both KL terms (each scaled by T²)")
    feature_weight: float = param(
        1.0,
        ge=0,
        help="γ: weight of the middle-layer feature terms, MSE between the features the two models' classifiers "
        "receive, each direction training its own model; 0 = soft predictions only",
    )
    kmeans_iters: int = param(100, ge=1, help="at most this many Lloyd iterations per round")


class PFedCK(PersonalisedStrategy):
    """Interactive models clustered by their updates and averaged per cluster; personalised models kept home."""

    name = "pfedck"
    Params = PFedCKParams
    needs_classifier = "distils the features its classifier head (the final nn.Linear) reads between its two models"
    robust_aggregation = True
    deployed = DeployedModel(
        "client i's personalised model after its local training in round r (mutual "
        "distillation with its cluster's interactive model)"
    )

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: PFedCKParams) -> None:
        super().check_config(cfg, params)
        cls.require_at_most_clients(cfg, "clusters", params.clusters)

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.initial = initial_model_arrays(cfg)
        self.parameter_keys = list(initial_model_arrays(cfg, "params"))
        self.models: dict[int, dict[str, np.ndarray]] = {}  # model id -> an interactive model some client holds
        self.model_of: dict[int, int] = {}  # client id -> id of the interactive model it receives next
        self.next_id = 0
        self.centroids: np.ndarray | None = None
        self.assignment: dict[int, int] = {}  # client id -> cluster of the last clustering it took part in

    def interactive_of(self, client_id: int | None) -> dict[str, np.ndarray]:
        """The interactive model the client receives: its cluster's latest, or the initial one."""
        mid = self.model_of.get(client_id) if client_id is not None else None
        return self.initial if mid is None else self.models[mid]

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        own = protocol.Section(
            extra={
                ALPHA: float(self.params.alpha),
                BETA: float(self.params.beta),
                TEMPERATURE: float(self.params.temperature),
                FEATURE_WEIGHT: float(self.params.feature_weight),
            }
        )
        request = self.request(
            server_round,
            [TRAIN_OP],
            load=protocol.Load(into_model=False),
            returns=protocol.Return(arrays=True, part="state"),
            training=protocol.Training(sections={SECTION: own}),
        )
        records: dict[int, Any] = {}
        messages = []
        for n in node_ids:
            model = self.interactive_of(self.nodes.node_to_client.get(n))
            if id(model) not in records:
                records[id(model)] = model
            messages.append(protocol.Draft(n, request, arrays=records[id(model)]))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        usable = [r for r in replies if r.arrays is not None and set(r.arrays) == set(self.initial)]
        if not usable:
            return {"clusters": len(set(self.assignment.values()))}
        updates = np.stack(
            [update_vector(r.required_arrays, self.interactive_of(r.client_id), self.parameter_keys) for r in usable]
        )
        k = min(self.params.clusters, len(usable))
        previous = self.centroids if self.centroids is not None and len(self.centroids) == k else None
        labels, self.centroids = cluster_updates(
            updates,
            k,
            previous,
            derive_rng(self.cfg.seed, "pfedck-kmeans-init", server_round),
            self.params.kmeans_iters,
        )
        sizes = np.bincount(labels, minlength=k)
        for j in range(k):
            members = [r for r, label in zip(usable, labels) if label == j]
            if not members:
                continue
            self.models[self.next_id] = average_matching(members, self.initial, self.rule)
            for r in members:
                self.model_of[r.client_id] = self.next_id
                self.assignment[r.client_id] = j
            self.next_id += 1
        held = set(self.model_of.values())
        self.models = {mid: m for mid, m in self.models.items() if mid in held}
        log.info("round %d: pFedCK K=%d, cluster sizes %s", server_round, k, sizes.tolist())
        out: dict[str, Any] = {
            "clusters": int((sizes > 0).sum()),
            "cluster_sizes": " ".join(str(int(s)) for s in sizes),
        }
        for key, metric in (
            ("pfedck_kl_personal", KL_PERSONAL),
            ("pfedck_kl_interactive", KL_INTERACTIVE),
            ("pfedck_feature_mse", FEATURE_MSE),
        ):
            values = [float(r.metrics[metric]) for r in usable if metric in r.metrics]
            if values:
                out[key] = float(np.mean(values))
        return out

    def final_summary(self) -> dict[str, Any]:
        return {"cluster_assignment": {str(c): k for c, k in sorted(self.assignment.items())}}
