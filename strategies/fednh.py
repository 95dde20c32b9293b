"""FedNH (Dai et al., AAAI 2023): a body averaged as in FedAvg under a classifier of class prototypes.

The classifier is a set of unit-norm class prototypes P_c (one row per class) with cosine logits
s·cos(z, P_c), z the body's features and s a learnable scale (:class:`fedapps.models.heads.CosineClassifier`,
the model ``<model.name>+cosine``). The server spreads the prototypes uniformly on the unit hypersphere at the
start (:func:`uniform_prototypes`, seeded). Each round a client receives the global body, prototypes and s,
trains body and s with the prototypes frozen (they never get a gradient in the federated part), and sends back
its body, its s, its local prototypes μ_{i,c} (the normalised mean of its normalised class-c features on its
training split, after training; in the prototype slot of the returned arrays) and its class counts n_{i,c}
(metric ``fednh-counts``). The server averages body and s by sample count and moves each prototype towards the
count-weighted mean of the clients' μ:  P_c ← normalise(ρ·P_c + (1 − ρ)·normalise(Σ_i n_{i,c} μ_{i,c} / Σ_i n_{i,c}))
(:func:`update_prototypes`); a class no reply has samples of keeps its prototype.

Deployed model after round r (the personalised variant): round r's global body with the global prototypes and s
fine-tuned on client i's training split (``finetune_epochs``, body frozen, on a copy: FedBABU's
``evaluate-finetuned``). Its companion ``generic`` (rounds.csv ``generic_acc_*``) is the global model itself —
global body, global prototypes, global s — on the same client's evaluation split. The after-training column is
the client's model right after its local training (its own body under the global prototypes: the paper's
code reports this as the personalised accuracy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedapps.client import ops, worker
from fedapps.client.registry import client_op
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.data import spec_info
from fedapps.models import build_model, classifier_name
from fedapps.params import param
from fedapps.seeds import derive_seed
from fedapps.server.aggregation import weighted_average
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import ReplyValidator
from strategies.fedbabu import EVALUATE_FINETUNED, FINETUNE

HEAD = "cosine"  # the classifier head of FedNH's model (fedapps.models.heads)
COUNTS = "fednh-counts"  # reply metric: the client's training samples per class (K numbers)
TRAIN_OP = "fednh-train"
INIT_STEPS = 1000  # gradient steps of the uniform initialisation
INIT_SHARPNESS = 30.0  # t of the soft maximum (1/t)·log Σ_j exp(t·cos_ij) it minimises


# --------------------------------------------------------------------------- maths


def normalise_rows(a: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm; an all-zero row stays zero."""
    norms = np.linalg.norm(a, axis=-1, keepdims=True)
    return np.divide(a, norms, out=np.zeros_like(a), where=norms > 1e-12)


def min_pairwise_angle(prototypes: np.ndarray) -> float:
    """The smallest angle (degrees) between two of the rows: what a uniform spread maximises."""
    u = normalise_rows(np.asarray(prototypes, dtype=np.float64))
    cos = u @ u.T
    np.fill_diagonal(cos, -1.0)
    return math.degrees(math.acos(float(np.clip(cos.max(), -1.0, 1.0))))


def uniform_prototypes(
    k: int, d: int, seed: int, steps: int = INIT_STEPS, sharpness: float = INIT_SHARPNESS
) -> np.ndarray:
    """K unit vectors in R^d spread over the hypersphere: from a seeded Gaussian draw, gradient descent on the
    mean over classes of a soft maximum of each prototype's cosine to the others (the Tammes problem: maximise
    the smallest pairwise angle), renormalised after every step. For K ≤ d + 1 the optimum is the regular
    simplex (every pairwise cosine −1/(K−1)); 1000 steps reach it to 0.01° for K ≤ 100, d = 512. Computed once
    per process for each argument tuple (a fresh copy each call)."""
    return _uniform_prototypes(int(k), int(d), int(seed), int(steps), float(sharpness)).copy()


@functools.lru_cache(maxsize=8)
def _uniform_prototypes(k: int, d: int, seed: int, steps: int, sharpness: float) -> np.ndarray:
    if k < 1 or d < 1:
        raise ValueError(f"need at least one class and one dimension, got K={k}, d={d}")
    g = torch.Generator().manual_seed(int(seed))
    w = F.normalize(torch.randn(k, d, generator=g, dtype=torch.float64), dim=1)
    if k == 1:
        return w.numpy().astype(np.float32)
    w.requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    self_pairs = torch.eye(k, dtype=torch.bool)
    for _ in range(steps):
        u = F.normalize(w, dim=1)
        cos = (u @ u.T).masked_fill(self_pairs, -math.inf)
        loss = (torch.logsumexp(sharpness * cos, dim=1) / sharpness).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            w.copy_(F.normalize(w, dim=1))
    return F.normalize(w.detach(), dim=1).numpy().astype(np.float32)


