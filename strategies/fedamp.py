"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients' models.

The server keeps every client's latest model w_j and builds, for each sampled client i, a personalised
anchor u_i = Σ_j ξ_ij·w_j with
    ξ_ij = α_K·exp(−‖w_i − w_j‖²/σ)/σ   (j ≠ i),      ξ_ii = 1 − Σ_{j≠i} ξ_ij,
so clients with similar models pull on each other. The client keeps its own model, trains it from where it
left off with cross-entropy + (λ/(2α_K))‖w − u_i‖² — the paper's coefficient (its u-step is a gradient step of
size α_K, so the proximal weight is λ/α_K; PFLlib uses the same) — carrying gradient into w (the PFLlib
version computes the term on detached tensors, which makes FedAMP plain local training; not reproduced here),
sends its parameters back; that trained model is the client's deployed model. Clients not heard from yet count
with the initial model. The term is FedProx's ``proximal`` training term, (μ/2)‖w − anchor‖², sent with
μ = λ/α_K (:func:`proximal_mu`); Ditto uses the same term with μ = λ.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Message

from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.server.clustering import l2_distance_matrix
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.base import DeployedModel, PersonalisedStrategy, RunContext
from strategies.fedavg import initial_model_arrays
from strategies.fedprox import PROX_MU

log = logging.getLogger("fedapps")


# --------------------------------------------------------------------------- the maths (pure functions)


def squared_distances(vectors: np.ndarray) -> np.ndarray:
    """‖v_i − v_j‖² between the rows of an N×P matrix (one Gram matrix, as COSMOS's ℓ2 distances), zero diagonal."""
    return l2_distance_matrix(np.ascontiguousarray(vectors, dtype=np.float32)) ** 2


def attention_weights(d2: np.ndarray, alpha_k: float, sigma: float) -> np.ndarray:
    """ξ from squared model distances: α_K·exp(−d²/σ)/σ off the diagonal, 1 − (row sum) on it."""
    xi = alpha_k * np.exp(-np.asarray(d2, dtype=np.float64) / sigma) / sigma
    np.fill_diagonal(xi, 0.0)
    np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
    return xi


def median_nonzero(d2: np.ndarray) -> float:
    """The median of the non-zero squared distances between distinct pool members (0 when there is none)."""
    pairs = np.asarray(d2, dtype=np.float64)[np.triu_indices(len(d2), 1)]
    pairs = pairs[pairs > 0]
    return float(np.median(pairs)) if pairs.size else 0.0


def relative_attention_weights(d2: np.ndarray, kappa: float, share: float) -> tuple[np.ndarray, float]:
    """ξ with σ_r = κ·(median non-zero d²) and α_r = share·σ_r/(n − 1): (share/(n − 1))·exp(−d²/σ_r) off the
    diagonal, 1 − (row sum) on it; and σ_r. With no non-zero distance (every model alike) each other model gets
    share/(n − 1)."""
    n = len(d2)
    sigma = kappa * median_nonzero(d2)
    d2 = np.asarray(d2, dtype=np.float64)
    kernel = np.exp(-d2 / sigma) if sigma > 0 else np.ones_like(d2)
    xi = share / max(n - 1, 1) * kernel
    np.fill_diagonal(xi, 0.0)
    np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
    return xi, sigma


def proximal_mu(lam: float, alpha_k: float) -> float:
    """μ of the client's proximal term (μ/2)‖w − u_i‖² such that it equals FedAMP's (λ/(2α_K))‖w − u_i‖²: λ/α_K."""
    return lam / alpha_k


def step_product(lr: float, lam: float, alpha_k: float) -> float:
    """lr·λ/α_K: the share of the gap to the anchor one plain SGD step on (λ/(2α_K))‖w − u‖² closes. At 1 a step sets
    w to u_i minus one CE gradient step (the client keeps nothing of its own model); above, it overshoots."""
    return lr * proximal_mu(lam, alpha_k)


def largest_passing_lam(lr: float, alpha_k: float) -> float:
    """The largest λ with three significant digits that keeps lr·λ/α_K < 1 (the bound itself, α_K/lr, does not)."""
    bound = alpha_k / lr
    step = 10.0 ** (math.floor(math.log10(bound * (1 - 1e-12))) - 2)  # a unit of the 3rd digit of what lies below it
    lam = float(f"{(math.ceil(round(bound / step, 6)) - 1) * step:.3g}")
    while step_product(lr, lam, alpha_k) >= 1.0:  # float rounding at the boundary: one unit lower
        lam = float(f"{lam - step:.3g}")
    return lam


def flatten(arrays: dict[str, np.ndarray], keys: list[str]) -> np.ndarray:
    """One parameter vector (float32) in a fixed key order."""
    return np.concatenate([arrays[k].reshape(-1).astype(np.float32) for k in keys])


