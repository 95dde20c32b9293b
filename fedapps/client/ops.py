"""The common client operations on in-memory tensors: train, distill, predict, evaluate, and their losses.

All loops share :func:`run_epochs`; the operations differ only in the loss they hand it. Loss terms that
belong to one algorithm live in that algorithm's module and reach ``train`` as a ``Regulariser`` and ``distill`` as
a ``DistillTerm``. While differential privacy is on for the message served on a thread (:func:`privately`), every
loop on the client's private data runs as DP-SGD (:mod:`fedapps.client.privacy`); loops on the public set U say so
(``public``) and run as usual.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedapps.client.phases import timed
from fedapps.client.resident import on_device
from fedapps.config import OptimSettings

Regulariser = Callable[[nn.Module], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]  # a caller's own optimiser, made per loop
DistillTerm = Callable[[nn.Module, Tensor, Tensor, Tensor | None], Tensor]  # (model, x, logits, weights) -> loss
BatchLoss = Callable[[nn.Module, Tensor, Tensor, Tensor | None], Tensor]
PER_SAMPLE = "fedapps_per_sample"  # the attribute per_sample() sets on a BatchLoss


def per_sample(loss_fn: BatchLoss) -> BatchLoss:
    """Mark ``loss_fn`` as the mean over the minibatch of each sample's own loss, reading the model only by calling
    it on the inputs: DP-SGD may then take each sample's gradient from the loss of that sample alone
    (:func:`fedapps.client.privacy.per_sample_gradients`) instead of Opacus's hooks. An unmarked loss gets the hooks."""
    setattr(loss_fn, PER_SAMPLE, True)
    return loss_fn


def is_per_sample(loss_fn: BatchLoss) -> bool:
    return getattr(loss_fn, PER_SAMPLE, False) is True


class Cancelled(RuntimeError):
    """The message being served on this thread was abandoned (its deadline passed, or the run was interrupted)."""


_CANCEL = threading.local()  # the event that abandons the message served on this thread (see cancel_when)


@contextmanager
def cancel_when(event: threading.Event) -> Iterator[None]:
    """Within the block, on this thread, the training loop stops at its next minibatch (:class:`Cancelled`) once
    ``event`` is set: how the in-process engine pre-empts a client that runs past its deadline."""
    previous = getattr(_CANCEL, "event", None)
    _CANCEL.event = event
    try:
        yield
    finally:
        _CANCEL.event = previous


def check_cancelled() -> None:
    """Raise :class:`Cancelled` if the message served on this thread was abandoned (a no-op elsewhere)."""
    event = getattr(_CANCEL, "event", None)
    if event is not None and event.is_set():
        raise Cancelled("the message was abandoned (deadline passed or run interrupted)")


class PrivateLoop(Protocol):
    """What runs the training loops on the client's private data while differential privacy is on
    (:class:`fedapps.client.privacy.PrivateTraining`)."""

    def run(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        loss_fn: BatchLoss,
        settings: OptimSettings,
        weights: Tensor | None,
        regulariser: Regulariser | None,
        generator: torch.Generator | None,
    ) -> dict[str, float]: ...


_PRIVATE = threading.local()  # the private loop of the message served on this thread (see privately)


@contextmanager
def privately(loop: PrivateLoop | None) -> Iterator[None]:
    """Within the block, on this thread, every :func:`run_epochs` on data not marked public runs through ``loop``
    (DP-SGD); None: as usual."""
    previous = getattr(_PRIVATE, "loop", None)
    _PRIVATE.loop = loop
    try:
        yield
    finally:
        _PRIVATE.loop = previous


def private_loop() -> PrivateLoop | None:
    """The private loop in force on this thread (:func:`privately`), or None."""
    return getattr(_PRIVATE, "loop", None)


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("client.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def make_optimizer(params, s: OptimSettings) -> torch.optim.Optimizer:
    """SGD or Adam with the given settings."""
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)
    raise ValueError(f"unknown optimizer '{s.optimizer}'; allowed: sgd, adam")