def orthogonal_prototypes(k: int, d: int, seed: int) -> np.ndarray:
    """K orthonormal rows in R^d (needs K ≤ d): the initialisation of the FedNH authors' released code."""
    if k > d:
        raise ValueError(f"{k} orthogonal prototypes need at least {k} dimensions, the features have {d}")
    g = torch.Generator().manual_seed(int(seed))
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q.T.contiguous().numpy().astype(np.float32)


def class_prototypes(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """A client's local prototypes and class counts: μ_c = normalise(mean over its class-c samples of
    normalise(z)); a class without samples gets a zero row and count 0."""
    u = F.normalize(features.double(), dim=1)
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, u.shape[1], dtype=u.dtype).index_add_(0, labels, u)
    return F.normalize(sums / counts.clamp_min(1).unsqueeze(1), dim=1).float(), counts


def update_prototypes(prototypes: np.ndarray, local: np.ndarray, counts: np.ndarray, rho: float) -> np.ndarray:
    """The server's step. ``prototypes`` K×d (unit rows), ``local`` N×K×d (client i's μ_{i,c}; renormalised
    here, rows with no samples ignored), ``counts`` N×K (n_{i,c}):
    P_c ← normalise(ρ·P_c + (1 − ρ)·normalise(Σ_i n_{i,c} μ_{i,c} / Σ_i n_{i,c})); a class with Σ_i n_{i,c} = 0
    keeps P_c."""
    p = normalise_rows(np.asarray(prototypes, dtype=np.float64))
    n = np.asarray(counts, dtype=np.float64)
    mu = normalise_rows(np.asarray(local, dtype=np.float64)) * (n > 0)[..., None]
    total = n.sum(axis=0)
    seen = total > 0
    mean = np.einsum("ik,ikd->kd", n, mu)
    mean[seen] /= total[seen, None]
    new = normalise_rows(rho * p + (1.0 - rho) * normalise_rows(mean))
    new[~seen] = p[~seen]
    return new.astype(np.asarray(prototypes).dtype)


# --------------------------------------------------------------------------- client side


def classifier(model: nn.Module) -> nn.Linear:
    """The model's final classifier (:func:`classifier_name`: an nn.Linear; FedNH's cosine head is one)."""
    head = model.get_submodule(classifier_name(model))
    assert isinstance(head, nn.Linear), classifier_name(model)
    return head


@torch.no_grad()
def penultimate_features(model: nn.Module, x: Tensor, batch_size: int = 256) -> Tensor:
    """What the model's classifier receives for each input (the body's features z), in eval mode, on the CPU."""
    head = classifier(model)
    device = next(model.parameters()).device
    captured: list[Tensor] = []
    handle = head.register_forward_hook(lambda _m, inputs, _out: captured.append(inputs[0].detach().float().cpu()))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(x), batch_size):
            model(x[start : start + batch_size].to(device))
    finally:
        handle.remove()
        model.train(was_training)
    return torch.cat(captured) if captured else torch.zeros((0, head.in_features))


def prototype_name(model: nn.Module) -> str:
    """The parameter holding the class prototypes (the cosine head's weight)."""
    return f"{classifier_name(model)}.weight"


@client_op(TRAIN_OP, default_tag="train")
def fednh_train(w, tag: str) -> None:
    """The generic ``train`` operation with the prototypes frozen (body and s learn), then the client's local
    prototypes on its training split: they go back in the prototype slot of a copy of the trained model
    (``return-arrays``), the class counts in the metric ``fednh-counts``. The model itself keeps the global
    prototypes (the after-training evaluation sees them)."""
    name = prototype_name(w.model)
    with ops.frozen(w.model, {name}):
        worker.train(w, tag)
    local, counts = class_prototypes(penultimate_features(w.model, w.train_x), w.train_y.long(), w.fed.num_classes)
    state = w.model.state_dict()
    w.outgoing = w.model_from({**state, name: local.to(state[name].dtype)})
    w.metrics[COUNTS] = [int(c) for c in counts]


# --------------------------------------------------------------------------- server side


@dataclass
class FedNHParams:
    """FedNH's parameters."""

    rho: float = param(0.9, ge=0, le=1, help="ρ: smoothing of the prototype update; 1 = prototypes never move")
    scale: float = param(10.0, gt=0, help="initial s of the cosine logits (learnable, averaged like the body)")
    init: str = param("uniform", choices=("uniform", "orthogonal"), help="the prototypes' initial spread")
    finetune_epochs: int = param(
        5, ge=1, help="epochs the prototypes and s are fine-tuned (body frozen) for the deployed model"
    )


def cosine_arch(cfg: ExperimentConfig) -> str:
    """The architecture FedNH's clients run: ``model.name`` with the cosine head."""
    return f"{cfg.model.name}+{HEAD}"


def feature_dim(cfg: ExperimentConfig) -> tuple[int, int]:
    """(classes K, feature dimension d) of the configured model."""
    num_classes, shape = spec_info(dataclasses.asdict(cfg.data))
    model = build_model(cosine_arch(cfg), num_classes, shape, seed=cfg.seed)
    return num_classes, classifier(model).in_features