def unflatten(vector: np.ndarray, like: dict[str, np.ndarray], keys: list[str]) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten` (shapes and dtypes from ``like``)."""
    out, start = {}, 0
    for k in keys:
        size = like[k].size
        out[k] = vector[start : start + size].reshape(like[k].shape).astype(like[k].dtype)
        start += size
    return out


# --------------------------------------------------------------------------- the strategy


@dataclass
class FedAMPParams:
    """FedAMP's parameters."""

    alpha_k: float = param(
        0.01,
        gt=0,
        help="α_K, the attention step; with a fixed σ, (num_clients − 1)·α_K/σ must "
        "stay <= 1 so that every self-weight ξ_ii >= 0",
    )
    sigma: float = param(
        0.2, gt=0, help="σ, the scale of the squared model distance in the attention kernel (used when kappa = 0)"
    )
    lam: float = param(
        1.0,
        ge=0,
        help="λ: the client's proximal term is (λ/(2α_K))‖w − u_i‖² (μ = λ/α_K on the wire); with SGD "
        "client.lr·λ/α_K must stay < 1",
    )
    kappa: float = param(
        0.0,
        ge=0,
        help="0: σ fixed at sigma; > 0: σ = kappa × the round's median non-zero squared "
        "distance between client models, and the attention step relative (share)",
    )
    share: float = param(0.5, gt=0, le=1, help="kappa > 0: the most weight all other clients together get")


class FedAMP(PersonalisedStrategy):
    """Personalised anchors from attention over all clients' latest models; local training towards them."""

    name = "fedamp"
    Params = FedAMPParams
    deployed = DeployedModel("client i's own model after its local training in round r")

    @classmethod
    def check(cls, cfg: ExperimentConfig, params: FedAMPParams) -> None:
        super().check(cfg, params)
        p = params
        worst = (cfg.data.num_clients - 1) * p.alpha_k / p.sigma
        if p.kappa == 0 and worst > 1:
            raise ConfigError(
                f"FedAMP's self-weight ξ_ii = 1 − Σ ξ_ij can turn negative: "
                f"(num_clients − 1)·alpha_k/sigma = {worst:.3g} > 1. "
                f"Lower 'strategy.params.fedamp.alpha_k' to at most {p.sigma / max(cfg.data.num_clients - 1, 1):.3g} "
                "or raise 'strategy.params.fedamp.sigma'"
            )
        product = step_product(cfg.client.lr, p.lam, p.alpha_k)
        if cfg.client.optimizer == "sgd" and product >= 1.0:
            raise ConfigError(
                f"'strategy.params.fedamp.lam' = {p.lam:g} with client.lr = {cfg.client.lr:g} and "
                f"alpha_k = {p.alpha_k:g} gives lr·λ/α_K = {product:.3g} >= 1: each SGD step moves the client's model "
                "all the way to its anchor u_i (or past it), so the client keeps nothing of its own. The largest λ "
                f"that passes at this lr and α_K is {largest_passing_lam(cfg.client.lr, p.alpha_k):g} "
                "(set 'strategy.params.fedamp.lam', or lower 'client.lr', or raise 'strategy.params.fedamp.alpha_k')"
            )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.like = initial_model_arrays(cfg, "params")  # shapes and dtypes of the parameters
        self.keys = list(self.like)
        self.initial = flatten(self.like, self.keys)
        self.models: dict[int, np.ndarray] = {}  # client id -> its latest parameter vector
        self._last_self_weight: float | None = None  # diagnostics of the last anchors: mean ξ_ii of the sampled
        self._last_median_d2: float | None = None  # clients, median non-zero ‖w_i − w_j‖² (what σ is compared with)
        self._last_sigma: float | None = None  # and the σ used
        p = self.params
        log.info(
            "FedAMP: proximal weight λ/α_K = %g, lr·λ/α_K = %.3g per SGD step (refused at >= 1)%s",
            proximal_mu(p.lam, p.alpha_k),
            step_product(cfg.client.lr, p.lam, p.alpha_k),
            "; with kappa > 0 the attention step follows σ each round, the proximal weight keeps the configured "
            "alpha_k, so this product is every round's"
            if p.kappa > 0
            else "",
        )

    def anchors(self, clients: list[int]) -> dict[int, np.ndarray]:
        """u_i for the given clients over every client known (and the given ones, at their current models)."""
        pool = sorted(set(self.models) | set(clients))
        vectors = np.stack([self.models.get(c, self.initial) for c in pool])
        d2 = squared_distances(vectors)
        if self.params.kappa > 0:
            xi, self._last_sigma = relative_attention_weights(d2, self.params.kappa, self.params.share)
        else:
            xi, self._last_sigma = attention_weights(d2, self.params.alpha_k, self.params.sigma), self.params.sigma
        row = {c: i for i, c in enumerate(pool)}
        chosen = np.array([row[c] for c in clients])
        self._last_self_weight = float(np.diagonal(xi)[chosen].mean())
        self._last_median_d2 = median_nonzero(d2)
        u = torch.from_numpy(xi[chosen].astype(np.float32)) @ torch.from_numpy(vectors)
        return {c: u[i].numpy() for i, c in enumerate(clients)}

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        mu = proximal_mu(self.params.lam, self.params.alpha_k)
        request = self.request(
            server_round,
            ["train"],
            load=protocol.Load(into_model=False),
            training=protocol.Training(sections={protocol.TRAIN: protocol.Section(extra={PROX_MU: mu})}),
            returns=protocol.Return(arrays=True, part="params"),
        )
        # a node not heard from yet is a client whose model is still the initial one: any id outside the pool does
        clients = [self.nodes.node_to_client.get(n, -1 - i) for i, n in enumerate(node_ids)]
        anchors = self.anchors(clients)
        return [
            protocol.build_message(
                n, request, arrays=protocol.arrays_record(unflatten(anchors[c], self.like, self.keys))
            )
            for n, c in zip(node_ids, clients)
        ]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        for r in replies:
            if r.arrays is not None and set(r.arrays) == set(self.keys):
                self.models[r.client_id] = flatten(r.arrays, self.keys)
            else:
                self.replies.skip_reply(server_round, r, "arrays that do not match the model; its previous model kept")
        return {
            "attention_self_mean": self._last_self_weight,
            "model_distance_sq_median": self._last_median_d2,
            "attention_sigma": self._last_sigma,
        }
