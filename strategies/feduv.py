"""FedUV (Son et al., CVPR 2024): FedAvg whose clients add two regularisers that make local training on
skewed data behave as it does on IID data.

Local loss on a batch of B samples with logits L (B × C) and encoder features Z (B × d, the input of the
final linear classifier):

    CE + μ_v · V(softmax(L)) + μ_u · U(Z)

- V, the classifier-variance hinge: V(P) = (1/C) Σ_c max(0, γ − sqrt(Var_b(P_bc) + ε)), the unbiased variance
  over the batch of each class's softmax probability. Under IID data a well-trained classifier's probability for
  class c varies strongly across a batch (≈ 1 for the samples of c, ≈ 0 for the others); a client that sees
  one class predicts it everywhere and the variance collapses. γ = 1/√C is that standard deviation for a
  batch holding one perfectly classified sample of each class (the std of a column of the C × C identity,
  the rule of the authors' code); ε = 1e-4 keeps the gradient finite when a column is constant (VICReg's
  variance term, which this one follows, does the same).
- U, the hyperspherical uniformity: U(Z) = log( mean over the B(B−1)/2 pairs a < b of exp(−t‖u_a − u_b‖²) ),
  u = z/‖z‖ (Wang & Isola's uniformity loss); minimising it spreads the features over the sphere. t = 2.

Defaults μ_v = 2.5 and μ_u = 0.5 are the authors' code defaults (its ``std_coeff`` and ``unif_coeff``).
Batches of fewer than two samples have no variance and no pair: both terms are 0 there. With μ_v = μ_u = 0
the client step is FedAvg's exactly (same loss, same batches; tested). Server: FedAvg's sample-weighted mean;
the deployed model is the global model, evaluated as FedAvg's.

Differences, stated: the definitions above follow the project's spec of the paper (specs/baselines.md: the
hinge on each class's std, the log-mean-exp of −t‖·‖² on normalised features). The paper's full text could
not be read here, so t = 2 is Wang & Isola's value, not checked against the paper. The authors' released
code (github.com/sonhamin/FedUV, algs/feduv.py) differs from that form: its uniformity term is the mean of
exp(−‖z_a − z_b‖²/m) WITHOUT the log, on UNNORMALISED features, with m the median of the batch's non-zero
squared distances instead of a fixed t; its std has no ε. Its threshold γ and coefficients are used here.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedapps import ops, protocol
from fedapps.clientops import client_op
from fedapps.models import classifier_name
from fedapps.params import param
from fedapps.protocol import ClientReply
from strategies.fedavg import FedAvg

TRAIN_OP = "feduv-train"  # the client operation: FedAvg's local training with the two terms
MU_V = "train.feduv_mu_v"  # message settings (the train section, so other training terms still see theirs)
MU_U = "train.feduv_mu_u"
TEMPERATURE = "train.feduv_t"
VARIANCE = "feduv-variance"  # reply metrics: the terms' mean over the local batches (before the coefficients)
UNIFORMITY = "feduv-uniformity"
STD_EPS = 1e-4  # ε in sqrt(Var + ε)
DEFAULT_T = 2.0  # t of the uniformity kernel (Wang & Isola's)


# --------------------------------------------------------------------------- maths


def iid_threshold(num_classes: int) -> float:
    """γ: the std (unbiased) of one class's probability over a batch of one perfectly classified sample per
    class, i.e. of a column of the C × C identity: 1/√C."""
    if num_classes < 2:
        raise ValueError(f"FedUV's variance term needs at least 2 classes, got {num_classes}")
    return 1.0 / math.sqrt(num_classes)


def variance_hinge(logits: Tensor, gamma: float, eps: float = STD_EPS) -> Tensor:
    """V = mean over classes of max(0, γ − sqrt(Var_batch(softmax(logits)[:, c]) + ε)); 0 for a batch < 2."""
    if logits.shape[0] < 2:
        return logits.sum() * 0.0
    probs = F.softmax(logits, dim=1)
    std = torch.sqrt(probs.var(dim=0, unbiased=True) + eps)
    return F.relu(gamma - std).mean()


def uniformity(features: Tensor, t: float) -> Tensor:
    """U = log of the mean over pairs a < b of exp(−t‖u_a − u_b‖²), u the ℓ2-normalised rows; 0 for a batch < 2."""
    n = features.shape[0]
    if n < 2:
        return features.sum() * 0.0
    u = F.normalize(features.flatten(1), dim=1)
    a, b = torch.triu_indices(n, n, offset=1, device=u.device)
    sq = (u[a] - u[b]).pow(2).sum(dim=1)
    return torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel())


# --------------------------------------------------------------------------- client side


class FeatureTap:
    """Records the input of the model's final linear classifier on every forward pass (while in a ``with``)."""

    def __init__(self, model: nn.Module) -> None:
        self.head = model.get_submodule(classifier_name(model))
        self.features: Tensor | None = None
        self._handle = None

    def _record(self, _module: nn.Module, args: tuple) -> None:
        self.features = args[0]

    def __enter__(self) -> "FeatureTap":
        self._handle = self.head.register_forward_pre_hook(self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
        self.features = None


def feduv_loss(tap: FeatureTap | None, mu_v: float, mu_u: float, t: float,
               regulariser: ops.Regulariser | None = None) -> tuple[ops.BatchLoss, dict[str, Tensor]]:
    """The batch loss CE + μ_v·V + μ_u·U (+ any other registered training term) and running sums of V and U.

    A term whose coefficient is 0 is not computed at all, so μ_v = μ_u = 0 is FedAvg's loss to the bit. The
    features for U come from ``tap`` (required when μ_u > 0), recorded by the same forward pass as the logits.
    """
    if mu_u > 0 and tap is None:
        raise ValueError("the uniformity term needs the classifier's input features: pass a FeatureTap")
    sums: dict[str, Tensor] = {}

    def add(name: str, value: Tensor) -> None:
        sums[name] = sums.get(name, 0.0) + value.detach()

    def loss_fn(m: nn.Module, xb: Tensor, yb: Tensor, _w: Tensor | None) -> Tensor:
        logits = m(xb)
        loss = F.cross_entropy(logits, yb)
        if mu_v > 0 or mu_u > 0:
            with torch.autocast(logits.device.type, enabled=False):  # both terms in float32, also under bf16
                if mu_v > 0:
                    v = variance_hinge(logits.float(), iid_threshold(logits.shape[1]))
                    add("variance", v)
                    loss = loss + mu_v * v
                if mu_u > 0:
                    u = uniformity(tap.features.float(), t)
                    add("uniformity", u)
                    loss = loss + mu_u * u
            add("batches", torch.ones((), device=logits.device))
        return loss + regulariser(m) if regulariser is not None else loss

    return loss_fn, sums


@client_op(TRAIN_OP, default_tag="train")
def feduv_train(w, tag: str) -> None:
    """FedAvg's local training with FedUV's terms (``train.feduv_mu_v``, ``train.feduv_mu_u``, ``train.feduv_t``);
    reports each term's mean over the batches (``feduv-variance``, ``feduv-uniformity``) when it is on."""
    section = protocol.section(w.config, "train")
    mu_v = float(section.get(MU_V.partition(".")[2], 0.0))
    mu_u = float(section.get(MU_U.partition(".")[2], 0.0))
    t = float(section.get(TEMPERATURE.partition(".")[2], DEFAULT_T))
    tap = FeatureTap(w.model) if mu_u > 0 else None
    loss_fn, sums = feduv_loss(tap, mu_v, mu_u, t, w.training_terms(section))
    with tap if tap is not None else nullcontext():
        result = ops.run_epochs(w.model, w.train_x, w.train_y, loss_fn, w.settings("train"), generator=w.generator)
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]
    batches = float(sums.get("batches", 0.0))
    for key, metric in (("variance", VARIANCE), ("uniformity", UNIFORMITY)):
        if key in sums and batches > 0:
            w.metrics[metric] = float(sums[key]) / batches


# --------------------------------------------------------------------------- server side


@dataclass
class FedUVParams:
    """FedUV's parameters (defaults: the authors' code)."""

    mu_v: float = param(2.5, ge=0, help="weight of the classifier-variance hinge; 0 = off")
    mu_u: float = param(0.5, ge=0, help="weight of the hyperspherical-uniformity term; 0 = off")
    t: float = param(DEFAULT_T, gt=0, help="the uniformity kernel's exp(-t·squared distance)")


class FedUV(FedAvg):
    """FedAvg aggregation; clients train with FedUV's variance and uniformity terms."""

    name = "feduv"
    Params = FedUVParams
    train_op = TRAIN_OP

    def client_settings(self) -> dict[str, Any]:
        return {MU_V: float(self.params.mu_v), MU_U: float(self.params.mu_u), TEMPERATURE: float(self.params.t)}

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """FedAvg's step; rounds.csv gets the clients' mean of each term (unweighted, where reported)."""
        out = super().aggregate(server_round, replies)
        for key, metric in (("feduv_variance", VARIANCE), ("feduv_uniformity", UNIFORMITY)):
            values = [float(r.metrics[metric]) for r in replies if metric in r.metrics]
            if values:
                out[key] = float(np.mean(values))
        return out