def batches(
    n: int, batch_size: int, shuffle: bool, drop_last: bool, generator: torch.Generator | None
) -> Iterator[Tensor]:
    """Index batches over n samples (a DataLoader without the process overhead)."""
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - (n % batch_size) if drop_last and n >= batch_size else n
    for start in range(0, stop, batch_size):
        yield order[start : start + batch_size]


@timed("train")
def run_epochs(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: BatchLoss,
    settings: OptimSettings,
    weights: Tensor | None = None,
    generator: torch.Generator | None = None,
    regulariser: Regulariser | None = None,
    public: bool = False,
    optimizer: OptimizerFactory | None = None,
) -> dict[str, float]:
    """The one training loop: shuffled minibatches of (x, y[, weights]) through ``loss_fn`` (+ ``regulariser``, a
    term on the model alone); returns mean loss. Under :func:`privately`, a loop on data that is not ``public`` (the
    client's own) is the private loop's (DP-SGD). The minibatches are taken from the data's copy on the model's device
    (:mod:`fedapps.client.resident`). ``optimizer``: builds the loop's optimiser from the trainable parameters
    (a user's own, in the drop-in client helpers); None: :func:`make_optimizer` from ``settings``."""
    loop = None if public else private_loop()
    if loop is not None:
        return loop.run(model, x, y, loss_fn, settings, weights, regulariser, generator)
    device = next(model.parameters()).device
    x, y = on_device(x, device), on_device(y, device)
    weights = on_device(weights, device) if weights is not None else None
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen parts stay as they are
    opt = optimizer(trainable) if optimizer is not None else make_optimizer(trainable, settings)
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())  # noqa: SLF001 - no public base class
    total, steps = torch.zeros((), device=device), 0  # summed on the device: no host sync per step
    use_bf16 = settings.mixed_precision and device.type == "cuda"
    for _ in range(settings.epochs):
        for idx in batches(len(x), settings.batch_size, True, settings.drop_last, generator):
            check_cancelled()
            if has_batchnorm and len(idx) < 2:
                continue  # BatchNorm cannot train on a single sample
            xb, yb = x[idx], y[idx]
            wb = weights[idx] if weights is not None else None
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext():
                loss = loss_fn(model, xb, yb, wb)
                if regulariser is not None:
                    loss = loss + regulariser(model)
            loss.backward()
            if settings.clip_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), settings.clip_norm)
            opt.step()
            total += loss.detach()
            steps += 1
    return {"loss": float(total) / max(steps, 1), "steps": float(steps)}


# --------------------------------------------------------------------------- losses and regularisers


