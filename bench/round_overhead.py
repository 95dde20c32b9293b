"""Flower's round overhead against bare PyTorch, measured in one run.

The same FedAvg work — 20 clients, mnist5k (IID), the 4-layer CNN, 1 local epoch of batch-10 SGD,
5 rounds, each round: evaluate the global model on every client's test split (the deployed model of the round
before), train, evaluate the trained model (the after-training column), average; after the last round the global
model once more on every client (the evaluation-only message of the protocol) — runs
  (a) through `fedapps run` (`flwr run` on Flower's Ray simulation engine) with 2 single-threaded client workers,
  (b) as a bare PyTorch loop in this process with 2 intra-op threads, and
  (c) as a bare loop over 2 spawned processes of 1 thread each, the clients dealt between them: each round both
      train their clients from the global model and send back their partial sums Σ n_i·w_i, this process
      averages and sends the new global model — the best two cores can do ("bare-parallel").
The Flower run gets one extra warm-up round first: Ray start-up, actor spawn and data loading land there
and are reported separately ("startup"); the ratios compare the 5 measured rounds. The bare runs build their data
and model and warm torch up (its first optimizer imports torch._dynamo) before their timers start, as Flower's
workers do in the warm-up round. Last line: ``ratio=<flower/bare> parallel_ratio=<flower/bare-parallel>``
(targets <= 1.1 and <= 1.15).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bareloop  # noqa: E402
from bareloop import average, evaluate, weighted_sum  # noqa: E402
from fedapps.config import OptimSettings, config_from_dict  # noqa: E402
from fedapps.data import get_federation  # noqa: E402
from fedapps.models import build_model  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from proctree import CpuSampler, cpu_between  # noqa: E402

CLIENTS, ROUNDS, BATCH, LR = 20, 5, 10, 0.05
SETTINGS = OptimSettings(epochs=1, batch_size=BATCH, lr=LR, optimizer="sgd")


def experiment_config(rounds: int) -> dict:
    return {
        "run_name": "round-overhead",
        "seed": 0,
        "rounds": rounds,
        "strategy": {"name": "fedavg"},
        "data": {"source": "mnist5k", "partition": "iid", "num_clients": CLIENTS},
        "model": {"name": "cnn"},
        "client": {"epochs": 1, "batch_size": BATCH, "lr": LR, "optimizer": "sgd", "device": "cpu"},
    }


def rows_written(path: Path) -> int:
    """Rows in rounds.csv so far (the ServerApp rewrites it after every round): the sampler's progress marker."""
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def flower_seconds(workdir: Path) -> dict:
    """The Flower run: seconds of the 5 measured rounds ("rounds"), of the warm-up round ("warmup"), of the whole
    `fedapps run` ("total"), the seconds its clients spent serving the measured rounds' messages ("clients":
    rounds.csv client_seconds, the workers' own time per message from the data lookup to the reply's arrays), and
    the CPU seconds of each role of the run's process tree while the measured rounds ran ("cpu", "cpu_wall": from
    rounds.csv's first row to its last, sampled every 0.25 s)."""
    cfg_path = workdir / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump(experiment_config(ROUNDS + 1)))
    run_dir = workdir / "res" / "round-overhead"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedapps_tools.cli",
            "run",
            str(cfg_path),
            "--output-dir",
            str(workdir / "res"),
            "--cpus-per-client",
            "1",
            "--quiet",
        ],
        cwd=ROOT,
    )
    sampler = CpuSampler(proc.pid, marker=lambda: rows_written(run_dir / "rounds.csv"))
    rc = proc.wait()
    total = time.perf_counter() - t0
    sampler.stop()
    if rc != 0:
        raise SystemExit(f"`fedapps run` exited {rc}")
    with (run_dir / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    walls = [float(r["wall_seconds"]) for r in rows]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"flower: final accuracy_mean {summary['accuracy_mean']:.4f}; round walls {[f'{w:.2f}' for w in walls]}")
    cpu_wall, cpu = cpu_between(sampler.timeline, 1, ROUNDS + 1)
    return {
        "rounds": sum(walls[1:]),
        "warmup": walls[0],
        "total": total,
        "clients": sum(float(r.get("client_seconds") or 0.0) for r in rows[1:]),
        "cpu": cpu,
        "cpu_wall": cpu_wall,
    }


State = dict  # parameter/buffer name -> tensor


