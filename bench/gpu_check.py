"""GPU readiness check (run through bench/gpu_check.sh): short simulations through `fedapps run` — i.e. `flwr run`
with Flower's Ray engine — on CUDA, ``--gpus-per-client`` 0.25 (four clients share the GPU), and prints per case:
rounds per second (from the run's own per-round wall times, and end to end including start-up), peak GPU memory
of the whole device and of the largest single client process (sampled with nvidia-smi every 0.2 s), and the
final accuracy. A case fails when its run fails or no client process ever held GPU memory (i.e. training
silently ran on the CPU). Results also go to ``<out>/gpu_check.json``.

The FedAvg cases (the CNN with 20 clients, ``fedavg-cnn``; ResNet-18 on 3×32×32 at batch 64, ``fedavg-resnet18``) are
also run as a bare loop in this process on the same device (bench/bareloop.py: the same clients' work, their data on
the device from the start, one warm-up round), and ``gpu_ratio`` = Flower's seconds per round (the rounds between the
first and the last) / the bare loop's (target <= 1.5). The last line: ``gpu_ratio_<case>=...`` for each.

    bash bench/gpu_check.sh [--out DIR] [--cases cwfedavg,cosmos,cwfedavg-bf16,fedavg-resnet18,fedavg-cnn]
    bash bench/gpu_check.sh --device cpu --cases fedavg-cnn --clients 2 --rounds 3   # the same end to end on the CPU
    bash bench/gpu_check.sh --device cpu --cases fedavg-cnn --clients 2 --rounds 3 --set data.source=digits  # smaller
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bareloop import round_seconds  # noqa: E402
from fedapps.config import load_config  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402
from fedapps_tools.options import add_set_option  # noqa: E402

TARGET_RATIO = 1.5

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
            "rounds=4",
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
    # the CNN with 20 clients: a round of small models, where Flower's per-message cost shows most
    "fedavg-cnn": ("configs/fedavg.yaml", ["rounds=5", "client.device=cuda"], 0.25),
}
RATIO_CASES = ("fedavg-cnn", "fedavg-resnet18")  # FedAvg: the bare loop does exactly their clients' work


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


def case_overrides(name: str, device: str, sizes: list[str]) -> list[str]:
    """A case's overrides on ``device`` (on the CPU: its cuda settings as cpu, mixed precision left out), then the
    size flags' (``sizes``; ``data.synthetic_samples`` only for the cases on synthetic data)."""
    overrides = list(CASES[name][1])
    if device == "cpu":
        overrides = [o.replace("=cuda", "=cpu") for o in overrides if not o.startswith("client.mixed_precision")]
    synthetic = "data.source=synthetic" in overrides
    return overrides + [o for o in sizes if synthetic or not o.startswith("data.synthetic_samples=")]


