"""GPU readiness check (run through bench/gpu_check.sh): short simulations through `fedapps run` — i.e. `flwr run`
with Flower's Ray engine — on CUDA, ``--gpus-per-client`` 0.25 (four clients share the GPU), and prints per case:
rounds per second (from the run's own per-round wall times, and end to end including start-up), peak GPU memory
of the whole device and of the largest single client process (sampled with nvidia-smi every 0.2 s), and the
final accuracy. A case fails when its run fails or no client process ever held GPU memory (i.e. training
silently ran on the CPU). Results also go to ``<out>/gpu_check.json``.

    bash bench/gpu_check.sh [--out DIR] [--cases cwfedavg,cosmos,cwfedavg-bf16,fedavg-resnet18]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedapps_tools.benchrecord import record  # noqa: E402

# name -> (config, overrides, gpus per client)
CASES: dict[str, tuple[str, list[str], float]] = {
    "cwfedavg": ("configs/cwfedavg.yaml", ["rounds=5", "client.device=cuda"], 0.25),
    "cosmos": (
        "configs/cosmos.yaml",
        ["rounds=3", "client.device=cuda", "strategy.params.cosmos.server_device=cuda"],
        0.25,
    ),
    "cwfedavg-bf16": ("configs/cwfedavg.yaml", ["rounds=5", "client.device=cuda", "client.mixed_precision=true"], 0.25),
    # the sizing case of the --gpus-per-client rule (docs/deployment.md): a paper model at CIFAR size
    "fedavg-resnet18": (
        "configs/fedavg.yaml",
        [
            "rounds=3",
            "client.device=cuda",
            "model.name=resnet18",
            "data.source=synthetic",
            "data.synthetic_shape=[3,32,32]",
            "data.synthetic_samples=4000",
            "data.partition=iid",
            "client.batch_size=64",
            "data.num_clients=8",
            "strategy.min_clients=8",
        ],
        0.25,
    ),
}


class GpuMemorySampler(threading.Thread):
    """Polls nvidia-smi: peak used memory of the device and of the largest compute process (MiB)."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.interval, self.stop_flag = interval, threading.Event()
        self.peak_device = self.peak_process = 0
        self.pids: set[int] = set()
        self.baseline = self._device_used()

    @staticmethod
    def _query(args: list[str]) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    def _device_used(self) -> int:
        rows = self._query(["--query-gpu=memory.used"])
        return int(rows[0][0]) if rows else 0

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.peak_device = max(self.peak_device, self._device_used())
                for pid, used in self._query(["--query-compute-apps=pid,used_memory"]):
                    if used.isdigit():
                        self.peak_process = max(self.peak_process, int(used))
                        self.pids.add(int(pid))
            except (subprocess.SubprocessError, ValueError, IndexError):
                pass
            self.stop_flag.wait(self.interval)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(timeout=15)


def run_case(name: str, out: Path) -> dict:
    config, overrides, gpus = CASES[name]
    run_name = f"gpu-check-{name}"
    cmd = [
        sys.executable,
        "-m",
        "fedapps_tools.cli",
        "run",
        config,
        "--output-dir",
        str(out),
        "--quiet",
        "--gpus-per-client",
        str(gpus),
        "--cpus-per-client",
        "2",
        "--set",
        f"run_name={run_name}",
        *overrides,
    ]
    sampler = GpuMemorySampler()
    sampler.start()
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    sampler.stop()
    result = {
        "case": name,
        "config": config,
        "overrides": overrides,
        "gpus_per_client": gpus,
        "exit_code": proc.returncode,
        "wall_seconds_end_to_end": round(wall, 1),
        "peak_device_mib": sampler.peak_device,
        "device_mib_before": sampler.baseline,
        "peak_client_process_mib": sampler.peak_process,
        "gpu_processes_seen": len(sampler.pids),
    }
    run_dir = out / run_name
    rounds_csv = run_dir / "rounds.csv"
    if proc.returncode != 0 or not rounds_csv.exists():
        result["error"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    with open(rounds_csv) as f:
        rows = list(csv.DictReader(f))
    round_seconds = sum(float(r["wall_seconds"]) for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    result.update(
        rounds=len(rows),
        rounds_per_second=round(len(rows) / round_seconds, 3) if round_seconds else None,
        rounds_per_second_end_to_end=round(len(rows) / wall, 3),
        accuracy_mean=summary.get("accuracy_mean"),
        final_train_loss=float(rows[-1]["train_loss"]) if rows[-1].get("train_loss") else None,
    )
    if sampler.peak_process == 0:
        result["error"] = "no client process held GPU memory: the clients did not train on CUDA"
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="results folder (default: a new temporary folder)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fedapps-gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        print(f"gpu_check: unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    import torch

    gpu = torch.cuda.get_device_properties(0)
    print(
        f"gpu_check: {gpu.name}, {gpu.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; results in {out}",
        flush=True,
    )
    results = []
    for name in names:
        r = run_case(name, out)
        results.append(r)
        if "error" in r:
            print(f"  {name:16s} FAILED (exit {r['exit_code']}): {r['error'][-1500:]}", flush=True)
        else:
            print(
                f"  {name:16s} {r['rounds']} rounds  {r['rounds_per_second']:.3f} rounds/s in rounds "
                f"({r['rounds_per_second_end_to_end']:.3f} end to end, {r['wall_seconds_end_to_end']:.0f} s)  "
                f"peak GPU memory: device {r['peak_device_mib']} MiB (before: {r['device_mib_before']}), "
                f"largest client process {r['peak_client_process_mib']} MiB, {r['gpu_processes_seen']} GPU processes  "
                f"accuracy {r['accuracy_mean']:.3f}, last round's train loss {r['final_train_loss']!r}",
                flush=True,
            )
    (out / "gpu_check.json").write_text(
        json.dumps({"gpu": gpu.name, "torch": torch.__version__, "cases": results}, indent=2)
    )
    record(
        "gpu_check",
        {
            f"{r['case']}_{key}": r[key]
            for r in results
            if "error" not in r
            for key in ("rounds_per_second", "peak_device_mib", "accuracy_mean")
        }
        | {f"{r['case']}_failed": r["exit_code"] for r in results if "error" in r},
    )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
