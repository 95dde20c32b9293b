"""Flower's round overhead against bare PyTorch, measured in one run.

The same FedAvg work — 20 clients, mnist5k (IID), the 4-layer CNN, 1 local epoch of batch-10 SGD,
5 rounds, each round: evaluate the global model on every client's test split (the deployed model of the round
before), train, evaluate the trained model (the after-training column), average; after the last round the global
model once more on every client (the evaluation-only message of the protocol) — runs
  (a) through `flwr run` on Flower's Ray simulation engine with 2 single-threaded client workers, and
  (b) as a bare PyTorch loop in this process with 2 intra-op threads.
The Flower run gets one extra warm-up round first: Ray start-up, actor spawn and data loading land there
and are reported separately ("startup"); the ratio compares the 5 measured rounds. Last line:
``ratio=<flower/bare>`` (target <= 1.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import json
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

from fedapps.config import config_from_dict  # noqa: E402
from fedapps.data import get_federation  # noqa: E402
from fedapps.models import build_model  # noqa: E402

CLIENTS, ROUNDS, BATCH, LR = 20, 5, 10, 0.05


def experiment_config(rounds: int) -> dict:
    return {
        "run_name": "round-overhead", "seed": 0, "rounds": rounds,
        "strategy": {"name": "fedavg"},
        "data": {"source": "mnist5k", "partition": "iid", "num_clients": CLIENTS},
        "model": {"name": "cnn"},
        "client": {"epochs": 1, "batch_size": BATCH, "lr": LR, "optimizer": "sgd", "device": "cpu"},
    }


def flower_seconds(workdir: Path) -> tuple[float, float, float]:
    """(seconds of the 5 measured rounds, seconds of the warm-up round, end-to-end seconds of `flwr run`)."""
    cfg_path = workdir / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump(experiment_config(ROUNDS + 1)))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedapps_tools.cli", "run", str(cfg_path), "--output-dir", str(workdir / "res"),
                    "--cpus-per-client", "1", "--quiet"], cwd=ROOT, check=True)
    total = time.perf_counter() - t0
    with (workdir / "res" / "round-overhead" / "rounds.csv").open() as fh:
        walls = [float(r["wall_seconds"]) for r in csv.DictReader(fh)]
    summary = json.loads((workdir / "res" / "round-overhead" / "summary.json").read_text())
    print(f"flower: final accuracy_mean {summary['accuracy_mean']:.4f}; round walls {['%.2f' % w for w in walls]}")
    return sum(walls[1:]), walls[0], total


def bare_seconds(threads: int = 2) -> float:
    """The same 5 rounds as a plain loop: per client evaluate, train one epoch, evaluate; then average; at the
    end evaluate the global model on every client."""
    torch.set_num_threads(threads)
    cfg = config_from_dict(experiment_config(ROUNDS))
    fed = get_federation(dataclasses.asdict(cfg.data))
    clients = [fed.client(i) for i in range(CLIENTS)]
    model = build_model("cnn", fed.num_classes, fed.input_shape, seed=0)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}

    def evaluate(c) -> None:
        model.eval()
        with torch.no_grad():
            (model(c.test_x).argmax(1) == c.test_y).float().mean()
        model.train()

    t0 = time.perf_counter()
    for rnd in range(ROUNDS):
        new_states, sizes = [], []
        for i, c in enumerate(clients):
            model.load_state_dict(global_state)
            evaluate(c)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            g = torch.Generator().manual_seed(rnd * 1000 + i)
            order = torch.randperm(len(c.train_x), generator=g)
            for s in range(0, len(order) - len(order) % BATCH, BATCH):
                idx = order[s:s + BATCH]
                opt.zero_grad()
                F.cross_entropy(model(c.train_x[idx]), c.train_y[idx]).backward()
                opt.step()
            evaluate(c)
            new_states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(c.train_x))
        total = sum(sizes)
        global_state = {k: sum(s[k] * (n / total) for s, n in zip(new_states, sizes)) for k in global_state}
    model.load_state_dict(global_state)
    for c in clients:
        evaluate(c)
    return time.perf_counter() - t0


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        flower, startup, end_to_end = flower_seconds(Path(tmp))
    bare = bare_seconds(2)
    print(f"flower: {flower:.2f} s for {ROUNDS} rounds (2 workers x 1 thread); warm-up round incl. Ray start-up "
          f"{startup:.2f} s; whole `flwr run` {end_to_end:.2f} s")
    print(f"bare:   {bare:.2f} s for {ROUNDS} rounds (1 process x 2 threads)")
    print(f"ratio={flower / bare:.3f}")


if __name__ == "__main__":
    main()
