"""The bare PyTorch reference the benchmarks hold Flower against: FedAvg's client work and mean written as a plain loop.

A client's round: load the global model, evaluate it on the client's test split, train local epochs of minibatch SGD
(the optimiser the config names, the order seeded per client and round, the last incomplete minibatch dropped as the
clients drop it), evaluate again, return the state and the sample count; the server's step is the sample-weighted mean.
Shared by bench/round_overhead.py, bench/message_overhead.py and bench/gpu_check.py (on the GPU, with the clients' data
on the device from the start: the best a single process can do).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedapps.client.ops import make_optimizer
from fedapps.config import ExperimentConfig, OptimSettings

State = dict  # parameter/buffer name -> tensor


@dataclass
class Client:
    """One client's splits (on the device the loop runs on)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def on(c, device: torch.device | str) -> Client:
    """A client's splits (anything with train_x, train_y, test_x, test_y) on ``device``."""
    return Client(*(getattr(c, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")))


def evaluate(model: torch.nn.Module, c) -> None:
    """The model on one client's test split (the protocol's evaluations)."""
    model.eval()
    with torch.no_grad():
        (model(c.test_x).argmax(1) == c.test_y).float().mean()
    model.train()


def client_update(
    model: torch.nn.Module, global_state: State, c, seed: int, settings: OptimSettings, evaluations: bool = True
) -> tuple[State, int]:
    """One client's round (see the module docstring): the trained state and the client's sample count;
    ``evaluations`` False: the training alone (no evaluation before or after)."""
    model.load_state_dict(global_state)
    if evaluations:
        evaluate(model, c)
    opt = make_optimizer(model.parameters(), settings)
    g = torch.Generator().manual_seed(seed)
    n, batch = len(c.train_x), settings.batch_size
    stop = n - n % batch if settings.drop_last and n >= batch else n
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=g)
        for s in range(0, stop, batch):
            idx = order[s : s + batch]
            opt.zero_grad()
            F.cross_entropy(model(c.train_x[idx]), c.train_y[idx]).backward()
            opt.step()
    if evaluations:
        evaluate(model, c)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, n


def weighted_sum(updates: list[tuple[State, int]]) -> tuple[State, int]:
    """Σ n_i · state_i over some clients and Σ n_i: what a process contributes to the FedAvg mean."""
    total = sum(n for _, n in updates)
    return {k: sum(s[k] * float(n) for s, n in updates) for k in updates[0][0]}, total


def average(partials: list[tuple[State, int]]) -> State:
    """FedAvg's sample-weighted mean from the processes' partial sums: Σ_p S_p / Σ_p N_p."""
    total = sum(n for _, n in partials)
    return {k: sum(s[k] for s, _ in partials) / total for k in partials[0][0]}


def round_seconds(cfg: ExperimentConfig, rounds: int, device: torch.device | str) -> float:
    """Seconds per round of the config's FedAvg work (every client each round) as a bare loop in this process on
    ``device``, the mean of ``rounds`` rounds after one warm-up round (CUDA's and torch's first-use costs)."""
    import dataclasses

    from fedapps.data import get_federation
    from fedapps.models import build_model

    fed = get_federation(dataclasses.asdict(cfg.data))
    model = build_model(cfg.model.name, fed.num_classes, fed.input_shape, seed=cfg.seed).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [on(fed.client(i), device) for i in range(cfg.data.num_clients)]

    def one_round(rnd: int, state: State) -> State:
        updates = [client_update(model, state, c, rnd * 100003 + i, cfg.client) for i, c in enumerate(clients)]
        return average([weighted_sum(updates)])

    state = one_round(0, state)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rnd in range(1, rounds + 1):
        state = one_round(rnd, state)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds
