"""cwFedAvg server aggregation: the mixing matrix A = P Qᵀ against materialising the K class models.

Task, as the server faces it each round: from M client models (ResNet-18, 100 classes, `all` layers
class-wise) and their class distributions P, produce every client's personalised model
w_i = Σ_j p_ij Σ_l q_lj w_l and hand it to its consumer (the message builder; here a checksum sink).
  ours     A = P Qᵀ (M×M), then each chunk of clients' models = A[chunk] @ W   (strategies.cwfedavg.mix)
  K-model  the K class models G = Qᵀ W first (strategies.cwfedavg.class_models), then P[chunk] @ G
Both run on the same inputs, parameter tensor by parameter tensor (every mixing is per-parameter linear),
with the same client chunk size, in the same process. The client models W (the inputs) are generated
per tensor as seeded perturbations of one model and are excluded from both sides.

Memory: tracemalloc (numpy registers its array buffers with it), peak bytes allocated by an approach
above what was live before it started (inputs excluded), maximum over the parameter tensors.
Time: perf_counter around each approach, summed over the tensors. BLAS is pinned to one thread.
The LAST line printed is `memory_ratio=<ours/K-model> time_ratio=<ours/K-model>`.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedapps.models import build_model  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from strategies.cwfedavg import class_models, class_weights, classwise_keys, mix, mixing_matrix  # noqa: E402


def client_stack(base: np.ndarray, clients: int, seed: int) -> np.ndarray:
    """M client versions of one parameter tensor: base + small seeded uniform noise (float32)."""
    rng = np.random.default_rng(seed)
    noise = rng.random((clients,) + base.shape, dtype=np.float32)
    noise -= 0.5
    noise *= 0.02
    noise += base
    return noise


def run_ours(a: np.ndarray, w: np.ndarray, chunk: int, sink: list[float]) -> None:
    """Personalised models chunk by chunk straight from the client models through A."""
    for start in range(0, a.shape[0], chunk):
        out = mix(a[start : start + chunk], w)
        sink.append(float(out.sum(dtype=np.float64)))
        del out


def run_k_models(p: np.ndarray, q: np.ndarray, w: np.ndarray, chunk: int, sink: list[float]) -> None:
    """Materialise the K class models, then each chunk of personalised models from them."""
    g = class_models(q, w)
    for start in range(0, p.shape[0], chunk):
        out = mix(p[start : start + chunk], g)
        sink.append(float(out.sum(dtype=np.float64)))
        del out
    del g


def measure(fn, *args):
    """(result, seconds, peak bytes allocated above the level at the call) of fn(*args)."""
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - t0
    return result, seconds, tracemalloc.get_traced_memory()[1] - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--chunk", type=int, default=10, help="clients whose models are formed at once (both sides)")
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration of the class distributions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = build_model(args.model, args.classes, (3, 32, 32), seed=args.seed)
    params = dict(model.named_parameters())
    keys = classwise_keys(model, "all")
    total = sum(params[k].numel() for k in keys)
    rng = np.random.default_rng(args.seed)
    p = rng.dirichlet(np.full(args.classes, args.alpha), args.clients)
    n = rng.integers(100, 1000, args.clients).astype(np.float64)
    q = class_weights(n, p)
    print(
        f"{args.model}: {len(keys)} parameter tensors, {total / 1e6:.2f} M parameters; "
        f"{args.clients} clients x {args.classes} classes; client chunk {args.chunk}"
    )
    print(f"client models (inputs, excluded): {args.clients * total * 4 / 2**30:.2f} GiB, generated per tensor")

    tracemalloc.start()
    t_ours = t_k = 0.0
    mem_ours = mem_k = 0
    sums_ours: list[float] = []
    sums_k: list[float] = []
    t0 = time.perf_counter()
    a, t_ours, m_a = measure(mixing_matrix, p, q)  # A = P Qᵀ is part of ours (and stays live throughout)
    for i, key in enumerate(keys):
        w = client_stack(params[key].detach().numpy(), args.clients, args.seed * 1000 + i)
        _, s, m = measure(run_ours, a, w, args.chunk, sums_ours)
        t_ours, mem_ours = t_ours + s, max(mem_ours, m + m_a)
        _, s, m = measure(run_k_models, p, q, w, args.chunk, sums_k)
        t_k, mem_k = t_k + s, max(mem_k, m)
        if i == 0:  # the two approaches agree element-wise (checked outside the measurements)
            np.testing.assert_allclose(mix(a, w), mix(p, class_models(q, w)), rtol=1e-4, atol=1e-5)
        del w
    tracemalloc.stop()
    agree = np.allclose(sums_ours, sums_k, rtol=1e-4, atol=1e-3)
    print(f"checksums agree: {agree}   (wall {time.perf_counter() - t0:.1f} s including input generation)")
    print(f"ours    : {t_ours:8.2f} s  peak {mem_ours / 2**20:9.1f} MiB")
    print(
        f"K-model : {t_k:8.2f} s  peak {mem_k / 2**20:9.1f} MiB   (K class models of the largest tensor alone: "
        f"{args.classes * max(params[k].numel() for k in keys) * 4 / 2**20:.1f} MiB)"
    )
    if not agree:
        raise SystemExit("the two approaches disagree")
    print(f"memory_ratio={mem_ours / mem_k:.4f} time_ratio={t_ours / t_k:.4f}")
    record(
        "cwfedavg_mixing",
        {
            "memory_ratio": round(mem_ours / mem_k, 4),
            "time_ratio": round(t_ours / t_k, 4),
            "ours_seconds": round(t_ours, 2),
            "ours_peak_mib": round(mem_ours / 2**20, 1),
        },
    )


if __name__ == "__main__":
    main()