def bare_setup(client_ids: range | list[int]) -> tuple[list, torch.nn.Module, State]:
    """The listed clients' data and the seeded CNN every bare run starts from (built before any timer starts), warmed
    up as Flower's workers are by their warm-up round: torch's first optimizer imports torch._dynamo (~1 s) and the
    first forward/backward pass allocates, once per process; done here, outside the timed rounds."""
    cfg = config_from_dict(experiment_config(ROUNDS))
    fed = get_federation(dataclasses.asdict(cfg.data))
    model = build_model("cnn", fed.num_classes, fed.input_shape, seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    clients = [fed.client(i) for i in client_ids]
    torch.optim.SGD(model.parameters(), lr=LR).zero_grad()
    warm = fed.client(0)
    F.cross_entropy(model(warm.train_x[:BATCH]), warm.train_y[:BATCH]).backward()
    model.zero_grad(set_to_none=True)
    return clients, model, initial


def client_update(model: torch.nn.Module, global_state: State, c, client_id: int, rnd: int) -> tuple[State, int]:
    """One client's round (bench/bareloop.py): load the global model, evaluate it, train one epoch of batch-10 SGD
    (order seeded by round and client), evaluate again; the trained state and the client's sample count."""
    return bareloop.client_update(model, global_state, c, rnd * 1000 + client_id, SETTINGS)


def bare_seconds(threads: int = 2) -> float:
    """The same 5 rounds as a plain loop in this process: per client evaluate, train one epoch, evaluate; then
    average; at the end evaluate the global model on every client."""
    torch.set_num_threads(threads)
    clients, model, global_state = bare_setup(range(CLIENTS))
    t0 = time.perf_counter()
    for rnd in range(ROUNDS):
        global_state = average(
            [weighted_sum([client_update(model, global_state, c, i, rnd) for i, c in enumerate(clients)])]
        )
    model.load_state_dict(global_state)
    for c in clients:
        evaluate(model, c)
    return time.perf_counter() - t0


def to_wire(state: State) -> dict:
    return {k: v.numpy() for k, v in state.items()}


def from_wire(arrays: dict) -> State:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def parallel_worker(conn, client_ids: list[int]) -> None:
    """One process of the bare-parallel reference: 1 torch thread, its share of the clients, data and model built
    before it says ready; then per request ('round', r, global) its partial sum, ('final', global) the closing
    evaluation, ('stop',) exit."""
    torch.set_num_threads(1)
    clients, model, _ = bare_setup(client_ids)
    conn.send(("ready",))
    while True:
        request = conn.recv()
        if request[0] == "round":
            rnd, global_state = request[1], from_wire(request[2])
            state, n = weighted_sum(
                [client_update(model, global_state, c, i, rnd) for i, c in zip(client_ids, clients)]
            )
            conn.send(("partial", to_wire(state), n))
        elif request[0] == "final":
            model.load_state_dict(from_wire(request[1]))
            for c in clients:
                evaluate(model, c)
            conn.send(("done",))
        else:
            return


def run_parallel(processes: int = 2, rounds: int = ROUNDS) -> tuple[float, State]:
    """The same FedAvg work as a bare loop over ``processes`` spawned processes of 1 thread each, the clients dealt
    round-robin between them: each round every process trains its clients from the global model and returns its
    partial sum, this process averages and sends the new global model back. Returns (seconds from the first round's
    request to the closing evaluation's end, the final global state). Data and models are built before the timer."""
    ctx = mp.get_context("spawn")
    shares = [list(range(p, CLIENTS, processes)) for p in range(processes)]
    pipes, procs = [], []
    for share in shares:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=parallel_worker, args=(there, share), daemon=True)
        proc.start()
        pipes.append(here)
        procs.append(proc)
    try:
        for conn in pipes:
            if conn.recv()[0] != "ready":
                raise RuntimeError("a bare-parallel worker did not start")
        global_state = bare_setup([])[2]
        t0 = time.perf_counter()
        for rnd in range(rounds):
            for conn in pipes:
                conn.send(("round", rnd, to_wire(global_state)))
            partials = [conn.recv() for conn in pipes]
            global_state = average([(from_wire(state), n) for _, state, n in partials])
        for conn in pipes:
            conn.send(("final", to_wire(global_state)))
        for conn in pipes:
            conn.recv()
        seconds = time.perf_counter() - t0
        for conn in pipes:
            conn.send(("stop",))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return seconds, global_state


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        flower = flower_seconds(Path(tmp))
    parallel = run_parallel(2)[0]
    bare = bare_seconds(2)
    rounds = flower["rounds"]
    print(
        f"flower: {rounds:.2f} s for {ROUNDS} rounds (2 workers x 1 thread); warm-up round incl. Ray start-up "
        f"{flower['warmup']:.2f} s; whole `flwr run` {flower['total']:.2f} s"
    )
    print(f"bare:   {bare:.2f} s for {ROUNDS} rounds (1 process x 2 threads)")
    print(f"bare-parallel: {parallel:.2f} s for {ROUNDS} rounds (2 processes x 1 thread)")
    # where Flower's time goes: the 2 workers' time over the measured rounds (2 x their wall) = the clients' own time
    # serving messages (rounds.csv client_seconds: data lookup, decoding, the operations, encoding) + the rest: Ray's
    # transport of each message, Flower's queues and polling, the server step between rounds, the round's tail
    busy = flower["clients"]
    print(
        f"flower workers: 2 x {rounds:.2f} s = {2 * rounds:.2f} s, serving messages {busy:.2f} s "
        f"({100 * busy / (2 * rounds):.0f}%), between messages {2 * rounds - busy:.2f} s; bare-parallel computed "
        f"{2 * parallel:.2f} s (the workers' own time exceeds it by {busy - 2 * parallel:+.2f} s: decoding, setup, "
        f"encoding, and noise)"
    )
    # who had the two cores while the measured rounds ran: CPU seconds by process role (bench/proctree.py)
    cpu, window = flower["cpu"], flower["cpu_wall"]
    print(
        f"flower cpu over the measured rounds ({window:.2f} s wall, {2 * window:.2f} core-s): "
        + "  ".join(f"{role} {sec:.2f}" for role, sec in sorted(cpu.items(), key=lambda kv: -kv[1]))
        + f"  idle {2 * window - sum(cpu.values()):.2f}"
    )
    print(f"ratio={rounds / bare:.3f} parallel_ratio={rounds / parallel:.3f}")
    record(
        "round_overhead",
        {
            "ratio": round(rounds / bare, 3),
            "parallel_ratio": round(rounds / parallel, 3),
            "flower_seconds": round(rounds, 2),
            "bare_seconds": round(bare, 2),
            "bare_parallel_seconds": round(parallel, 2),
        },
    )


if __name__ == "__main__":
    main()
