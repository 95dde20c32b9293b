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
- U, the uniformity of the features, in one of two forms (``uniformity``):
  - ``median-rbf`` (default; the authors' released code, github.com/sonhamin/FedUV, algs/feduv.py):
    U(Z) = mean over the B(B−1)/2 pairs a < b of exp(−‖z_a − z_b‖² / m), z the UNNORMALISED classifier input and
    m the median of the batch's non-zero squared distances (the lower middle value for an even count, as
    torch.median), NOT detached: the gradient also flows through the pair that sets m. U lies in
    [exp(−1)/2, 1] (half the pairs lie within the median); it punishes pairs much closer than the batch's
    typical distance, and the batch's own bandwidth m makes it scale-free, so it cannot keep pushing the
    features apart once they are spread.
  - ``log-gaussian`` (an earlier version of our spec; kept as a named variant): U(Z) = log mean over pairs of
    exp(−t‖u_a − u_b‖²), u = z/‖z‖ (Wang & Isola's uniformity loss, t = 2). Measured here: it never saturates
    and stalls training on IID labels (a centralised check on IID mnist5k, 60 steps: CE only 0.722, this form
    0.102 with the hinge pinned at 0.306, the median-rbf form 0.709). ``t`` is read only by this form.

Defaults μ_v = 2.5 and μ_u = 0.5 are the authors' code defaults (its ``std_coeff`` and ``unif_coeff``).
Batches of fewer than two samples have no variance and no pair: both terms are 0 there; a batch whose features
are all identical has no non-zero distance, and its median-rbf term is 1 with no gradient. With μ_v = μ_u = 0
the client step is FedAvg's exactly (same loss, same batches; tested). Server: FedAvg's sample-weighted mean;
the deployed model is the global model, evaluated as FedAvg's.

Differences from the authors' code, stated: the std has ε = 1e-4 under the square root (theirs has none; a
constant column otherwise gives a NaN gradient); their client optimiser is SGD with momentum 0.9 and batch 128:
``configs/feduv.yaml`` uses momentum 0.9, and the comparison tables give FedUV the setting's shared batch size
(10: mnist5k clients hold ~190 training samples, and batch 128 with drop_last would leave one step an epoch)
with the momentum in its tuning grid.
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
from torch.utils.hooks import RemovableHandle

from fedapps.client import ops
from fedapps.client.registry import client_op
from fedapps.models import classifier_name
from fedapps.params import param
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import FedAvg

TRAIN_OP = "feduv-train"  # the client operation: FedAvg's local training with the two terms
MU_V = "feduv_mu_v"  # settings of the train section (train.feduv_*: other training terms still see theirs)
MU_U = "feduv_mu_u"
TEMPERATURE = "feduv_t"
FORM = "feduv_uniformity"
VARIANCE = "feduv-variance"  # reply metrics: the terms' mean over the local batches (before the coefficients)
UNIFORMITY = "feduv-uniformity"
STD_EPS = 1e-4  # ε in sqrt(Var + ε)
DEFAULT_T = 2.0  # t of the log-gaussian uniformity kernel (Wang & Isola's)
MEDIAN_RBF, LOG_GAUSSIAN = "median-rbf", "log-gaussian"  # the two forms of U (module docstring)
FORMS = (MEDIAN_RBF, LOG_GAUSSIAN)


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


def pair_sq_distances(features: Tensor) -> Tensor:
    """‖z_a − z_b‖² for the pairs a < b of the flattened rows (torch.pdist's order), without a square root, so
    identical rows have a finite gradient."""
    z = features.flatten(1)
    a, b = torch.triu_indices(z.shape[0], z.shape[0], offset=1, device=z.device)
    return (z[a] - z[b]).pow(2).sum(dim=1)


def median_rbf_uniformity(features: Tensor) -> Tensor:
    """U = mean over pairs a < b of exp(−‖z_a − z_b‖²/m), z unnormalised, m the (lower) median of the non-zero
    squared distances, not detached (the authors' form); 0 for a batch < 2, 1 when every distance is 0."""
    if features.shape[0] < 2:
        return features.sum() * 0.0
    sq = pair_sq_distances(features)
    nonzero = sq[sq > 0]
    if nonzero.numel() == 0:
        return sq.sum() * 0.0 + 1.0
    return torch.exp(-sq / torch.median(nonzero)).mean()


