"""What a client message costs beyond its work, on a workload that is nearly all overhead: a tiny model, many clients.

FedAvg with 50 clients on scikit-learn's 8×8 digits (IID), the zoo's smallest model (``mlp``: 64-200-200-10; the zoo has
no logistic regression, and one child-less model would not fit the strategies that split a body from a head), one
local epoch of batch-10 SGD, 10 measured rounds, each client's message: evaluate the previous global model, train,
evaluate the trained model, send the model back; then the mean. It runs
  (a) through `fedapps run` (`flwr run` on Flower's Ray engine) with ``--workers`` client workers (default 1) of one
      torch thread each, plus a warm-up round before the measured ones (Ray start-up, actors, data) and a closing
      round after them (it also carries the evaluation-only message), neither counted, and
  (b) as a bare PyTorch loop in this process on one thread (bench/bareloop.py), the same clients' same work, data
      and model built and one round run before the timer.
``message_overhead_ms`` = (Flower's worker time per message - the bare loop's time per message), where Flower's worker
time per message is workers x the measured rounds' wall / messages. The Flower run's own breakdown splits it: on the
client (the phases of :class:`fedapps.wire.protocol.MessageProfile` beyond training and evaluation) and beyond the
client (Ray's transport, Flower's queues and polling, the ServerApp's step between rounds), with the CPU seconds per
message of each process role over the measured rounds (bench/proctree.py). Last line:
``message_overhead_ms=<ms> target_ms=5``.

    python bench/message_overhead.py
    python bench/message_overhead.py --clients 10 --rounds 3 --engine inprocess   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bareloop import round_seconds  # noqa: E402
from fedapps.config import config_from_dict  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from fedrun import PHASES, breakdown, fedapps_run  # noqa: E402

TARGET_MS = 5.0
MODEL = "mlp"
COMPUTE = ("train", "evaluate")  # the phases the bare loop does too


def experiment_config(clients: int, rounds: int) -> dict:
    """The FedAvg run (the bare loop reads the same data and model from it)."""
    return {
        "run_name": "message-overhead",
        "seed": 0,
        "rounds": rounds,
        "strategy": {"name": "fedavg", "min_clients": 1},
        "data": {"source": "digits", "partition": "iid", "num_clients": clients},
        "model": {"name": MODEL},
        "client": {"epochs": 1, "batch_size": 10, "lr": 0.05, "optimizer": "sgd", "device": "cpu"},
    }


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds")
    ap.add_argument("--workers", type=int, default=1, help="Flower's client workers (one torch thread each)")
    ap.add_argument("--engine", choices=("flower", "inprocess"), default="flower")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedapps-message-overhead-") as tmp:
        run = fedapps_run(
            experiment_config(args.clients, args.rounds + 2),
            Path(tmp),
            args.engine,
            args.workers,
            threads=1,
            sample_cpu=args.engine == "flower",
        )
    b = breakdown(run.measured(), run.workers, run.measured_span())
    torch.set_num_threads(1)
    bare = args.rounds * round_seconds(
        config_from_dict(experiment_config(args.clients, args.rounds)), args.rounds, "cpu"
    )
    messages = args.clients * args.rounds
    bare_ms = 1000.0 * bare / messages
    overhead = b.worker - bare_ms
    wall = run.measured_span() or sum(float(r["wall_seconds"]) for r in run.measured())
    print(
        f"flower: {wall:.2f} s for {args.rounds} rounds x {args.clients} clients ({args.engine} engine, {run.workers} "
        f"worker(s) x 1 thread): {b.worker:.2f} ms of worker time per message ({b.messages} messages answered)"
    )
    print(f"bare:   {bare:.2f} s for the same work on 1 thread: {bare_ms:.2f} ms per message")
    print(
        f"per message on the client: {b.client:.2f} ms = "
        + " + ".join(f"{name} {b.phases[name]:.2f}" for name in PHASES if b.phases[name] >= 0.005)
        + f" + unattributed {b.unattributed:.2f}; beyond the client: {b.framework:.2f} ms = the rest of the "
        f"exchange (Ray's and Flower's delivery of message and reply, queues, polling) {b.exchange:.2f} + the server's "
        f"steps in the round {b.server:.2f} + between rounds {b.between:.2f}"
    )
    compute = sum(b.phases[name] for name in COMPUTE)
    print(
        f"the overhead: on the client beyond training and evaluation {b.client - compute:.2f} ms, the client's "
        f"training and evaluation beyond the bare loop's {compute - bare_ms:+.2f} ms, beyond the client "
        f"{b.framework:.2f} ms"
    )
    if run.cpu:
        print(
            f"CPU ms per message by process over the measured rounds ({run.cpu_wall:.2f} s wall): "
            + "  ".join(
                f"{role} {1000 * sec / messages:.2f}" for role, sec in sorted(run.cpu.items(), key=lambda kv: -kv[1])
            )
        )
    print(f"message_overhead_ms={overhead:.2f} target_ms={TARGET_MS:g}")
    record(
        "message_overhead",
        {
            "message_overhead_ms": round(overhead, 2),
            "flower_ms_per_message": round(b.worker, 2),
            "bare_ms_per_message": round(bare_ms, 2),
            "client_ms_per_message": round(b.client, 2),
            "beyond_client_ms_per_message": round(b.framework, 2),
            "exchange_ms_per_message": round(b.exchange, 2),
            "server_ms_per_message": round(b.server, 2),
            "between_rounds_ms_per_message": round(b.between, 2),
        },
    )
    return overhead


if __name__ == "__main__":
    main()
