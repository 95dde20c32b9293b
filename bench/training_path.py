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
Both run ``--rounds`` rounds; (a) is timed per round from the end of round 1 (data loading, model building and
torch's first-use costs land there) to the end of round R − 1 (round R carries the closing evaluation), (b) per round
after one warm-up round, once before (a) and once after it, so that a change in the machine's load during the run
touches both. The figure is the ratio of the medians of the per-round wall seconds (``ratio``); beside it the ratio
of the fastest rounds (``ratio_min``: on a busy machine the least disturbed rounds), the ratio of the medians of the
CPU seconds this process spent per round (``cpu_ratio``: what other processes on the machine change least; waiting
does not count in it) and the machine's 1-minute load average at the start and the end (``load_start``, ``load_end``:
above the number of cores, the wall-clock ratios measure the neighbours as much as the code). Last line:
``ratio=<engine/bare> ratio_min=<...> cpu_ratio=<...> engine_s_per_round=<median s> bare_s_per_round=<median s>``
(goal: ratio <= 1.1, on quiet cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
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


def engine_rounds(rounds: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of rounds 2 .. R − 1 of the in-process engine, one client at a time (from the end
    of the round before to the end of the round: every step of a round, the results and checkpoint written
    included; CPU: this process's, every thread)."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    cfg = load_config(CONFIG, overrides(rounds))
    ends: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server_app.run_experiment(
            InProcessGrid(cfg.data.num_clients, workers=1),
            str(CONFIG),
            overrides(rounds),
            tmp,
            after_round=lambda _rnd: ends.append((time.perf_counter(), time.process_time())),
        )
    torch.set_num_threads(1)  # the run set the server's threads (1): as the bare loop
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ends[: rounds - 2], ends[1 : rounds - 1])]


def bare_rounds(rounds: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of R − 2 rounds of the same training as a bare sequential loop (1 thread), after
    a warm-up round."""
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
    seconds = []
    for rnd in range(1, rounds - 1):
        t0, c0 = time.perf_counter(), time.process_time()
        state = one_round(rnd, state)
        seconds.append((time.perf_counter() - t0, time.process_time() - c0))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each run (>= 3; default 8)")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (round 1 is the warm-up, round R carries the closing evaluation)")
    os.environ["FEDAPPS_CLIENT_THREADS"] = "1"
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    bare_before = bare_rounds(args.rounds)
    engine_all = engine_rounds(args.rounds)
    bare_all = bare_before + bare_rounds(args.rounds)
    load_end = os.getloadavg()[0]
    walls = {"engine": [w for w, _ in engine_all], "bare": [w for w, _ in bare_all]}
    cpus = {"engine": [c for _, c in engine_all], "bare": [c for _, c in bare_all]}
    engine, bare = statistics.median(walls["engine"]), statistics.median(walls["bare"])
    ratio, ratio_min = engine / bare, min(walls["engine"]) / min(walls["bare"])
    cpu_ratio = statistics.median(cpus["engine"]) / statistics.median(cpus["bare"])
    for name, what in (("engine", "in-process, 1 client at a time, 1 thread"), ("bare", "loop, before and after")):
        print(
            f"{name}: wall {' '.join(f'{x:.2f}' for x in walls[name])} s per round; "
            f"cpu {' '.join(f'{x:.2f}' for x in cpus[name])} ({what})"
        )
    print(f"load average (1 min) {load_start:.1f} at the start, {load_end:.1f} at the end, on {os.cpu_count()} cores")
    print(
        f"ratio={ratio:.3f} ratio_min={ratio_min:.3f} cpu_ratio={cpu_ratio:.3f} engine_s_per_round={engine:.3f} "
        f"bare_s_per_round={bare:.3f}"
    )
    record(
        "training_path",
        {
            "ratio": round(ratio, 3),
            "ratio_min": round(ratio_min, 3),
            "cpu_ratio": round(cpu_ratio, 3),
            "engine_s_per_round": round(engine, 3),
            "bare_s_per_round": round(bare, 3),
            "rounds_timed": len(engine_all),
            "load_start": round(load_start, 1),
            "load_end": round(load_end, 1),
        },
    )


if __name__ == "__main__":
    main()