def log_gaussian_uniformity(features: Tensor, t: float) -> Tensor:
    """U = log of the mean over pairs a < b of exp(−t‖u_a − u_b‖²), u the ℓ2-normalised rows; 0 for a batch < 2."""
    if features.shape[0] < 2:
        return features.sum() * 0.0
    sq = pair_sq_distances(F.normalize(features.flatten(1), dim=1))
    return torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel())


def uniformity(features: Tensor, form: str = MEDIAN_RBF, t: float = DEFAULT_T) -> Tensor:
    """U in the named form (``median-rbf`` or ``log-gaussian``; ``t`` only for the latter)."""
    if form == MEDIAN_RBF:
        return median_rbf_uniformity(features)
    if form == LOG_GAUSSIAN:
        return log_gaussian_uniformity(features, t)
    raise ValueError(f"unknown FedUV uniformity form {form!r}; one of {FORMS}")


# --------------------------------------------------------------------------- client side


class FeatureTap:
    """Records the input of the model's final linear classifier on every forward pass (while in a ``with``)."""

    def __init__(self, model: nn.Module) -> None:
        self.head = model.get_submodule(classifier_name(model))
        self.features: Tensor | None = None
        self._handle: RemovableHandle | None = None

    def _record(self, _module: nn.Module, args: tuple) -> None:
        self.features = args[0]

    def __enter__(self) -> FeatureTap:
        self._handle = self.head.register_forward_pre_hook(self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._handle is not None  # set by __enter__
        self._handle.remove()
        self.features = None


def feduv_loss(
    tap: FeatureTap | None,
    mu_v: float,
    mu_u: float,
    form: str = MEDIAN_RBF,
    t: float = DEFAULT_T,
    regulariser: ops.Regulariser | None = None,
) -> tuple[ops.BatchLoss, dict[str, Tensor]]:
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
                    assert tap is not None and tap.features is not None  # checked above; recorded by m(xb)
                    u = uniformity(tap.features.float(), form, t)
                    add("uniformity", u)
                    loss = loss + mu_u * u
            add("batches", torch.ones((), device=logits.device))
        return loss + regulariser(m) if regulariser is not None else loss

    return loss_fn, sums


@client_op(TRAIN_OP, default_tag="train")
def feduv_train(w, tag: str) -> None:
    """FedAvg's local training with FedUV's terms (``train.feduv_mu_v``, ``train.feduv_mu_u``,
    ``train.feduv_uniformity``, ``train.feduv_t``);
    reports each term's mean over the batches (``feduv-variance``, ``feduv-uniformity``) when it is on."""
    section = w.request.training.section(protocol.TRAIN)
    mu_v = float(section.extra.get(MU_V, 0.0))
    mu_u = float(section.extra.get(MU_U, 0.0))
    t = float(section.extra.get(TEMPERATURE, DEFAULT_T))
    form = str(section.extra.get(FORM, MEDIAN_RBF))
    tap = FeatureTap(w.model) if mu_u > 0 else None
    loss_fn, sums = feduv_loss(tap, mu_v, mu_u, form, t, w.training_terms(section))
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
    mu_u: float = param(0.5, ge=0, help="weight of the uniformity term; 0 = off")
    uniformity: str = param(
        MEDIAN_RBF, choices=FORMS, help="median-rbf (the authors' code) | log-gaussian (our earlier spec's variant)"
    )
    t: float = param(DEFAULT_T, gt=0, help="log-gaussian only: the kernel's exp(-t·squared distance)")


class FedUV(FedAvg):
    """FedAvg aggregation; clients train with FedUV's variance and uniformity terms."""

    name = "feduv"
    needs_classifier = "reads the input of the classifier head (its uniformity term)"
    sample_privacy_refused = (
        "its variance and uniformity terms are computed over a whole minibatch, so that no "
        "sample has a gradient of its own to clip"
    )
    Params = FedUVParams
    train_op = TRAIN_OP

    def client_settings(self) -> dict[str, protocol.Section]:
        return {
            protocol.TRAIN: protocol.Section(
                extra={
                    MU_V: float(self.params.mu_v),
                    MU_U: float(self.params.mu_u),
                    FORM: str(self.params.uniformity),
                    TEMPERATURE: float(self.params.t),
                }
            )
        }

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """FedAvg's step; rounds.csv gets the clients' mean of each term (unweighted, where reported)."""
        out = super().aggregate(server_round, replies)
        for key, metric in (("feduv_variance", VARIANCE), ("feduv_uniformity", UNIFORMITY)):
            values = [float(r.metrics[metric]) for r in replies if metric in r.metrics]
            if values:
                out[key] = float(np.mean(values))
        return out