def measured_rounds(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rounds a round's cost is read from: all but the first (Ray start-up, actors, data) and the last (it also
    carries the evaluation-only message to every client); all of them when there are fewer than three."""
    return rows[1:-1] if len(rows) >= 3 else rows


def run_case(name: str, out: Path, device: str = "cuda", sizes: list[str] | None = None) -> dict:
    config, _, gpus = CASES[name]
    overrides = case_overrides(name, device, sizes or [])
    on_gpu = device == "cuda"
    run_name = f"gpu-check-{name}"
    cmd = [sys.executable, "-m", "fedapps_tools.cli", "run", config, "--output-dir", str(out), "--quiet"]
    cmd += ["--gpus-per-client", str(gpus), "--cpus-per-client", "2"] if on_gpu else ["--cpus-per-client", "1"]
    cmd += ["--set", f"run_name={run_name}", *overrides]
    sampler = GpuMemorySampler() if on_gpu else None
    if sampler is not None:
        sampler.start()
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if sampler is not None:
        sampler.stop()
    result = {
        "case": name,
        "device": device,
        "config": config,
        "overrides": overrides,
        "gpus_per_client": gpus if on_gpu else 0,
        "exit_code": proc.returncode,
        "wall_seconds_end_to_end": round(wall, 1),
        "peak_device_mib": sampler.peak_device if sampler else 0,
        "device_mib_before": sampler.baseline if sampler else 0,
        "peak_client_process_mib": sampler.peak_process if sampler else 0,
        "gpu_processes_seen": len(sampler.pids) if sampler else 0,
    }
    run_dir = out / run_name
    rounds_csv = run_dir / "rounds.csv"
    if proc.returncode != 0 or not rounds_csv.exists():
        result["error"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    with open(rounds_csv) as f:
        rows = list(csv.DictReader(f))
    all_rounds = sum(float(r["wall_seconds"]) for r in rows)
    measured = measured_rounds(rows)
    flower_round = sum(float(r["wall_seconds"]) for r in measured) / len(measured)
    summary = json.loads((run_dir / "summary.json").read_text())
    result.update(
        rounds=len(rows),
        rounds_per_second=round(len(rows) / all_rounds, 3) if all_rounds else None,
        rounds_per_second_end_to_end=round(len(rows) / wall, 3),
        round_seconds=round(flower_round, 3),
        accuracy_mean=summary.get("accuracy_mean"),
        final_train_loss=float(rows[-1]["train_loss"]) if rows[-1].get("train_loss") else None,
    )
    if name in RATIO_CASES:
        cfg = load_config(ROOT / config, [f"run_name={run_name}", *overrides])
        bare = round_seconds(cfg, len(measured), device)
        result.update(bare_round_seconds=round(bare, 4), gpu_ratio=round(flower_round / bare, 3))
    if sampler is not None and sampler.peak_process == 0:
        result["error"] = "no client process held GPU memory: the clients did not train on CUDA"
    return result


def device_line(device: str) -> tuple[str, str]:
    """(the device's name, a line describing it and the machine)."""
    import torch

    if device == "cpu":
        return "cpu", f"gpu_check: on the CPU (no GPU asked for or none visible), torch {torch.__version__}, "
    gpu = torch.cuda.get_device_properties(0)
    return gpu.name, f"gpu_check: {gpu.name}, {gpu.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="results folder (default: a new temporary folder)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when visible, else the CPU"
    )
    ap.add_argument("--clients", type=int, default=0, help="data.num_clients of every case (default: each case's)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of every case (default: each case's)")
    ap.add_argument("--samples", type=int, default=0, help="data.synthetic_samples of the synthetic-data cases")
    add_set_option(ap, "every case's config, after the case's own (the run and the bare loop alike)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="fedapps-gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        print(f"gpu_check: unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [f"data.num_clients={args.clients}", "strategy.min_clients=1"] if args.clients else []
    sizes += [f"rounds={args.rounds}"] if args.rounds else []
    sizes += [f"data.synthetic_samples={args.samples}"] if args.samples else []
    sizes += args.overrides
    name, line = device_line(device)
    print(line + f"{os.cpu_count()} CPU cores; results in {out}", flush=True)
    results = []
    for case in names:
        r = run_case(case, out, device, sizes)
        results.append(r)
        if "error" in r:
            print(f"  {case:16s} FAILED (exit {r['exit_code']}): {r['error'][-1500:]}", flush=True)
            continue
        ratio = ""
        if "gpu_ratio" in r:
            ratio = f"  round {r['round_seconds']:.3f} s, bare loop {r['bare_round_seconds']:.3f} s"
            ratio += f": gpu_ratio {r['gpu_ratio']:.2f}"
        print(
            f"  {case:16s} {r['rounds']} rounds  {r['rounds_per_second']:.3f} rounds/s in rounds "
            f"({r['rounds_per_second_end_to_end']:.3f} end to end, {r['wall_seconds_end_to_end']:.0f} s)  "
            f"peak GPU memory: device {r['peak_device_mib']} MiB (before: {r['device_mib_before']}), "
            f"largest client process {r['peak_client_process_mib']} MiB, {r['gpu_processes_seen']} GPU processes  "
            f"accuracy {r['accuracy_mean']:.3f}, last round's train loss {r['final_train_loss']!r}" + ratio,
            flush=True,
        )
    (out / "gpu_check.json").write_text(
        json.dumps({"gpu": name, "torch": torch.__version__, "cases": results}, indent=2)
    )
    figures = {
        f"{r['case']}_{key}": r[key]
        for r in results
        if "error" not in r
        for key in ("rounds_per_second", "peak_device_mib", "accuracy_mean", "gpu_ratio")
        if key in r
    }
    record("gpu_check", figures | {f"{r['case']}_failed": r["exit_code"] for r in results if "error" in r})
    ratios = {r["case"]: r["gpu_ratio"] for r in results if "gpu_ratio" in r}
    if ratios:
        print(" ".join(f"gpu_ratio_{case}={ratio}" for case, ratio in ratios.items()) + f" target={TARGET_RATIO:g}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
