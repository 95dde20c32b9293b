"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients' models.

The server keeps every client's latest model w_j and builds, for each sampled client i, a personalised
anchor u_i = Σ_j ξ_ij·w_j with
    ξ_ij = α·exp(−‖w_i − w_j‖²/σ)/σ   (j ≠ i),      ξ_ii = 1 − Σ_{j≠i} ξ_ij,
so clients with similar models pull on each other. The client keeps its own model, trains it from where it
left off with cross-entropy + (λ/(2α))‖w − u_i‖² — the paper's coefficient (its u-step is a gradient step of
size α, so the proximal weight is λ/α; PFLlib uses the same) — carrying gradient into w (the PFLlib
version computes the term on detached tensors, which makes FedAMP plain local training; not reproduced here),
sends its parameters back; that trained model is the client's deployed model. Clients not heard from yet count
with the initial model. The term is FedProx's ``proximal`` training term, (μ/2)‖w − anchor‖², sent with
μ = λ/α (:func:`proximal_mu`); Ditto uses the same term with μ = λ.

The paper's form (``kappa`` = 0): α = α_K and σ fixed. The data-relative form (``kappa`` > 0): each round
σ_r = κ × the median non-zero squared distance between the pool's models and α_r = share·σ_r/(n − 1), and the
message's μ is λ/α_r, the same round's step (the paper indexes its step by iteration and ties the client's weight
to it); a round whose models are all alike (round 1) has no σ_r and no pull (μ = 0). With SGD a μ_r at which
lr·μ_r would reach 1 is capped at the largest λ that passes (:func:`coupled_mu`), logged and counted in rounds.csv.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from torch import nn

from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.server.clustering import l2_distance_matrix
from fedapps.server.dropin import (
    PROXIMAL_MU,
    PersonalisedFlowerStrategy,
    array_record,
    numpy_arrays,
    only_arrays,
    parameter_keys,
)
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import initial_model_arrays
from strategies.fedprox import PROX_MU

log = logging.getLogger("fedapps")
flower_log = logging.getLogger("flwr")  # the drop-in strategy logs where Flower's own strategies do


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


def relative_attention_weights(d2: np.ndarray, kappa: float, share: float) -> tuple[np.ndarray, float, float]:
    """ξ with σ_r = κ·(median non-zero d²) and α_r = share·σ_r/(n − 1): (share/(n − 1))·exp(−d²/σ_r) off the
    diagonal, 1 − (row sum) on it — the paper's formula at (α_r, σ_r); and σ_r, α_r. With no non-zero distance
    (every model alike) each other model gets share/(n − 1), and σ_r = α_r = 0 (no step: see :func:`coupled_mu`)."""
    n = len(d2)
    sigma = kappa * median_nonzero(d2)
    d2 = np.asarray(d2, dtype=np.float64)
    kernel = np.exp(-d2 / sigma) if sigma > 0 else np.ones_like(d2)
    xi = share / max(n - 1, 1) * kernel
    np.fill_diagonal(xi, 0.0)
    np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
    return xi, sigma, share * sigma / max(n - 1, 1)


def personalised_anchors(
    vectors: np.ndarray, chosen: Sequence[int], alpha_k: float, sigma: float, kappa: float, share: float
) -> tuple[np.ndarray, dict[str, float]]:
    """u_i = Σ_j ξ_ij·w_j for the rows ``chosen`` of the pool ``vectors`` (one client's parameter vector a row): ξ
    from the pool's squared distances, fixed (:func:`attention_weights`, ``kappa`` = 0) or relative
    (:func:`relative_attention_weights`). Returns the anchors (one row per chosen client) and the diagnostics: the
    chosen clients' self-weights ξ_ii (mean, min, max), the median non-zero squared distance, the σ and the step α
    used (α_K, or α_r: 0 in a round with no non-zero distance)."""
    d2 = squared_distances(vectors)
    if kappa > 0:
        xi, sigma_used, alpha_used = relative_attention_weights(d2, kappa, share)
    else:
        xi, sigma_used, alpha_used = attention_weights(d2, alpha_k, sigma), sigma, alpha_k
    rows = np.asarray(chosen, dtype=np.int64)
    u = torch.from_numpy(xi[rows].astype(np.float32)) @ torch.from_numpy(np.ascontiguousarray(vectors))
    own = np.diagonal(xi)[rows]
    diagnostics = {
        "self_weight": float(own.mean()),
        "self_weight_min": float(own.min()),
        "self_weight_max": float(own.max()),
        "median_d2": median_nonzero(d2),
        "sigma": float(sigma_used),
        "alpha": float(alpha_used),
    }
    return u.numpy(), diagnostics


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


