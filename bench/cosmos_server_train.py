"""Benchmark: one COSMOS server distillation epoch through our code path against a bare PyTorch loop.

Ours: ``fedapps.client.ops.distill`` (the loop every client and the server use) with KL(target‖h) + λ·r_B, Adam,
gradient clipping at 1.0, batch 32 — exactly what ``strategies/cosmos.py`` runs per cluster. Bare: the same
computation written inline (index batches, forward, KL 'batchmean', r_B with a no-grad noisy branch, backward,
clip, step). Same model initialisation, same U (the public set of configs/cosmos.yaml), same targets; the two
are interleaved and the best of --repeats is kept for each, so a busy CPU hurts both alike.

    python bench/cosmos_server_train.py [--model cnn] [--threads 2] [--repeats 3]

Last line: throughput_ratio=<ours/bare> (samples per second; target ≥ 0.9).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedapps.client import ops
from fedapps.config import load_config
from fedapps.data import get_federation
from fedapps.models import build_model
from fedapps_tools.benchrecord import record
from strategies.cosmos import rb_term

LAMBDA, SIGMA, BATCH, LR, CLIP = 5.0, 0.05, 32, 1e-3, 1.0


def ours(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor) -> float:
    """One epoch through fedapps.client.ops.distill (KL + COSMOS's λ·r_B term); returns seconds."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    ops.distill(
        model,
        x,
        targets,
        ops.OptimSettings(epochs=1, batch_size=BATCH, lr=LR, optimizer="adam", clip_norm=CLIP, drop_last=False),
        ops.DistillSettings(loss="kl"),
        generator=gen,
        term=rb_term(LAMBDA, SIGMA, gen),
    )
    return time.perf_counter() - t0


def bare(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor) -> float:
    """The same epoch as a plain PyTorch loop; returns seconds."""
    t0 = time.perf_counter()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    for start in range(0, len(x), BATCH):
        idx = order[start : start + BATCH]
        xb, tb = x[idx], targets[idx]
        opt.zero_grad(set_to_none=True)
        logits = model(xb)
        kl = F.kl_div(F.log_softmax(logits, -1), tb, reduction="batchmean")
        with torch.no_grad():
            p_noisy = F.softmax(model((xb + SIGMA * torch.randn_like(xb)).clamp(-1, 1)), -1)
        loss = kl + LAMBDA * F.mse_loss(F.softmax(logits, -1), p_noisy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "cosmos.yaml"))
    ap.add_argument("--model", default="cnn", help="server architecture (configs/cosmos.yaml uses cnn)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    fed = get_federation(dataclasses.asdict(cfg.data))
    x = fed.public_x
    targets = torch.softmax(2.0 * torch.randn(len(x), fed.num_classes, generator=torch.Generator().manual_seed(1)), -1)
    init = build_model(args.model, fed.num_classes, tuple(fed.input_shape), seed=0)
    print(f"model {args.model}, U = {tuple(x.shape)}, batch {BATCH}, λ = {LAMBDA}, {args.threads} threads")
    ours(copy.deepcopy(init), x[:64], targets[:64])  # warm-up both paths
    bare(copy.deepcopy(init), x[:64], targets[:64])
    t_ours, t_bare = [], []
    for _ in range(args.repeats):
        t_ours.append(ours(copy.deepcopy(init), x, targets))
        t_bare.append(bare(copy.deepcopy(init), x, targets))
    n = len(x)
    print(f"ours: {', '.join(f'{t:.2f}' for t in t_ours)} s per epoch (best {n / min(t_ours):.0f} samples/s)")
    print(f"bare: {', '.join(f'{t:.2f}' for t in t_bare)} s per epoch (best {n / min(t_bare):.0f} samples/s)")
    print(f"throughput_ratio={min(t_bare) / min(t_ours):.3f}")
    record(
        "cosmos_server_train",
        {
            "throughput_ratio": round(min(t_bare) / min(t_ours), 3),
            "ours_samples_per_second": round(n / min(t_ours)),
            "bare_samples_per_second": round(n / min(t_bare)),
        },
    )


if __name__ == "__main__":
    main()