@contextmanager
def frozen(model: nn.Module, names: set[str]) -> Iterator[None]:
    """Within the block, the named parameters get no gradient (and so no update); restored afterwards."""
    params = [p for n, p in model.named_parameters() if n in names and p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def kl_to_targets(logits: Tensor, target_probs: Tensor, sample_weights: Tensor | None = None) -> Tensor:
    """KL(target ‖ softmax(logits)) per sample, averaged (weighted when weights are given; 'batchmean')."""
    log_q = F.log_softmax(logits, dim=-1)
    per_sample = (target_probs * (torch.log(target_probs.clamp_min(1e-12)) - log_q)).sum(dim=-1)
    return weighted_mean(per_sample, sample_weights)


def weighted_mean(values: Tensor, weights: Tensor | None) -> Tensor:
    """Mean of per-sample values; with weights, normalised by the weights' sum in the batch."""
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


# --------------------------------------------------------------------------- operations


def train(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    settings: OptimSettings,
    regulariser: Regulariser | None = None,
    generator: torch.Generator | None = None,
    public: bool = False,
) -> dict[str, float]:
    """Supervised training with cross-entropy (+ an optional regulariser on the model); ``public``: (x, y) is not
    the client's own data (see :func:`run_epochs`)."""

    @per_sample
    def loss_fn(m: nn.Module, xb: Tensor, yb: Tensor, _w: Tensor | None) -> Tensor:
        return F.cross_entropy(m(xb), yb)

    return run_epochs(model, x, y, loss_fn, settings, generator=generator, regulariser=regulariser, public=public)


@dataclass
class DistillSettings:
    """How to fit the public set U towards server targets."""

    loss: str = "kl"  # kl: KL(target‖model) on probabilities; mae: L1 on logits; ce: cross-entropy on hard labels


def distill(
    model: nn.Module,
    x: Tensor,
    targets: Tensor,
    optim: OptimSettings,
    settings: DistillSettings,
    sample_weights: Tensor | None = None,
    generator: torch.Generator | None = None,
    term: DistillTerm | None = None,
    optimizer: OptimizerFactory | None = None,
) -> dict[str, float]:
    """Fit the model on U towards targets (probabilities, logits or hard labels) with optional weights; ``term``
    (an algorithm's own loss term on the minibatch and its logits) is added to every minibatch's loss. U is public:
    the loop runs as usual under :func:`privately`. ``optimizer``: see :func:`run_epochs`."""
    if settings.loss not in ("kl", "mae", "ce"):
        raise ValueError(f"unknown distillation loss '{settings.loss}'; allowed: kl, mae, ce")

    def loss_fn(m: nn.Module, xb: Tensor, tb: Tensor, wb: Tensor | None) -> Tensor:
        logits = m(xb)
        if settings.loss == "kl":
            loss = kl_to_targets(logits, tb, wb)
        elif settings.loss == "mae":
            loss = weighted_mean((logits - tb).abs().mean(dim=-1), wb)
        else:
            loss = weighted_mean(F.cross_entropy(logits, tb, reduction="none"), wb)
        if term is not None:
            loss = loss + term(m, xb, logits, wb)
        return loss

    return run_epochs(
        model, x, targets, loss_fn, optim, weights=sample_weights, generator=generator, public=True, optimizer=optimizer
    )


@torch.no_grad()
def logits_of(model: nn.Module, x: Tensor, batch_size: int = 256) -> Tensor:
    """The model's logits on x in eval mode, batch by batch (from x's copy on the model's device), on the CPU (what
    :func:`predict` and :func:`evaluate` share)."""
    device = next(model.parameters()).device
    model.eval()
    x = on_device(x, device)
    outs = [model(x[i : i + batch_size]).float().cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(outs) if outs else torch.zeros((0, 0))


@timed("predict")
def predict(model: nn.Module, x: Tensor, batch_size: int = 256, output: str = "probs") -> Tensor:
    """Model outputs on x: 'probs' (softmax), 'logits' or 'labels' (argmax); returned on the CPU."""
    logits = logits_of(model, x, batch_size)
    if output == "logits":
        return logits
    if output == "probs":
        return F.softmax(logits, dim=-1)
    if output == "labels":
        return logits.argmax(dim=-1)
    raise ValueError(f"unknown prediction output '{output}'; allowed: probs, logits, labels")


def losses_of(model: nn.Module, states: list[dict[str, Tensor]], x: Tensor, y: Tensor) -> list[float]:
    """Mean cross-entropy on (x, y) of each model state, loaded in turn into ``model`` (the last stays loaded)."""
    losses = []
    for state in states:
        model.load_state_dict(state, strict=True)
        losses.append(evaluate(model, x, y)["loss"])
    return losses


@timed("evaluate")
@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 256) -> dict[str, float]:
    """Accuracy, mean cross-entropy and sample count on (x, y)."""
    if len(x) == 0:
        return {"acc": 0.0, "loss": 0.0, "n": 0.0, "correct": 0.0}
    logits = logits_of(model, x, batch_size)
    loss = F.cross_entropy(logits, y.cpu()).item()
    correct = (logits.argmax(dim=-1) == y.cpu()).sum().item()
    return {
        "acc": correct / len(x),
        "loss": loss if math.isfinite(loss) else 1e9,
        "n": float(len(x)),
        "correct": float(correct),
    }
