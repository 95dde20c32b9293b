"""Sample-level differential privacy of a client's local training: DP-SGD with Opacus, and the client's ledger.

While a message carries privacy settings (:class:`fedapps.wire.protocol.Privacy`, ``mode: sample``, docs/privacy.md),
every training loop the message runs on the client's private data (:func:`fedapps.client.ops.run_epochs`; loops on the
public set U are marked public) is DP-SGD: Poisson-sampled minibatches (each training sample in with probability q =
batch_size / n), each sample's
gradient clipped to L2 norm C (``privacy.max_grad_norm``), Gaussian noise N(0, σ²C²) added to their sum
(σ = ``privacy.noise_multiplier``), the result divided by the expected batch size. Opacus computes the per-sample
gradients — for a loss marked :func:`fedapps.client.ops.per_sample` (plain cross-entropy training) as the gradient of
each sample's own loss with ``torch.func`` (:func:`per_sample_gradients`, about twice as fast on the CPU), otherwise
with its hooks (:class:`opacus.grad_sample.GradSampleHooks`) — and clips and noises them
(:class:`opacus.optimizers.DPOptimizer`). A training term on the model alone (a proximal term to the received model)
touches no data: its gradient is added after the noise; a term registered without ``data_free`` is refused.

Everything the client sends afterwards is post-processing of the noisy steps, so its ε over the run is that of all
its steps: Opacus's RDP accountant over the ledger of (σ, q, steps) entries, kept in ``Context.state`` and, where the
client has a state directory (:func:`fedapps.client.worker.state_dir`), in ``<state-dir>/<client-id>.privacy.json``,
so that it survives a fresh process per message and a restarted node. A client whose ε would pass
``privacy.epsilon_budget`` refuses to train (:class:`PrivacyBudgetExhausted`: its error reply says so).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from torch import Tensor, nn

from fedapps.client import ops
from fedapps.client.registry import DATA_FREE_TERMS, ProtocolError
from fedapps.config import OptimSettings
from fedapps.wire import protocol

log = logging.getLogger("fedapps")
# Opacus's backward hooks on the first layer fire with respect to its output (the inputs need no gradient): as meant
warnings.filterwarnings(
    "ignore",
    message="Full backward hook is firing when gradients are computed with respect to module outputs",
    category=UserWarning,
)

STATE_LEDGER = "privacy-ledger"  # the Context.state entry holding the ledger (JSON text)
LEDGER_SUFFIX = ".privacy.json"  # <state-dir>/<client-id>.privacy.json
Step = tuple[float, float, int]  # (σ, q, steps): one entry of Opacus's RDP accountant history


class PrivacyError(ProtocolError):
    """The training a message asks for cannot be made differentially private here (the message says why)."""


class PrivacyBudgetExhausted(RuntimeError):
    """The client's ε would pass ``privacy.epsilon_budget``: it does not train (its message opens with
    :data:`fedapps.wire.protocol.PRIVACY_REFUSED`, which the server's records look for)."""


# --------------------------------------------------------------------------- accounting


def merged_steps(history: Iterable[Step]) -> list[Step]:
    """``history`` with the entries of one (σ, q) added up: RDP composes by adding, and k steps of one subsampled
    Gaussian cost k times one step's RDP, so the accountant's ε is the same while it evaluates the RDP series once per
    distinct (σ, q) instead of once per entry (a client enters one per round). Entries without a step are dropped;
    first appearance keeps the order."""
    total: dict[tuple[float, float], int] = {}
    for s, q, k in history:
        if int(k) > 0:
            key = (float(s), float(q))
            total[key] = total.get(key, 0) + int(k)
    return [(s, q, k) for (s, q), k in total.items()]


def epsilon(history: Iterable[Step], delta: float) -> float:
    """ε at ``delta`` of the DP-SGD steps in ``history`` (Opacus's RDP accountant); 0 without any step."""
    steps = merged_steps(history)
    if not steps:
        return 0.0
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = steps
    return float(accountant.get_epsilon(delta))


def sample_rate(n: int, batch_size: int) -> float:
    """q: the probability that a training sample is in a Poisson-sampled minibatch of expected size ``batch_size``."""
    return min(1.0, batch_size / n)


def planned_steps(n: int, settings: OptimSettings) -> int:
    """DP-SGD steps of a loop over ``n`` samples: as many per epoch as the plain loop makes (:func:`ops.batches`)."""
    b = settings.batch_size
    per_epoch = n // b if settings.drop_last and n >= b else math.ceil(n / b)
    return settings.epochs * per_epoch


