"""The training path of the in-process engine against a bare sequential PyTorch loop, measured in one run.

FedAvg on the default split (configs/default.yaml: mnist5k, pathological, 20 clients, partition seed 1, the 4-layer
CNN, 1 local epoch of batch-10 SGD at lr 0.05, the last incomplete minibatch dropped) with ``evaluate_every`` past
the last round, so that no round but the last evaluates anything:
  (a) the in-process engine (``server_app.run_experiment`` on ``InProcessGrid``, one client at a time, 1 torch
      thread): messages built, arrays encoded and decoded, the client's worker (data lookup, model load, training,
      reply), reply validation, the mean, rounds.csv and the checkpoint written — everything a round does;
  (b) a bare sequential loop in this process, 1 torch thread, the same clients' training splits preloaded as
      tensors, the same model, batch, epochs and optimiser: per client load the global state, train, keep the state;
      then the sample-weighted mean (bench/bareloop.py without its evaluations).
Both run ``--rounds`` rounds; (a) is timed from the end of round 1 (data loading, model building and torch's first-use
costs land there) to the end of round R − 1 (round R carries the closing evaluation), (b) after one warm-up round for
R − 2 rounds. Last line: ``ratio=<engine/bare> engine_s_per_round=<s> bare_s_per_round=<s>`` (goal: ratio <= 1.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bareloop import average, client_update, on, weighted_sum  # noqa: E402
from fedapps.config import load_config  # noqa: E402
from fedapps.data import get_federation  # noqa: E402
from fedapps.models import build_model  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402

CONFIG = ROOT / "configs" / "default.yaml"


def overrides(rounds: int) -> str:
    """FedAvg on the default split, nothing evaluated before the last round, on the CPU."""
    return f"strategy.name=fedavg rounds={rounds} evaluate_every={rounds + 1} client.device=cpu"


def engine_seconds(rounds: int) -> float:
    """Seconds per round of the in-process engine, one client at a time, over rounds 2 .. R − 1 (from the end of
    round 1 to the end of round R − 1: every step of a round, the results and checkpoint written included)."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    cfg = load_config(CONFIG, overrides(rounds))
    ends: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        server_app.run_experiment(
            InProcessGrid(cfg.data.num_clients, workers=1),
            str(CONFIG),
            overrides(rounds),
            tmp,
            after_round=lambda _rnd: ends.append(time.perf_counter()),
        )
    torch.set_num_threads(1)  # the run sets the server's threads (1): as the bare loop below
    return (ends[rounds - 2] - ends[0]) / (rounds - 2)


def bare_seconds(rounds: int) -> float:
    """Seconds per round of the same training as a bare sequential loop (1 thread), after one warm-up round."""
    cfg = load_config(CONFIG, overrides(rounds))
    fed = get_federation(dataclasses.asdict(cfg.data))
    model = build_model(cfg.model.name, fed.num_classes, fed.input_shape, seed=cfg.seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [on(fed.client(i), "cpu") for i in range(cfg.data.num_clients)]

    def one_round(rnd: int, state: dict) -> dict:
        updates = [
            client_update(model, state, c, rnd * 100003 + i, cfg.client, evaluations=False)
            for i, c in enumerate(clients)
        ]
        return average([weighted_sum(updates)])

    state = one_round(0, state)
    t0 = time.perf_counter()
    for rnd in range(1, rounds - 1):
        state = one_round(rnd, state)
    return (time.perf_counter() - t0) / (rounds - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each run (>= 3; default 8)")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (round 1 is the warm-up, round R carries the closing evaluation)")
    os.environ["FEDAPPS_CLIENT_THREADS"] = "1"
    torch.set_num_threads(1)
    engine = engine_seconds(args.rounds)
    bare = bare_seconds(args.rounds)
    print(f"engine: {engine:.3f} s per round (in-process, 1 client at a time, 1 thread; {args.rounds - 2} rounds)")
    print(f"bare:   {bare:.3f} s per round (sequential PyTorch loop, 1 thread, preloaded tensors)")
    print(f"ratio={engine / bare:.3f} engine_s_per_round={engine:.3f} bare_s_per_round={bare:.3f}")
    record(
        "training_path",
        {
            "ratio": round(engine / bare, 3),
            "engine_s_per_round": round(engine, 3),
            "bare_s_per_round": round(bare, 3),
            "rounds_timed": args.rounds - 2,
        },
    )


if __name__ == "__main__":
    main()
