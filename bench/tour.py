"""The five-minute tour, timed: every command of its bash block, as written, one after the other.

The block is read from docs/getting-started.md (the first ```bash block under "## A five-minute tour"; README.md holds
the same block, tests/test_docs.py checks). The commands run in a fresh temporary folder holding a copy of
configs/ and a ``.venv/bin/fedapps`` that runs this checkout's CLI, so ``results/`` starts empty as on a first
visit. Printed per command: its wall seconds; then the CPU seconds of every process the tour started (sampled from
/proc: the figure to compare on busy cores, where wall times stretch with the load) and the machine's 1-minute load
average at the start and the end. Last line: ``tour_seconds=<wall>`` (target <= 300 on 2 cores).

    python bench/tour.py [--quiet]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedapps_tools.benchrecord import record  # noqa: E402
from proctree import CpuSampler  # noqa: E402

HEADING = "## A five-minute tour"
TARGET_SECONDS = 300


def tour_block(text: str) -> list[str]:
    """The commands of the first ```bash block under the tour's heading (comments and blank lines left out,
    continuation lines joined)."""
    if HEADING not in text:
        raise SystemExit(f"no '{HEADING}' heading found")
    after = text.split(HEADING, 1)[1]
    m = re.search(r"^```bash\n(.*?)^```", after, flags=re.S | re.M)
    if not m:
        raise SystemExit(f"no ```bash block under '{HEADING}'")
    commands, pending = [], ""
    for raw in m.group(1).splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.strip()[:-1].rstrip() + " "
            continue
        line = (pending + raw.strip()).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def workspace(folder: Path) -> dict[str, str]:
    """configs/ copied, ``.venv/bin/fedapps`` running this checkout's CLI; the environment to run in."""
    shutil.copytree(ROOT / "configs", folder / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    shims = folder / ".venv" / "bin"
    shims.mkdir(parents=True)
    shim = shims / "fedapps"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m fedapps_tools.cli "$@"\n')
    shim.chmod(0o755)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "MPLBACKEND": "Agg"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="do not show the commands' output")
    args = parser.parse_args()
    commands = tour_block((ROOT / "docs" / "getting-started.md").read_text())
    steps: list[float] = []
    cpu = 0.0
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedapps-tour-") as tmp:
        folder = Path(tmp)
        env = workspace(folder)
        for n, command in enumerate(commands, 1):
            print(f"$ {command}", flush=True)
            t0 = time.time()
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=folder,
                env=env,
                stdout=subprocess.DEVNULL if args.quiet else None,
                stderr=subprocess.DEVNULL if args.quiet else None,
            )
            sampler = CpuSampler(proc.pid)
            rc = proc.wait()
            cpu += sampler.stop()
            steps.append(time.time() - t0)
            print(f"step {n}: {steps[-1]:.1f} s (exit {rc})", flush=True)
            if rc != 0:
                raise SystemExit(f"tour command {n} exited {rc}: {command}")
    load_end = os.getloadavg()[0]
    total = sum(steps)
    print("steps (s): " + "  ".join(f"{i}:{s:.1f}" for i, s in enumerate(steps, 1)))
    print(f"cpu_seconds={cpu:.1f} (every process the tour started, sampled); load {load_start:.1f} -> {load_end:.1f}")
    print(f"tour_seconds={total:.1f} (target <= {TARGET_SECONDS} on 2 cores)")
    record(
        "tour",
        {
            "tour_seconds": round(total, 1),
            "cpu_seconds": round(cpu, 1),
            "commands": len(steps),
            "slowest_step_seconds": round(max(steps), 1),
            "load_start": round(load_start, 1),
            "load_end": round(load_end, 1),
        },
    )


if __name__ == "__main__":
    main()