def poisson_batch(n: int, q: float, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson-sampled minibatch: each of the n samples in independently with probability q."""
    return torch.nonzero(torch.rand(n, generator=generator) < q).flatten()


def model_problems(model: nn.Module) -> list[str]:
    """Why Opacus cannot give each sample its own gradient in this model (BatchNorm ...); empty when it can (the
    model is validated in training mode, the mode DP-SGD trains it in)."""
    from opacus.validators import ModuleValidator

    model.train()
    return [str(e) for e in ModuleValidator.validate(model, strict=False)]


@contextmanager
def out_of_place(model: nn.Module) -> Iterator[None]:
    """Within the block, activations that work in place (``nn.ReLU(inplace=True)``) write a new tensor instead: an
    in-place change of a module's output breaks the backward hooks that capture per-sample gradients. The values
    are the same; the flags are restored afterwards."""
    changed = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for m in changed:
        setattr(m, "inplace", False)  # noqa: B010 - nn.Module's typing has no inplace attribute to assign
    try:
        yield
    finally:
        for m in changed:
            setattr(m, "inplace", True)  # noqa: B010


def add_regulariser_gradient(model: nn.Module, params: list[nn.Parameter], regulariser: ops.Regulariser | None) -> None:
    """Add the gradient of a term on the model alone (it reads no sample) to the parameters' noisy gradients."""
    if regulariser is None:
        return
    grads = torch.autograd.grad(regulariser(model), params, allow_unused=True)
    for p, g in zip(params, grads):
        if g is not None:
            assert p.grad is not None  # the noisy step has just written every parameter's gradient
            p.grad.add_(g)


# --------------------------------------------------------------------------- the private training of one message


class PrivateTraining:
    """The DP-SGD loop of one client's message and its ledger of (σ, q, steps) so far (:mod:`fedapps.client.ops`
    runs every private loop of the message through :meth:`run`, see :func:`ops.privately`)."""

    def __init__(self, settings: protocol.Privacy, history: list[Step], client_id: int, arch: str) -> None:
        self.settings = settings
        self.history = list(history)
        self.client_id = client_id
        self.arch = arch

    def epsilon(self) -> float:
        """The client's ε so far (at ``privacy.delta``)."""
        return epsilon(self.history, self.settings.delta)

    def require_budget(self, q: float, steps: int) -> None:
        """Raise :class:`PrivacyBudgetExhausted` when ``steps`` more steps at rate q would pass the budget."""
        budget = self.settings.epsilon_budget
        if budget <= 0 or steps <= 0:
            return
        s = self.settings
        after = epsilon([*self.history, (s.noise_multiplier, q, steps)], s.delta)
        if after > budget:
            raise PrivacyBudgetExhausted(
                f"{protocol.PRIVACY_REFUSED}: client {self.client_id} is at ε = {self.epsilon():.4g} "
                f"(δ = {s.delta:g}); this message's training ({steps} DP-SGD steps at q = {q:.4g}, "
                f"σ = {s.noise_multiplier:g}) would take it to ε = {after:.4g}, "
                f"past privacy.epsilon_budget = {budget:g}, so it does not train"
            )

    def generators(
        self, generator: torch.Generator | None, device: torch.device
    ) -> tuple[torch.Generator, torch.Generator]:
        """(minibatch sampling, noise) generators: from the operating system's entropy, or, with
        ``reproducible_noise``, drawn from the message's seeded ``generator`` (torch's global one when None)."""
        noise = torch.Generator(device=device)
        if self.settings.reproducible_noise:
            seeds = torch.randint(0, 2**62, (2,), generator=generator).tolist()
            return torch.Generator().manual_seed(int(seeds[0])), noise.manual_seed(int(seeds[1]))
        return torch.Generator().manual_seed(secrets.randbits(62)), noise.manual_seed(secrets.randbits(62))

    def run(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        loss_fn: ops.BatchLoss,
        settings: OptimSettings,
        weights: Tensor | None,
        regulariser: ops.Regulariser | None,
        generator: torch.Generator | None,
    ) -> dict[str, float]:
        """DP-SGD over (x, y) (see the module docstring); returns the mean loss of the minibatches and the steps,
        and enters them in the ledger."""
        from opacus.grad_sample import GradSampleHooks
        from opacus.optimizers import DPOptimizer

        problems = model_problems(model)
        if problems:
            batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())  # noqa: SLF001 - no public base
            why = (
                " BatchNorm mixes the samples of a minibatch, so that no sample has a gradient of its own;"
                if batchnorm
                else ""
            )
            raise PrivacyError(
                f"model '{self.arch}' cannot be trained with DP-SGD (privacy.mode: sample):{why} "
                f"choose a model.name without BatchNorm (e.g. cnn, mlp). Opacus: {' '.join(problems)}"
            )
        if weights is not None:
            raise PrivacyError(
                "per-sample weights normalised over a minibatch couple its samples: DP-SGD cannot "
                "train on the client's data with them"
            )
        n, s = len(x), self.settings
        if n == 0 or settings.epochs == 0:
            return {"loss": 0.0, "steps": 0.0}
        q, steps = sample_rate(n, settings.batch_size), planned_steps(n, settings)
        self.require_budget(q, steps)
        batch_gen, noise_gen = self.generators(generator, next(model.parameters()).device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = DPOptimizer(
            ops.make_optimizer(params, settings),
            noise_multiplier=s.noise_multiplier,
            max_grad_norm=s.max_grad_norm,
            expected_batch_size=settings.batch_size,
            generator=noise_gen,
        )
        by_sample = ops.is_per_sample(loss_fn)
        hooks = None if by_sample else GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
        try:
            with out_of_place(model):
                loss = dp_sgd(
                    model,
                    x,
                    y,
                    per_sample_gradients(model, loss_fn) if by_sample else hooked_gradients(model, loss_fn),
                    optimizer,
                    steps,
                    lambda: poisson_batch(n, q, batch_gen),
                    regulariser,
                    settings.clip_norm,
                )
        finally:
            if hooks is not None:
                hooks.cleanup()
            for p in params:
                p.grad = None
                if hasattr(p, "summed_grad"):
                    del p.summed_grad
        self.history.append((s.noise_multiplier, q, steps))
        return {"loss": loss, "steps": float(steps)}


GradientsOf = Callable[[Tensor, Tensor], Tensor]  # (x, y) of a minibatch -> its mean loss; p.grad_sample set


def hooked_gradients(model: nn.Module, loss_fn: ops.BatchLoss) -> GradientsOf:
    """Per-sample gradients by backpropagating the minibatch's loss through a model carrying Opacus's
    ``GradSampleHooks`` (which fill ``p.grad_sample``): any loss the hooks' layers cover."""

    def gradients(xb: Tensor, yb: Tensor) -> Tensor:
        loss = loss_fn(model, xb, yb, None)
        loss.backward()
        return loss.detach()

    return gradients


def per_sample_gradients(model: nn.Module, loss_fn: ops.BatchLoss) -> GradientsOf:
    """Per-sample gradients as the gradient of each sample's own loss (``loss_fn`` on a minibatch of that one sample),
    vectorised over the minibatch with ``torch.func``: for a loss marked :func:`fedapps.client.ops.per_sample` this is
    what the hooks compute (the gradient of the mean loss times the batch size, split by sample), without a hook per
    layer. Dropout draws a mask per sample, as in a minibatch. Sets ``p.grad_sample`` [B, *p.shape] on every
    trainable parameter; returns the minibatch's mean loss."""
    from torch.func import functional_call, grad_and_value, vmap

    named = dict(model.named_parameters())
    # detached views of the parameters and buffers: the optimiser's in-place steps show through them
    trainable = {name: p.detach() for name, p in named.items() if p.requires_grad}
    fixed = {name: p.detach() for name, p in named.items() if not p.requires_grad} | dict(model.named_buffers())

    def sample_loss(values: dict[str, Tensor], x1: Tensor, y1: Tensor) -> Tensor:
        def call(inputs: Tensor) -> Tensor:
            return functional_call(model, (values, fixed), (inputs,))

        return loss_fn(call, x1.unsqueeze(0), y1.unsqueeze(0), None)  # type: ignore[arg-type]

    per_sample = vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0), randomness="different")

    def gradients(xb: Tensor, yb: Tensor) -> Tensor:
        grads, losses = per_sample(trainable, xb, yb)
        for name, g in grads.items():
            setattr(named[name], "grad_sample", g)  # noqa: B010 - Opacus reads this attribute
        return losses.mean()

    return gradients


