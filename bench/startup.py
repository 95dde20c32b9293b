"""Start-up cost of a short run: the wall time of a whole 1-round `fedapps run` and where it goes.

The run: FedAvg, 20 clients, mnist5k (IID), the 4-layer CNN, 1 local epoch of batch-10 SGD, 1 round, on Flower's Ray
simulation engine with 2 single-threaded client workers (`--cpus-per-client 1`), from the start of the `fedapps run`
process to its exit. The parts, from the CLI's own output (when each line arrived) and from the run folder's files
(when the ServerApp wrote them):
  superlink   the CLI until its SuperLink answers (it boots while the CLI checks strategy and data)
  submit      `flwr run`: the app packed and the run submitted
  serverapp   until the ServerApp has started (config.yaml): SuperExec picks the run up, flwr-simulation starts,
              unpacks the app, imports the ServerApp
  data        the ServerApp's data (partition.csv)
  round       round 1 (rounds.csv): Ray starts, 2 actors spawn, import the ClientApp and load their data, train and
              evaluate the 20 clients, and the evaluation-only message of the protocol
  results     summary, plots (summary.json)
  shutdown    Ray and flwr-simulation exit, the run's final status is read, the SuperLink is stopped, the CLI exits
cpu_seconds: CPU time of the `fedapps run` process and every process it started, sampled from /proc (Linux): the figure
to compare on busy cores, where wall times stretch with the load. Last line: ``startup_seconds=<wall>`` (target <= 15 on
2 quiet cores); with --repeat N the median.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedapps_tools.benchrecord import record  # noqa: E402
from proctree import CpuSampler  # noqa: E402

RUN_NAME = "startup"
PARTS = ("superlink", "submit", "serverapp", "data", "round", "results", "shutdown")


def experiment_config() -> dict:
    return {
        "run_name": RUN_NAME,
        "seed": 0,
        "rounds": 1,
        "strategy": {"name": "fedavg"},
        "data": {"source": "mnist5k", "partition": "iid", "num_clients": 20},
        "model": {"name": "cnn"},
        "client": {"epochs": 1, "batch_size": 10, "lr": 0.05, "optimizer": "sgd", "device": "cpu"},
    }


def one_run(workdir: Path, quiet: bool) -> dict[str, float]:
    """One 1-round `fedapps run`: its wall seconds, the parts (see the module docstring) and the CPU seconds."""
    cfg_path = workdir / "startup.yaml"
    cfg_path.write_text(yaml.safe_dump(experiment_config()))
    out = workdir / "res"
    shutil.rmtree(out, ignore_errors=True)
    marks: dict[str, float] = {}
    t0 = time.time()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedapps_tools.cli",
            "run",
            str(cfg_path),
            "--output-dir",
            str(out),
            "--cpus-per-client",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    sampler = CpuSampler(proc.pid)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time()
            if re.match(r"SuperLink \S+ \(pid", line):
                marks.setdefault("superlink", now)
            elif re.match(r"run \d+ started on", line):
                marks.setdefault("submitted", now)
            if not quiet:
                sys.stdout.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc = proc.wait()
    end = time.time()
    cpu = sampler.stop()
    reader.join(timeout=10)
    if rc != 0:
        raise SystemExit(f"`fedapps run` exited {rc}")
    run_dir = out / RUN_NAME
    written = {
        name: (run_dir / name).stat().st_mtime
        for name in ("config.yaml", "partition.csv", "rounds.csv", "summary.json")
    }
    points = [
        t0,
        marks["superlink"],
        marks["submitted"],
        written["config.yaml"],
        written["partition.csv"],
        written["rounds.csv"],
        written["summary.json"],
        end,
    ]
    parts = {name: b - a for name, a, b in zip(PARTS, points, points[1:])}
    return {"wall": end - t0, "cpu": cpu, **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs (the median is reported; default 1)")
    parser.add_argument("--quiet", action="store_true", help="do not show the runs' output")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedapps-startup-") as tmp:
        for i in range(args.repeat):
            run = one_run(Path(tmp), args.quiet)
            runs.append(run)
            print(
                f"run {i + 1}: "
                + "  ".join(f"{k} {run[k]:.2f}" for k in ("wall", *PARTS))
                + f"  cpu_seconds {run['cpu']:.1f}",
                flush=True,
            )
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("start-up parts (s, median): " + "  ".join(f"{k} {median[k]:.2f}" for k in PARTS))
    print(f"cpu_seconds={median['cpu']:.1f} (every process of the run, sampled; median)")
    print(f"startup_seconds={median['wall']:.2f}")
    record(
        "startup",
        {
            "startup_seconds": round(median["wall"], 2),
            "cpu_seconds": round(median["cpu"], 1),
            **{f"{part}_seconds": round(median[part], 2) for part in PARTS},
        },
    )


if __name__ == "__main__":
    main()
