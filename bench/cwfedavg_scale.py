"""cwFedAvg's server memory at scale: M clients (default 1,000), ResNet-18 with a 100-class head, `layers: output`.

Drives strategies.cwfedavg.CwFedAvg without Flower, as the round loop would: `aggregate` with the round's
replies, then every sampled client's personalised model (what `round_messages` puts in each message), handed
to a checksum sink and dropped.
  round 1  every client uploads, then all M personalised models are formed (the full round);
  round 2  a fraction (--rejoin) re-uploads, then that many sampled clients' models are formed.
Replies: the shared (non-class-wise) arrays come from a small pool of random float32 models generated BEFORE
measuring (excluded: in a run they are the round's replies, which Flower's Grid delivers together and the
round loop holds), the classifier rows are fresh random arrays per reply; replies are streamed to
`aggregate` (a generator, one at a time), so the measured peak is the strategy's, not the inputs'.

Memory: tracemalloc (numpy registers its buffers with it) from just before the strategy is built to the end,
peak bytes, PLUS the initial model's parameters, which torch allocated (numpy views of torch tensors are not
traced; counted by hand). Cross-check: the process's peak RSS above its RSS before the strategy was built
(VmHWM after a reset through /proc/self/clear_refs; includes the allocator's slack and whatever else the
construction loads, e.g. the synthetic federation the reply validator builds).
Reference: M full models, i.e. M × the bytes of the arrays a client uploads (the parameters, float32).
Time: perf_counter around each server step (aggregate + the personalised models), minus the time spent
generating the replies' classifier rows. BLAS pinned to one thread.
The LAST line printed is `memory_ratio=<peak / M full models> seconds=<the full round's server step>`.

    python bench/cwfedavg_scale.py                      # mix round, 1,000 clients (a few minutes)
    python bench/cwfedavg_scale.py --mix latest --clients 20   # latest keeps every client's shared arrays
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedapps.config import load_config  # noqa: E402
from fedapps.wire.protocol import ClientReply  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from strategies.cwfedavg import CwFedAvg  # noqa: E402

GiB = 2**30


def proc_kib(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM, ...) in KiB; MemAvailable comes from /proc/meminfo."""
    path = "/proc/meminfo" if field == "MemAvailable" else "/proc/self/status"
    with open(path) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class Replies:
    """Streams client replies: shared arrays from the pool, fresh random classifier rows; times the generation."""

    def __init__(
        self, pool: list[dict[str, np.ndarray]], head: dict[str, np.ndarray], n: np.ndarray, seed: int
    ) -> None:
        self.pool, self.head, self.n = pool, head, n
        self.rng = np.random.default_rng(seed)
        self.seconds = 0.0

    def __call__(self, ids: list[int]) -> Iterator[ClientReply]:
        for c in ids:
            t0 = time.perf_counter()
            arrays = dict(self.pool[c % len(self.pool)])
            for k, v in self.head.items():
                arrays[k] = v + 0.05 * self.rng.standard_normal(v.shape, dtype=np.float32)
            self.seconds += time.perf_counter() - t0
            yield ClientReply(node_id=10_000 + c, client_id=c, num_examples=int(self.n[c]), metrics={}, arrays=arrays)