def dp_sgd(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    gradients: GradientsOf,
    optimizer: Any,
    steps: int,
    draw: Callable[[], Tensor],
    regulariser: ops.Regulariser | None = None,
    clip_norm: float = 0.0,
) -> float:
    """``steps`` DP-SGD steps with Opacus's ``DPOptimizer``: the minibatch ``draw()`` returns, its per-sample
    gradients from ``gradients`` (:func:`hooked_gradients` or :func:`per_sample_gradients`), each clipped, summed,
    noised and scaled by the optimizer, then the gradient of ``regulariser`` (on the model alone) added and the
    whole clipped at ``clip_norm`` (> 0; post-processing) before the step. Returns the mean minibatch loss."""
    device = next(model.parameters()).device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    model.train()
    total, batches = torch.zeros((), device=device), 0
    for _ in range(steps):
        ops.check_cancelled()
        idx = draw()
        optimizer.zero_grad(set_to_none=True)
        if len(idx):
            total += gradients(x[idx].to(device), y[idx].to(device))
            batches += 1
        else:  # an empty minibatch: the step is the noise alone
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)
        if optimizer.pre_step():  # each sample's gradient clipped, summed, noised, divided by the expected batch size
            add_regulariser_gradient(model, params, regulariser)
            if clip_norm > 0:
                nn.utils.clip_grad_norm_(params, clip_norm)
            optimizer.original_optimizer.step()
    return float(total) / max(batches, 1)


