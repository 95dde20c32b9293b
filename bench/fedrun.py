"""What the benchmarks that run `fedapps run` share: one run of a config dict through the command (Flower's Ray
engine, or the in-process one), its rounds.csv read back, and the clients' per-message breakdown of the measured rounds
(the ``client_<phase>_seconds`` columns, :class:`fedapps.wire.protocol.MessageProfile`)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedapps.client.worker import THREADS_ENV  # noqa: E402
from fedapps.flower.inprocess import WORKERS_ENV  # noqa: E402
from fedapps.wire.protocol import PROFILE_FIELDS  # noqa: E402
from proctree import CpuSampler, cpu_between  # noqa: E402

PHASES = tuple(name for name in PROFILE_FIELDS if name != "wall")  # the clients' phases, in rounds.csv's order


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class Run:
    """One finished `fedapps run`: its rounds.csv rows, summary.json and the command's wall seconds."""

    rows: list[dict[str, str]]
    summary: dict
    seconds: float
    workers: int  # clients served at once
    # when rounds.csv first held k rows (perf counter seconds; watched every 10 ms): the rounds' ends, the server's
    # work between rounds (results, checkpoint) included
    row_times: dict[int, float] = field(default_factory=dict)
    # CPU seconds by role of the run's processes over the measured rounds (bench/proctree.py), and that window's wall
    cpu: dict[str, float] = field(default_factory=dict)
    cpu_wall: float = 0.0

    def measured(self) -> list[dict[str, str]]:
        """The rounds between the first (start-up: Ray, actors, data loading) and the last (which also carries the
        evaluation-only message to every client): what a round costs once the run is warm."""
        return self.rows[1:-1]

    def measured_span(self) -> float | None:
        """Seconds from the first round's row to the last measured round's, the work between rounds included (None
        when the rows were not watched)."""
        last = len(self.rows) - 1
        if 1 in self.row_times and last in self.row_times and last > 1:
            return self.row_times[last] - self.row_times[1]
        return None


SERVER_STEPS = ("messages", "replies", "aggregate")  # the server's steps of a round (fedapps.server.rounds.StepClock)


@dataclass
class Breakdown:
    """Per training message of the measured rounds, in milliseconds of worker time: the clients' phases and their wall
    on the client (``client``), and what a worker's time holds beyond it (``framework`` = ``worker`` - ``client``),
    split into ``exchange`` (the rest of the exchange with the clients: Ray's and Flower's delivery of the message
    and the reply, queues, polling, a round's tail), ``server`` (the server's steps in the round, while the workers
    wait: building the messages, checking the replies, aggregating) and ``between`` (the server's work between two
    rounds: results, checkpoint). ``worker`` = workers x the measured rounds' span / messages."""

    messages: int
    phases: dict[str, float] = field(default_factory=dict)
    client: float = 0.0  # the client's wall per message (from the message's arrival at the worker to its reply)
    worker: float = 0.0
    exchange: float = 0.0
    server: float = 0.0
    between: float = 0.0

    @property
    def unattributed(self) -> float:
        """The client's wall not in any phase: the worker's own glue."""
        return self.client - sum(self.phases.values())

    @property
    def framework(self) -> float:
        return self.worker - self.client


def breakdown(rows: Sequence[Mapping[str, str]], workers: int, span: float | None = None) -> Breakdown:
    """The per-message breakdown (ms) of some rounds.csv rows (see :class:`Breakdown`); ``span``: the seconds they
    took end to end (default: their ``wall_seconds``, the work between rounds left out)."""
    messages = sum(int(r["clients"]) for r in rows)
    if not messages:
        raise SystemExit("no training message was answered in the measured rounds: nothing to break down")

    def total(column: str) -> float:
        return sum(float(r.get(column) or 0.0) for r in rows)

    def per_message(seconds: float, scale: int = 1) -> float:
        return 1000.0 * scale * seconds / messages

    wall = total("wall_seconds")
    span = wall if span is None else span
    client = per_message(total("client_wall_seconds"))
    return Breakdown(
        messages=messages,
        phases={name: per_message(total(f"client_{name}_seconds")) for name in PHASES},
        client=client,
        worker=per_message(span, workers),
        exchange=per_message(total("round_exchange_seconds"), workers) - client,
        server=per_message(sum(total(f"round_{step}_seconds") for step in SERVER_STEPS), workers),
        between=per_message(span - wall, workers),
    )


def rows_written(path: Path) -> int:
    """Rows in rounds.csv so far (the ServerApp rewrites it after every round): the CPU sampler's progress marker."""
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


class RowWatcher(threading.Thread):
    """When a run's rounds.csv first held k rows, for each k (polled every ``interval`` seconds)."""

    def __init__(self, path: Path, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.path, self.interval = path, interval
        self.times: dict[int, float] = {}
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.is_set():
            n = rows_written(self.path)
            if n and n not in self.times:
                self.times[n] = time.perf_counter()
            self._done.wait(self.interval)

    def stop(self) -> dict[int, float]:
        self._done.set()
        self.join(timeout=5)
        return self.times


def fedapps_run(
    config: Mapping,
    workdir: Path,
    engine: str = "flower",
    workers: int | None = None,
    gpus_per_client: float = 0.0,
    threads: int = 0,
    sample_cpu: bool = False,
) -> Run:
    """Run ``config`` (a config dict, written to ``workdir``) through `fedapps run` with ``workers`` clients served
    at once (default: one per usable core; Flower's engine: one Ray actor per worker, ``--cpus-per-client`` = cores /
    workers; the in-process engine: FEDAPPS_INPROCESS_WORKERS), each client on ``threads`` torch threads
    (FEDAPPS_CLIENT_THREADS; 0: what the engine grants) and, with ``sample_cpu``, the CPU of the run's processes
    sampled by role; SystemExit when the command fails."""
    cores = usable_cores()
    workers = max(1, min(workers or cores, cores))
    name = str(config["run_name"])
    cfg_path = workdir / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(dict(config)))
    out = workdir / "res"
    cmd = [sys.executable, "-m", "fedapps_tools.cli", "run", str(cfg_path), "--output-dir", str(out), "--quiet"]
    cmd += ["--engine", engine]
    if engine == "flower":
        cmd += ["--cpus-per-client", str(max(1, cores // workers))]
        if gpus_per_client:
            cmd += ["--gpus-per-client", f"{gpus_per_client:g}"]
    env = {**os.environ, WORKERS_ENV: str(workers), "PYTHONPATH": str(ROOT)}
    if threads:
        env[THREADS_ENV] = str(threads)
    run_dir = out / name
    log = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        sampler = CpuSampler(proc.pid, marker=lambda: rows_written(run_dir / "rounds.csv")) if sample_cpu else None
        watcher = RowWatcher(run_dir / "rounds.csv")
        rc = proc.wait()
    seconds = time.perf_counter() - t0
    row_times = watcher.stop()
    if sampler is not None:
        sampler.stop()
    if rc != 0 or not (run_dir / "rounds.csv").exists():
        raise SystemExit(f"`fedapps run` of {name} exited {rc}:\n{log.read_text()[-3000:]}")
    with (run_dir / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    run = Run(rows, json.loads((run_dir / "summary.json").read_text()), seconds, workers, row_times)
    if sampler is not None and len(rows) >= 3:  # the measured rounds: from round 1's row to the last measured one
        run.cpu_wall, run.cpu = cpu_between(sampler.timeline, 1, len(rows) - 1)
    return run