def server_step(
    strategy: CwFedAvg, rnd: int, replies: Iterator[ClientReply], targets: list[int], source: Replies
) -> tuple[float, float, float]:
    """aggregate + the targets' personalised models (class-wise arrays summed into a checksum):
    (aggregate seconds, personalised-models seconds, checksum)."""
    generated = source.seconds
    t0 = time.perf_counter()
    strategy.aggregate(rnd, replies)
    t1 = time.perf_counter()
    checksum = 0.0
    for c in targets:
        model = strategy.personalised(c)
        checksum += sum(float(model[k].sum(dtype=np.float64)) for k in strategy.classwise)
        del model
    return t1 - t0 - (source.seconds - generated), time.perf_counter() - t1, checksum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--layers", default="output")
    ap.add_argument("--mix", default="round", choices=("round", "latest"))
    ap.add_argument("--rejoin", type=float, default=0.1, help="fraction of the clients replying in round 2")
    ap.add_argument("--pool", type=int, default=2, help="distinct random models the shared arrays come from")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(
        None,
        [
            "strategy.name=cwfedavg",
            "data.source=synthetic",
            f"data.synthetic_classes={args.classes}",
            "data.synthetic_shape=[3,32,32]",
            f"model.name={args.model}",
            f"data.num_clients={args.clients}",
            f"strategy.params.cwfedavg.layers={args.layers}",
            f"strategy.params.cwfedavg.mix={args.mix}",
            "strategy.params.cwfedavg.track_estimation_error=false",
            f"seed={args.seed}",
        ],
    )

    # the inputs, before measuring: a pool of models (shared arrays), the classifier template, sample counts
    probe = CwFedAvg(cfg)
    template = {k: v.copy() for k, v in probe.initial.items()}
    classwise, shared = list(probe.classwise), list(probe.shared_keys)
    del probe
    rng = np.random.default_rng(args.seed)
    pool = []
    for _ in range(args.pool):
        pool.append(
            {k: v + 0.01 * rng.standard_normal(v.shape, dtype=np.float32) for k, v in template.items() if k in shared}
        )
    n = rng.integers(100, 1000, args.clients).astype(np.int64)
    model_bytes = sum(v.nbytes for v in template.values())
    head_bytes = sum(template[k].nbytes for k in classwise)
    full = args.clients * model_bytes
    print(
        f"{args.model}, {args.classes} classes: {sum(v.size for v in template.values()) / 1e6:.2f} M parameters "
        f"({model_bytes / 2**20:.1f} MiB), class-wise ({args.layers}) {sum(template[k].size for k in classwise):,} "
        f"({head_bytes / 2**20:.3f} MiB); {args.clients} clients, mix {args.mix}"
    )
    print(f"reference: {args.clients} full models = {full / GiB:.2f} GiB")
    if args.mix == "latest":
        need = args.clients * model_bytes
        if need > 0.8 * proc_kib("MemAvailable") * 1024:
            raise SystemExit(
                f"--mix latest keeps every client's shared arrays: {need / GiB:.1f} GiB for "
                f"{args.clients} clients, more than this machine has free "
                f"({proc_kib('MemAvailable') / 2**20:.1f} GiB); use fewer --clients"
            )

    source = Replies(pool, {k: template[k] for k in classwise}, n, args.seed + 1)
    everyone = list(range(args.clients))
    rejoin = sorted(rng.choice(args.clients, max(1, int(args.rejoin * args.clients)), replace=False).tolist())
    sampled = sorted(rng.choice(args.clients, len(rejoin), replace=False).tolist())

    rss_reset = reset_peak_rss()
    rss0 = proc_kib("VmRSS")
    tracemalloc.start()
    strategy = CwFedAvg(cfg)
    torch_bytes = sum(v.nbytes for v in strategy.initial.values())  # numpy views of torch tensors: not traced
    a1, p1, sum1 = server_step(strategy, 1, source(everyone), everyone, source)
    a2, p2, sum2 = server_step(strategy, 2, source(rejoin), sampled, source)
    t1, t2 = a1 + p1, a2 + p2
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss_peak = (proc_kib("VmHWM") - rss0) * 1024 if rss_reset else None

    # a check outside the measurements: the shared arrays are the FedAvg of round 2's mixed set
    ids = np.array(rejoin if args.mix == "round" else everyone)
    k = shared[0]
    w = np.bincount(ids % len(pool), weights=n[ids].astype(np.float64), minlength=len(pool))
    expected = sum(w[i] * pool[i][k].astype(np.float64) for i in range(len(pool))) / w.sum()
    np.testing.assert_allclose(strategy.shared[k], expected, rtol=1e-5, atol=1e-6)

    peak = traced_peak + torch_bytes
    state = {
        "per-client stack": strategy.stack.nbytes(),
        "shared FedAvg arrays": sum(v.nbytes for v in strategy.shared.values()),
        "running sums (float64)": sum(v.nbytes for v in strategy.sums.values()),
    }
    print("server state after round 2: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in state.items()))
    print(
        f"round 1 ({args.clients} replies, {args.clients} personalised models): {t1:.2f} s (aggregate {a1:.2f} s, "
        f"models {p1:.2f} s); round 2 ({len(rejoin)} replies, {len(sampled)} models): {t2:.2f} s (aggregate "
        f"{a2:.2f} s, models {p2:.2f} s)   (reply generation excluded: {source.seconds:.1f} s; checksums "
        f"{sum1:.4g} {sum2:.4g})"
    )
    print(
        f"peak: traced {traced_peak / 2**20:.1f} MiB + initial model (torch) {torch_bytes / 2**20:.1f} MiB = "
        f"{peak / 2**20:.1f} MiB"
        + (
            f"; RSS peak above start {rss_peak / 2**20:.1f} MiB (ratio {rss_peak / full:.4f})"
            if rss_peak is not None
            else "; RSS peak unavailable (clear_refs refused)"
        )
    )
    print(f"memory_ratio={peak / full:.4f} seconds={t1:.2f}")
    record(
        "cwfedavg_scale",
        {"memory_ratio": round(peak / full, 4), "seconds": round(t1, 2), "peak_mib": round(peak / 2**20, 1)},
    )


if __name__ == "__main__":
    main()