def coupled_mu(lam: float, alpha: float, lr: float | None) -> tuple[float, bool]:
    """(μ, capped): the client's proximal weight λ/α for the round's attention step α; 0 when α = 0 (a round with no
    step: every model alike). ``lr`` (plain SGD; None: no cap): where lr·λ/α >= 1 — each step would set the model to
    its anchor, or past it — μ is capped at λ'/α with λ' = :func:`largest_passing_lam` (the largest λ of three
    significant digits that keeps the product below 1), and ``capped`` is True."""
    if alpha <= 0:
        return 0.0, False
    if lr is not None and step_product(lr, lam, alpha) >= 1.0:
        return proximal_mu(largest_passing_lam(lr, alpha), alpha), True
    return proximal_mu(lam, alpha), False


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
        help="λ: the client's proximal term is (λ/(2α))‖w − u_i‖² (μ = λ/α on the wire; α = alpha_k, or the round's "
        "α_r when kappa > 0); with SGD client.lr·λ/α_K must stay < 1 (kappa = 0: refused; kappa > 0: each round's "
        "μ is capped there and rounds.csv counts it)",
    )
    kappa: float = param(
        0.0,
        ge=0,
        help="0: σ fixed at sigma (the paper's form); > 0: σ_r = kappa × the round's median non-zero squared "
        "distance between client models, the step α_r = share·σ_r/(n − 1) and the client's μ = λ/α_r, every round",
    )
    share: float = param(0.5, gt=0, le=1, help="kappa > 0: the most weight all other clients together get")


class FedAMP(PersonalisedStrategy):
    """Personalised anchors from attention over all clients' latest models; local training towards them."""

    name = "fedamp"
    Params = FedAMPParams
    deployed = DeployedModel("client i's own model after its local training in round r")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: FedAMPParams) -> None:
        super().check_config(cfg, params)
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
        if p.kappa == 0 and cfg.client.optimizer == "sgd" and product >= 1.0:
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
        self.seen: dict[str, float] = {}  # diagnostics of the last anchors (personalised_anchors) and their μ
        p = self.params
        if p.kappa > 0:
            log.info(
                "FedAMP (data-relative σ): each round σ_r = %g × the median squared distance, α_r = %g·σ_r/(n − 1), "
                "μ = λ/α_r with λ = %g%s",
                p.kappa,
                p.share,
                p.lam,
                f"; with SGD at lr {cfg.client.lr:g} a μ with lr·μ >= 1 is capped (rounds.csv: prox_mu_capped)"
                if cfg.client.optimizer == "sgd"
                else "",
            )
        else:
            log.info(
                "FedAMP: proximal weight λ/α_K = %g, lr·λ/α_K = %.3g per SGD step (refused at >= 1)",
                proximal_mu(p.lam, p.alpha_k),
                step_product(cfg.client.lr, p.lam, p.alpha_k),
            )

    def anchors(self, clients: list[int]) -> dict[int, np.ndarray]:
        """u_i for the given clients over every client known (and the given ones, at their current models)."""
        pool = sorted(set(self.models) | set(clients))
        vectors = np.stack([self.models.get(c, self.initial) for c in pool])
        row = {c: i for i, c in enumerate(pool)}
        p = self.params
        u, seen = personalised_anchors(vectors, [row[c] for c in clients], p.alpha_k, p.sigma, p.kappa, p.share)
        sgd_lr = self.cfg.client.lr if self.cfg.client.optimizer == "sgd" else None
        mu, capped = coupled_mu(p.lam, seen["alpha"], sgd_lr if p.kappa > 0 else None)
        if capped:
            log.warning(
                "FedAMP: λ/α_r = %g with lr %g would move the model to its anchor in one step (lr·μ >= 1); μ capped "
                "at %g this round",
                proximal_mu(p.lam, seen["alpha"]),
                self.cfg.client.lr,
                mu,
            )
        self.seen = {**seen, "mu": mu, "capped": float(capped)}
        return {c: u[i] for i, c in enumerate(clients)}

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        # a node not heard from yet is a client whose model is still the initial one: any id outside the pool does
        clients = [self.nodes.node_to_client.get(n, -1 - i) for i, n in enumerate(node_ids)]
        anchors = self.anchors(clients)
        request = self.request(
            server_round,
            ["train"],
            load=protocol.Load(into_model=False),
            training=protocol.Training(sections={protocol.TRAIN: protocol.Section(extra={PROX_MU: self.seen["mu"]})}),
            returns=protocol.Return(arrays=True, part="params"),
        )
        return [
            protocol.Draft(n, request, arrays=unflatten(anchors[c], self.like, self.keys))
            for n, c in zip(node_ids, clients)
        ]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        for r in replies:
            if r.arrays is not None and set(r.arrays) == set(self.keys):
                self.models[r.client_id] = flatten(r.arrays, self.keys)
            else:
                self.replies.skip_reply(server_round, r, "arrays that do not match the model; its previous model kept")
        seen = self.seen
        return {
            "attention_self_mean": seen.get("self_weight"),
            "attention_self_min": seen.get("self_weight_min"),
            "attention_self_max": seen.get("self_weight_max"),
            "model_distance_sq_median": seen.get("median_d2"),
            "attention_sigma": seen.get("sigma"),
            "attention_alpha": seen.get("alpha"),
            "prox_mu": seen.get("mu"),
            "prox_mu_capped": seen.get("capped"),
        }


