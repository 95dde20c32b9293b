"""Formulas pinned against hand computations or a reference implementation, each written so that the mutation
named in its docstring makes it fail (checked by applying the mutation; see docs/mutation.md):

- WDR (cwFedAvg's client term) through the registered term: value (λ/2)·‖p − p̃‖₂ and its gradient;
- the distillation KL of ``fedapps.client.ops`` (COSMOS, FedMD, COMET use it) against ``torch.nn.functional.kl_div``:
  direction KL(target ‖ model) and reduction ``batchmean``, in the loss value and in the SGD step ``distill`` takes;
- FedAMP's client coefficient λ/(2α_K), from the server's message to the client's gradient;
- cwFedAvg's defaults: the paper's estimator and λ.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedapps.client import ops
from fedapps.client.registry import TRAINING_TERMS
from fedapps.config import ConfigError, OptimSettings, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.wire import protocol
from strategies import resolve
from strategies.cwfedavg import WDR_LAMBDA, CwFedAvgParams

torch.set_num_threads(1)

# --------------------------------------------------------------------------- WDR

# classifier rows with norms 5, 10, 5 -> p̃ = [0.25, 0.5, 0.25]
ROWS = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 5.0]])
COUNTS = np.array([30, 30, 0])  # the client's training class counts -> p = [0.5, 0.5, 0]


def wdr_worker(counts: np.ndarray = COUNTS) -> SimpleNamespace:
    """What the `wdr` term reads from the worker: its model, its training class counts, its id, the device."""
    model = nn.Sequential(nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight.copy_(ROWS)
        model[0].bias.zero_()
    fed = SimpleNamespace(train_counts={7: counts})
    return SimpleNamespace(model=model, fed=fed, client_id=7, device=torch.device("cpu"))


def wdr_by_hand(rows: np.ndarray, p: np.ndarray, lam: float) -> tuple[float, np.ndarray]:
    """(λ/2)·‖p̃ − p‖₂ and its gradient in the rows, with p̃_k = n_k / S, n_k = ‖w_k‖, S = Σ n:
    ∂/∂w_k = (λ/2)/(‖d‖·S) · (d_k − Σ_j d_j p̃_j) · w_k / n_k,   d = p̃ − p."""
    n = np.linalg.norm(rows, axis=1)
    s = n.sum()
    d = n / s - p
    value = 0.5 * lam * np.linalg.norm(d)
    grad = (0.5 * lam / (np.linalg.norm(d) * s)) * (d - d @ (n / s))[:, None] * rows / n[:, None]
    return value, grad


def wdr(lam: float) -> protocol.Section:
    """The train section of a message asking for WDR with λ = ``lam``."""
    return protocol.Section(extra={WDR_LAMBDA: lam})


def test_wdr_value_and_gradient_by_hand() -> None:
    """Fails when the norm is squared, or when the target is not the client's class distribution (e.g. uniform)."""
    w = wdr_worker()
    term = TRAINING_TERMS["wdr"](w, wdr(4.0))
    value = term(w.model)
    # p̃ − p = [−0.25, 0, 0.25], ‖·‖₂ = 0.25·√2; (4/2)·0.25·√2 = √2/2 (squared: 0.25; uniform target: 0.408)
    assert value.item() == pytest.approx(math.sqrt(2) / 2, rel=1e-6)
    value.backward()
    expected_value, expected_grad = wdr_by_hand(ROWS.numpy().astype(np.float64), COUNTS / COUNTS.sum(), 4.0)
    assert value.item() == pytest.approx(expected_value, rel=1e-6)
    np.testing.assert_allclose(w.model[0].weight.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-7)
    assert w.model[0].bias.grad is None  # WDR reaches the classifier weight only
    # the gradient points p̃ towards the client's p: a small step against it lowers ‖p̃ − p‖
    with torch.no_grad():
        stepped = ROWS - 0.5 * w.model[0].weight.grad
    p_step = stepped.norm(dim=1) / stepped.norm(dim=1).sum()
    assert torch.linalg.vector_norm(p_step - torch.tensor([0.5, 0.5, 0.0])) < math.sqrt(2) / 4


def test_wdr_target_is_each_clients_own_distribution() -> None:
    """Another client's counts give another value: the target is read from the client's counts, not fixed."""
    w = wdr_worker(np.array([10, 10, 20]))  # p = [0.25, 0.25, 0.5]: p̃ − p = [0, 0.25, −0.25]
    assert TRAINING_TERMS["wdr"](w, wdr(4.0))(w.model).item() == pytest.approx(math.sqrt(2) / 2, rel=1e-6)
    w = wdr_worker(np.array([1, 2, 1]))  # p = p̃: no penalty
    assert TRAINING_TERMS["wdr"](w, wdr(4.0))(w.model).item() == pytest.approx(0.0, abs=1e-7)
    assert TRAINING_TERMS["wdr"](w, wdr(0.0)) is None


# --------------------------------------------------------------------------- the distillation KL