class FedNH(PersonalisedStrategy):
    """FedAvg body, prototypes updated by the server from the clients' class means, personalised by fine-tuning."""

    name = "fednh"
    needs_classifier = "replaces the classifier head by class prototypes (a cosine head of the same size)"
    sample_privacy_refused = (
        "each client sends class prototypes (the mean features of its training samples per "
        "class) and its class counts, computed without noise"
    )
    Params = FedNHParams
    deployed = DeployedModel(
        "round r's global body with the global prototypes and scale fine-tuned on client i's "
        "training split (finetune_epochs, body frozen)",
        source="message",
        evaluate=EVALUATE_FINETUNED,
        companions=(("generic", "evaluate"),),
    )

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: Any) -> None:
        super().check_config(cfg, params)
        if params.init == "orthogonal":
            k, d = feature_dim(cfg)
            if k > d:
                raise ConfigError(
                    f"'strategy.params.fednh.init: orthogonal' needs no more classes than feature "
                    f"dimensions ({k} classes, '{cfg.model.name}' has {d}); use init: uniform"
                )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.arch = cosine_arch(cfg)
        num_classes, shape = spec_info(dataclasses.asdict(cfg.data))
        model = build_model(self.arch, num_classes, shape, seed=cfg.seed)
        self.prototype_key = prototype_name(model)
        self.scale_key = f"{classifier_name(model)}.scale"
        k, d = classifier(model).weight.shape
        init = uniform_prototypes if self.params.init == "uniform" else orthogonal_prototypes
        arrays = {key: v.detach().cpu().numpy() for key, v in model.state_dict().items()}
        arrays[self.prototype_key] = init(k, d, derive_seed(cfg.seed, "fednh-prototypes"))
        arrays[self.scale_key] = np.full_like(arrays[self.scale_key], self.params.scale)
        self.global_arrays = arrays

    def reply_validator(self) -> ReplyValidator:
        """Replies carry the cosine model's arrays: they are checked against it, not against model.name's."""
        cfg = self.cfg
        return ReplyValidator.from_config(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=cosine_arch(cfg)))
        )

    def final_arrays(self) -> dict[str, np.ndarray]:
        return self.global_arrays

    def setup(self) -> protocol.Setup:
        setup = super().setup()
        return dataclasses.replace(setup, model=dataclasses.replace(setup.model, name=self.arch))

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            [TRAIN_OP],
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="state"),
            keep=protocol.Keep(persist=False),  # the whole model arrives every round: none kept
            training=protocol.Training(sections={FINETUNE: protocol.Section(epochs=int(self.params.finetune_epochs))}),
        )
        arrays = self.global_arrays
        return [protocol.Draft(n, request, arrays=arrays) for n in node_ids]

    def class_counts(self, reply: ClientReply, server_round: int = 0) -> np.ndarray | None:
        """The reply's ``fednh-counts`` if they are K whole non-negative numbers summing to at most its
        ``num-examples``; None (the reply left out: :meth:`skip_reply`) otherwise."""
        k = self.global_arrays[self.prototype_key].shape[0]
        raw = reply.metrics.get(COUNTS)
        counts = np.asarray(raw if isinstance(raw, list) else [], dtype=np.float64)
        if (
            counts.shape != (k,)
            or np.any(counts < 0)
            or np.any(counts != np.round(counts))
            or counts.sum() > reply.num_examples
        ):
            self.replies.skip_reply(
                server_round, reply, f"'{COUNTS}' is not {k} class counts within its {reply.num_examples} samples"
            )
            return None
        return counts

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        usable: list[tuple[ClientReply, np.ndarray]] = []
        for r in replies:
            counts = self.class_counts(r, server_round) if r.arrays is not None else None
            if counts is not None:
                usable.append((r, counts))
        if not usable:
            return {}
        shared = [k for k in self.global_arrays if k != self.prototype_key]
        averaged = weighted_average(
            [{k: r.required_arrays[k] for k in shared} for r, _ in usable], [r.num_examples for r, _ in usable]
        )
        old = self.global_arrays[self.prototype_key]
        new = update_prototypes(
            old,
            np.stack([r.required_arrays[self.prototype_key] for r, _ in usable]),
            np.stack([c for _, c in usable]),
            float(self.params.rho),
        )
        self.global_arrays = {**self.global_arrays, **averaged, self.prototype_key: new}
        shift = np.degrees(np.arccos(np.clip((normalise_rows(old.astype(np.float64)) * new).sum(axis=1), -1, 1)))
        return {
            "fednh_scale": float(np.mean(averaged[self.scale_key])),
            "prototype_shift_deg": float(shift.mean()),  # mean angle the prototypes moved this round
            "prototype_min_angle_deg": min_pairwise_angle(new),
        }  # their spread (a collapse shows here)