class FlowerFedAMP(PersonalisedFlowerStrategy):
    """FedAMP as a drop-in Flower strategy (``fedapps.flower_strategies.FedAMP``): each round a sampled node is sent its
    anchor u_i (:func:`personalised_anchors` over the latest upload of every node heard from and, at the initial arrays,
    this round's new nodes: the app's pool) as its ``"arrays"``, and μ = λ/α as ``"proximal-mu"`` in the train config,
    the key Flower's FedProx uses (α = α_K, or with ``kappa`` > 0 the round's α_r, μ = 0 while every model is alike; the
    strategy does not know the clients' learning rate, so it caps nothing). The paper's client trains ITS OWN model,
    kept between rounds, with CE + (μ/2)‖w − u_i‖² (:func:`strategies.fedprox.proximal_penalty`) and sends it back; that
    upload is the node's model, kept by the server and sent to it for evaluation. A client that does not keep its model
    but starts from the arrays it receives, as a FedProx client does, starts from u_i instead (docs/flower-apps.md says
    what that changes). There is no global model: ``Result.arrays`` stays empty. The anchors are built over the model's
    parameters (``model`` given) or every floating-point array; ``alpha_k``, ``sigma``, ``lam``, ``kappa`` and ``share``
    mean what they mean in the app (defaults: the app's); every other argument is Flower's FedAvg's."""

    def __init__(
        self,
        *,
        alpha_k: float = FedAMPParams.alpha_k,
        sigma: float = FedAMPParams.sigma,
        lam: float = FedAMPParams.lam,
        kappa: float = FedAMPParams.kappa,
        share: float = FedAMPParams.share,
        model: nn.Module | None = None,
        **flower_args: Any,
    ) -> None:
        super().__init__(**flower_args)
        if alpha_k <= 0 or sigma <= 0 or lam < 0 or kappa < 0 or not 0 < share <= 1:
            raise ValueError("FedAMP: alpha_k and sigma must be > 0, lam and kappa >= 0, share in (0, 1]")
        self.alpha_k, self.sigma, self.lam, self.kappa, self.share = alpha_k, sigma, lam, kappa, share
        self.mu = proximal_mu(lam, alpha_k)  # the round's μ (with kappa > 0: set with the anchors each round)
        self.model = model
        self.initial: dict[str, np.ndarray] = {}
        self.uploads: dict[int, dict[str, np.ndarray]] = {}  # node id -> its latest upload (its own model)
        self.vectors: dict[int, np.ndarray] = {}  # node id -> that upload's parameters, flattened
        self.anchors: dict[int, np.ndarray] = {}  # node id -> its anchor this round
        self.diagnostics: dict[str, float] = {}
        self.train_config = ConfigRecord()  # the round's train config: its μ is set with the anchors

    def settings(self) -> list[tuple[str, object]]:
        mu = "λ/α_r, per round" if self.kappa > 0 else self.mu
        return [("alpha_k, sigma, lam", (self.alpha_k, self.sigma, self.lam)), ("proximal-mu (λ/α)", mu),
                ("kappa, share", (self.kappa, self.share))]  # fmt: skip

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The anchors, with the round's μ under ``"proximal-mu"`` in the config (set with the anchors)."""
        self.train_config = ConfigRecord(dict(config))  # this round's own: its μ is this round's
        return super().configure_train(server_round, arrays, self.train_config, grid)

    def round_nodes(self, node_ids: list[int], arrays: ArrayRecord, for_training: bool) -> None:
        if not self.initial:
            self.initial = numpy_arrays(arrays)
            self.keys = list(self.initial)
            self.param_keys = parameter_keys(self.model, self.initial)
            self.initial_vector = flatten(self.initial, self.param_keys)
        if for_training:
            pool = sorted(set(self.vectors) | set(node_ids))
            row = {n: i for i, n in enumerate(pool)}
            vectors = np.stack([self.vectors.get(n, self.initial_vector) for n in pool])
            u, self.diagnostics = personalised_anchors(
                vectors, [row[n] for n in node_ids], self.alpha_k, self.sigma, self.kappa, self.share
            )
            self.anchors = {n: u[i] for i, n in enumerate(node_ids)}
            self.mu = coupled_mu(self.lam, self.diagnostics["alpha"], None)[0]
            self.train_config[PROXIMAL_MU] = self.mu

    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        """Training: u_i on the parameters (the node's own other arrays beside it); evaluation: the node's latest
        upload (the initial arrays before its first)."""
        own = self.uploads.get(node_id, self.initial)
        if not for_training:
            return array_record(own, self.keys)
        anchor = unflatten(self.anchors[node_id], self.initial, self.param_keys)
        return array_record({**own, **anchor}, self.keys)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """Each matching upload is its node's model from now on; no global model (None)."""
        for msg in replies:
            node, upload = msg.metadata.src_node_id, numpy_arrays(only_arrays(msg))
            if list(upload) != self.keys or any(upload[k].shape != self.initial[k].shape for k in self.keys):
                flower_log.warning("FedAMP round %d: node %d sent arrays that do not match the model; its previous "
                                   "model kept", server_round, node)  # fmt: skip
                continue
            self.uploads[node] = upload
            self.vectors[node] = flatten(upload, self.param_keys)
        return None