def refuse_data_terms(names: Iterable[str]) -> None:
    """While DP-SGD runs on this thread, a training term that reads the client's data (one not registered
    ``data_free``) is refused: its gradient would carry the data without clipping or noise."""
    if ops.private_loop() is None:
        return
    reading = sorted(set(names) - DATA_FREE_TERMS)
    if reading:
        raise PrivacyError(
            f"the training term(s) {reading} read the client's data outside the per-sample gradients, "
            "which DP-SGD (privacy.mode: sample) cannot cover; switch them off for a private run"
        )


# --------------------------------------------------------------------------- the ledger across messages


def ledger_path(directory: Path, client_id: int) -> Path:
    return directory / f"{int(client_id)}{LEDGER_SUFFIX}"


def load_ledger(context: Context, directory: Path | None, client_id: int, run: str) -> list[Step]:
    """The client's (σ, q, steps) entries of this run (state-run token ``run``): from ``Context.state``, else from its
    state directory (a fresh process, a restarted node); empty when neither has one of this run."""
    doc: Any = None
    if STATE_LEDGER in context.state:
        doc = json.loads(str(context.state[STATE_LEDGER]["ledger"]))
    elif directory is not None:
        try:
            doc = json.loads(ledger_path(directory, client_id).read_text())
        except FileNotFoundError:
            doc = None
        except (OSError, ValueError) as exc:
            raise ProtocolError(
                f"client {client_id}: the privacy ledger {ledger_path(directory, client_id)} cannot be "
                f"read ({exc}); without it the client's ε is unknown, so it does not train"
            ) from exc
    if not isinstance(doc, dict) or doc.get("run") != run:
        return []
    return [(float(s), float(q), int(k)) for s, q, k in doc["history"]]


def save_ledger(
    context: Context, directory: Path | None, client_id: int, run: str, history: list[Step], node_dir: bool
) -> None:
    """Keep the ledger in ``Context.state`` and, where there is a state directory, in its file (written atomically).
    A node's own directory that cannot be written is an error (its ε would be forgotten on a restart); the run
    folder of the server's machine may not exist on this node (a warning, as for the private model)."""
    text = json.dumps({"run": run, "client": int(client_id), "history": [list(h) for h in history]})
    context.state[STATE_LEDGER] = ConfigRecord({"ledger": text})
    if directory is None:
        return
    path = ledger_path(directory, client_id)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        if node_dir:
            raise ProtocolError(
                f"client {client_id}: cannot write the privacy ledger to {path} "
                f"({exc.strerror or exc}); give the node a writable state-dir"
            ) from exc
        log.warning(
            "client %d: the privacy ledger cannot be written to %s (%s); it stays in memory only",
            client_id,
            path,
            exc.strerror or exc,
        )


@dataclass
class PrivateSession:
    """Differential privacy for one message: its DP-SGD loop (:attr:`training`) and where its ledger is kept."""

    training: PrivateTraining
    context: Context
    directory: Path | None
    run: str
    node_dir: bool

    def commit(self) -> float:
        """The message succeeded (its reply goes out): keep the ledger; the client's ε so far."""
        t = self.training
        save_ledger(self.context, self.directory, t.client_id, self.run, t.history, self.node_dir)
        return t.epsilon()


def start(
    request: protocol.Request, context: Context, client_id: int, arch: str, directory: Path | None, node_dir: bool
) -> PrivateSession | None:
    """The message's privacy session (None when it carries no privacy settings: off), its ledger loaded (the ledger
    of the run named by the message's ``state-run`` token)."""
    settings = request.privacy
    if settings is None:
        return None
    run = str(request.bookkeeping.state_run or "")
    history = load_ledger(context, directory, client_id, run)
    return PrivateSession(PrivateTraining(settings, history, client_id, arch), context, directory, run, node_dir)
