"""Scale: FedAvg, cwFedAvg, Ditto and COSMOS with 20, 100 and 1,000 clients through `flwr run` (issue #15).

Every run is a real `fedapps run` (local SuperLink, Ray simulation, 2 single-threaded client workers) on the
`synthetic` source (1×28×28, 10 classes, the same number of samples per client at every size, dealt IID, so a
client's work is the same whatever the federation), the 4-layer CNN, 1 local epoch of batch-10 SGD. A round
samples ``min(N, COHORT)`` clients (``strategy.fraction = min(1, COHORT / N)``); COSMOS's public set U has a fixed
size (it does not grow with the federation). Per run it reports

- seconds per round: the median ``wall_seconds`` of the rounds between the first (actor start-up and data
  loading land there) and the last (it also carries the evaluation-only message to EVERY client);
- peak memory (VmHWM from /proc, polled): the server process (``flwr-simulation``: the ServerApp and the Ray
  driver), the largest client worker (``ray::ClientAppActor``), and the ``fedapps run`` CLI;
- bytes per client per round, up and down (``summary.json``), and the final headline's client count.

Then the cohort check: for each strategy, the round time of the 1,000-client federation (50 sampled) over that
of a 50-client federation with full participation (the same per-client work). Last lines:
``cohort_ratio_<strategy>=<1000 clients / 50 clients>`` (target <= 1.2).

    python bench/scale.py                                  # everything (about 20 minutes on 2 quiet cores)
    python bench/scale.py --strategies fedavg --sizes 50 1000
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedapps.config import apply_override  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from fedapps_tools.flwrcli import descendants  # noqa: E402  (the /proc walk the CLI stops its processes with)
from proctree import role_of  # noqa: E402

STRATEGIES = ("fedavg", "cwfedavg", "ditto", "cosmos")
SIZES = (20, 50, 100, 1000)
COHORT = 50  # clients sampled per round at most
PER_CLIENT = 60  # samples per client (75/25 train/test inside the client)
PUBLIC = 500  # COSMOS's public set U, fixed size
ROUNDS = 4


def experiment_config(strategy: str, num_clients: int, rounds: int = ROUNDS) -> dict:
    """The run: ``strategy`` over ``num_clients`` clients, ``min(num_clients, COHORT)`` of them per round."""
    labelled = num_clients * PER_CLIENT
    data = {
        "source": "synthetic",
        "synthetic_shape": [1, 28, 28],
        "synthetic_classes": 10,
        "partition": "iid",
        "num_clients": num_clients,
        "min_samples": 10,
        "synthetic_samples": labelled,
    }
    params: dict = {}
    if strategy == "cosmos":  # U carved from the pool first: size it so every client still gets PER_CLIENT
        data["synthetic_samples"] = labelled + PUBLIC
        data["public_fraction"] = PUBLIC / (labelled + PUBLIC)
        # cluster models: the clients' CNN (COSMOS's default VGG16 made the server step ~50 s of a 60-s round at
        # 20 clients on one core: it measures the server model, not the scale)
        params = {"cosmos": {"server_model": "cnn", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}}
    return {
        "run_name": f"scale-{strategy}-{num_clients}",
        "seed": 0,
        "rounds": rounds,
        "strategy": {"name": strategy, "fraction": min(1.0, COHORT / num_clients), "min_clients": 1, "params": params},
        "data": data,
        "model": {"name": "cnn"},
        "client": {"epochs": 1, "batch_size": 10, "lr": 0.05, "optimizer": "sgd", "device": "cpu"},
    }


def read_status(pid: int) -> tuple[str, int]:
    """(command line, VmHWM in bytes) of a live process; ("", 0) once it is gone."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return cmd, int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return "", 0