def kl_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ softmax(logits)) averaged over the batch, as torch defines it."""
    return F.kl_div(F.log_softmax(logits, dim=-1), targets, reduction="batchmean")


def skewed_batch(seed: int = 0, rows: int = 6, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets far enough apart that KL(t‖q) and KL(q‖t) differ clearly."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, classes, generator=g)
    targets = torch.softmax(3.0 * torch.randn(rows, classes, generator=g), dim=-1)
    return logits, targets


def test_kl_to_targets_is_torch_kl_div_batchmean() -> None:
    """Fails when the direction is reversed (KL(model ‖ target)) or the reduction is a sum over the batch."""
    logits, targets = skewed_batch()
    ours, ref = ops.kl_to_targets(logits, targets), kl_reference(logits, targets)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    reverse = F.kl_div(torch.log(targets), F.log_softmax(logits, -1), reduction="batchmean", log_target=True)
    assert abs(ref.item() - reverse.item()) > 0.1  # the two directions are far apart on this batch
    # per-sample weights: Σ w_i KL_i / Σ w_i (COSMOS's weighted objective); a zero weight drops the sample
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 3.0])
    per_sample = F.kl_div(F.log_softmax(logits, -1), targets, reduction="none").sum(-1)
    assert ops.kl_to_targets(logits, targets, w).item() == pytest.approx(
        ((w * per_sample).sum() / w.sum()).item(), rel=1e-5
    )


def test_distill_takes_the_sgd_step_of_torch_kl_div() -> None:
    """``distill`` with loss 'kl' on one full batch moves the model by −lr·∇ kl_div(batchmean) and reports that loss:
    fails on a reversed direction, a sum reduction or any other loss in the loop."""
    torch.manual_seed(3)
    x = torch.randn(8, 5)
    model = nn.Linear(5, 4)
    reference = nn.Linear(5, 4)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        targets = torch.softmax(3.0 * torch.randn(8, 4), dim=-1)
    lr = 0.1
    loss = kl_reference(reference(x), targets)
    loss.backward()
    result = ops.distill(
        model, x, targets, OptimSettings(epochs=1, batch_size=8, lr=lr, drop_last=False), ops.DistillSettings(loss="kl")
    )
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(
            p.detach().numpy(), (q - lr * q.grad).detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name
        )


# --------------------------------------------------------------------------- FedAMP's coefficient


def test_fedamp_client_term_is_lambda_over_two_alpha_k_with_gradient(tiny_config) -> None:
    """From the server's message to the client's loss: (λ/(2α_K))‖w − u_i‖², gradient (λ/α_K)(w − u_i).
    Fails with the coefficient λ/2 (Ditto's) or a term computed on detached parameters."""
    from fedapps.models import build_model
    from strategies.fedamp import FedAMP

    lam, alpha_k = 0.3, 0.05
    cfg = load_config(
        tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {"alpha_k": alpha_k, "sigma": 1.0, "lam": lam}}}),
        "",
    )
    InProcessGrid(cfg.data.num_clients)  # gives Message() the run identity it needs outside Flower's runtime
    message = protocol.build_messages(FedAMP(cfg).round_messages(1, [11]))[0]
    anchor = message.content[protocol.ARRAYS].to_torch_state_dict()  # u_i (here the initial model)
    section = protocol.request_of(message).training.section(protocol.TRAIN)
    model = build_model("mlp", 10, (1, 8, 8), seed=5)  # a model away from the anchor
    term = TRAINING_TERMS["proximal"](SimpleNamespace(received=anchor, device=torch.device("cpu")), section)
    value = term(model)
    value.backward()
    diff = {n: (p.detach() - anchor[n]).double() for n, p in model.named_parameters()}
    squared = sum(float((d**2).sum()) for d in diff.values())
    assert squared > 1.0
    assert value.item() == pytest.approx(lam / (2 * alpha_k) * squared, rel=1e-5)
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        np.testing.assert_allclose(p.grad.numpy(), (lam / alpha_k * diff[n]).numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_fedamp_refuses_a_proximal_step_that_erases_the_client(tiny_config) -> None:
    """lr·λ/α_K >= 1: one SGD step on (λ/(2α_K))‖w − u‖² lands on u_i or past it — refused, naming the key, the product
    and the largest λ that passes (α_K/lr = 0.2 at lr 0.05, α_K 0.01: 0.199)."""
    fedamp = lambda lam: {"name": "fedamp", "params": {"fedamp": {"alpha_k": 0.01, "sigma": 1.0, "lam": lam}}}  # noqa: E731
    for lam in (0.2, 4.0):  # exactly 1, and 20
        with pytest.raises(
            ConfigError, match=r"strategy\.params\.fedamp\.lam.*lr·λ/α_K = (1|20) .*passes.* is 0\.199 "
        ):
            resolve(load_config(tiny_config(strategy=fedamp(lam)), ""))
    resolve(load_config(tiny_config(strategy=fedamp(0.199)), ""))  # 0.05 · 0.199 / 0.01 = 0.995


@pytest.mark.parametrize(
    "lr,alpha_k,expected", [(0.05, 0.01, 0.199), (0.01, 0.01, 0.999), (0.03, 0.01, 0.333), (0.05, 0.02, 0.399)]
)
def test_largest_passing_lambda(lr, alpha_k, expected) -> None:
    from strategies.fedamp import largest_passing_lam, step_product

    lam = largest_passing_lam(lr, alpha_k)
    assert lam == pytest.approx(expected) and step_product(lr, lam, alpha_k) < 1.0
    assert (
        step_product(lr, lam + 0.001 * 10 ** math.floor(math.log10(lam) + 1), alpha_k) >= 1.0
    )  # the next 3-digit λ fails


# --------------------------------------------------------------------------- cwFedAvg's defaults


def test_cwfedavg_defaults_are_the_papers_estimator_and_lambda() -> None:
    """The `bias` estimator is an option, not the default (docs/algorithms/cwfedavg.md); λ = 10 is the paper's MNIST
    value."""
    p = CwFedAvgParams()
    assert (p.estimator, p.wdr_lambda) == ("norm", 10.0)
    for path in ("configs/cwfedavg.yaml", "configs/default.yaml"):
        params = resolve(load_config(path, "strategy.name=cwfedavg")).params
        assert (params.estimator, params.wdr_lambda) == ("norm", 10.0), path