class PeakMemory:
    """Polls the process tree below one pid and keeps the largest VmHWM per role."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        self.pid, self.every = pid, every
        self.peaks: dict[str, int] = {"server": 0, "worker": 0, "cli": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for p in [self.pid, *descendants(self.pid)]:
                cmd, hwm = read_status(p)
                r = role_of(cmd)
                if r in self.peaks:
                    self.peaks[r] = max(self.peaks[r], hwm)
            self._stop.wait(self.every)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class ScaleRow:
    strategy: str
    clients: int
    sampled: int
    seconds_per_round: float
    first_round_seconds: float
    last_round_seconds: float
    run_seconds: float
    server_peak_mb: float
    worker_peak_mb: float
    cli_peak_mb: float
    up_bytes_per_client_round: float
    down_bytes_per_client_round: float
    final_clients: int
    accuracy_mean: float
    sweep: str  # the simulation's message sweep (summary.json's simulation_message_sweep)


def measured_rounds(walls: list[float]) -> list[float]:
    """The rounds that measure steady state: not the first (start-up) and not the last (the final evaluation of
    every client); with fewer than 3 rounds, every round but the first."""
    if len(walls) < 2:
        raise ValueError(f"need at least 2 rounds to measure a round's time, got {len(walls)}")
    return walls[1:-1] if len(walls) >= 3 else walls[1:]


def run_one(
    strategy: str, num_clients: int, workdir: Path, rounds: int, sweep: str = "one-pass", overrides: list[str] = ()
) -> ScaleRow:
    cfg = experiment_config(strategy, num_clients, rounds)
    for item in overrides:
        apply_override(cfg, item)
    path = workdir / f"{cfg['run_name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDAPPS_MESSAGE_SWEEP": sweep}
    log = workdir / f"{cfg['run_name']}-{sweep}.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedapps_tools.cli",
                "run",
                str(path),
                "--output-dir",
                str(workdir / "res"),
                "--cpus-per-client",
                "1",
                "--quiet",
            ],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        with PeakMemory(proc.pid) as mem:
            rc = proc.wait()
    total = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{strategy} with {num_clients} clients: fedapps run exited {rc}; its output ends:\n{tail}")
    out = workdir / "res" / cfg["run_name"]
    with (out / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    walls = [float(r["wall_seconds"]) for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("simulation_message_sweep") != sweep:
        raise SystemExit(f"asked for the {sweep} message sweep, the run used {summary.get('simulation_message_sweep')}")
    mb = 1 / 2**20
    return ScaleRow(
        strategy,
        num_clients,
        int(rows[0]["clients"]),
        statistics.median(measured_rounds(walls)),
        walls[0],
        walls[-1],
        round(total, 2),
        mem.peaks["server"] * mb,
        mem.peaks["worker"] * mb,
        mem.peaks["cli"] * mb,
        float(summary["bytes_up_per_client_round"]),
        float(summary["bytes_down_per_client_round"]),
        int(summary["final_round_measured_clients"]),
        float(summary["accuracy_mean"]),
        sweep,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows here")
    ap.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every run, e.g. strategy.params.cwfedavg.mix=round",
    )
    ap.add_argument(
        "--sweep",
        nargs="+",
        default=["one-pass"],
        choices=["one-pass", "flower"],
        help="the simulation's message sweep (fedapps/flower/message_sweep.py); 'flower' is Flower's own, one "
        "pass per node: give both to measure the difference in the same session",
    )
    args = ap.parse_args()
    rows: list[ScaleRow] = []
    with tempfile.TemporaryDirectory(prefix="fedapps-scale-") as tmp:
        for strategy, n, sweep in [(s, n, w) for s in args.strategies for n in args.sizes for w in args.sweep]:
            row = run_one(strategy, n, Path(tmp), args.rounds, sweep, args.set)
            rows.append(row)
            print(
                f"{strategy:9s} {n:5d} clients {sweep:8s} sweep ({row.sampled:3d} per round): "
                f"{row.seconds_per_round:6.2f} s/round "
                f"(first {row.first_round_seconds:.1f} s, last with final evaluation {row.last_round_seconds:.1f} s; "
                f"run {row.run_seconds:.0f} s)  peak MB server {row.server_peak_mb:.0f} worker "
                f"{row.worker_peak_mb:.0f} cli {row.cli_peak_mb:.0f}  MB/client/round up "
                f"{row.up_bytes_per_client_round / 1e6:.3f} down {row.down_bytes_per_client_round / 1e6:.3f}  "
                f"final clients {row.final_clients} acc {row.accuracy_mean:.3f}",
                flush=True,
            )
    if args.csv:
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
    by = {(r.strategy, r.clients, r.sweep): r for r in rows}
    figures: dict[str, float] = {}
    for sweep in args.sweep:
        suffix = "" if sweep == "one-pass" else "_flower_sweep"
        for r in rows:
            if r.sweep == sweep:
                figures[f"s_per_round_{r.strategy}_{r.clients}{suffix}"] = round(r.seconds_per_round, 2)
        for strategy in args.strategies:
            big, ref = by.get((strategy, 1000, sweep)), by.get((strategy, COHORT, sweep))
            if big and ref:
                ratio = big.seconds_per_round / ref.seconds_per_round
                figures[f"cohort_ratio_{strategy}{suffix}"] = round(ratio, 3)
                print(f"cohort_ratio_{strategy}{suffix}={ratio:.3f}")
    record("scale", figures)


if __name__ == "__main__":
    main()
