"""`fedapps run` through real `flwr run` processes (Ray simulation): two concurrent runs each own a SuperLink
and neither stops the other's (nor a bystander named like one); partial participation with 40 clients
delivers every sampled message (uint64 node ids); a run whose headline covers too few clients exits 3."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fedapps_run_argv
from fedapps.reporting.results import read_csv
from fedapps_tools import launch

ROOT = Path(__file__).resolve().parent.parent
FLWR = Path(sys.executable).parent / "flwr"


def require_flower() -> None:
    if not FLWR.exists() or not (Path(sys.executable).parent / "flower-superlink").exists():
        pytest.skip(f"flwr / flower-superlink are not installed next to {sys.executable}: cannot start Flower here")
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip("Ray is not installed (flwr[simulation]): the simulation engine cannot start here")


def fedapps_run(cfg: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        fedapps_run_argv(cfg, "--output-dir", str(out), *extra),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def superlink_of(output: str) -> tuple[str, int]:
    m = re.search(r"^SuperLink (127\.0\.0\.1:\d+) \(pid (\d+)", output, re.M)
    assert m, output[-3000:]
    return m.group(1), int(m.group(2))


@pytest.mark.heavy
def test_two_concurrent_runs_each_own_their_superlink(tiny_config, tmp_path):
    require_flower()
    # a bystander that the old clean-up (pgrep -f flower-superlink) would have killed
    bystander = subprocess.Popen(["bash", "-c", "exec -a flower-superlink-bystander sleep 600"], start_new_session=True)
    try:
        cfgs = [tiny_config(rounds=1, run_name=f"conc{i}", data={"num_clients": 2}) for i in range(2)]
        procs = [fedapps_run(c, tmp_path / "res") for c in cfgs]
        outputs = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-4000:]
        links = [superlink_of(o) for o in outputs]
        assert links[0][0] != links[1][0] and links[0][1] != links[1][1], links  # one SuperLink each
        for _, pid in links:
            assert launch._proc_stat(pid) is None, f"SuperLink pid {pid} is still running after its run ended"
        for i in range(2):
            rows = read_csv(tmp_path / "res" / f"conc{i}" / "rounds.csv")
            assert [r["clients"] for r in rows] == [2]
        assert bystander.poll() is None, "a process this run did not start was stopped"
    finally:
        bystander.send_signal(signal.SIGTERM)
        bystander.wait(timeout=10)


@pytest.mark.heavy
def test_a_headline_on_too_few_clients_exits_3_through_flwr_run(tiny_config, tmp_path):
    """Under `flwr run` the ServerApp's verdict (summary.json exit_status) becomes the exit status: clients 1 and 2
    fail the evaluation-only message (fault injection through FEDAPPS_FAULTS), so the headline covers 1 of 3."""
    require_flower()
    cfg = tiny_config(rounds=1, run_name="few", data={"num_clients": 3})
    proc = fedapps_run(cfg, tmp_path / "res", env={"FEDAPPS_FAULTS": "raise@1,2/*/evaluate"})
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 3, out[-4000:]
    assert "the headline was measured on 1 of 3 clients" in out, out[-4000:]
    summary = json.loads((tmp_path / "res" / "few" / "summary.json").read_text())
    assert summary["exit_status"] == 3 and summary["final_round_measured_clients"] == 1


@pytest.mark.heavy
def test_interrupt_stops_what_the_run_started(tiny_config, tmp_path):
    """SIGTERM to `fedapps run` mid-run: exit 130, its SuperLink and everything it started are gone."""
    require_flower()
    cfg = tiny_config(rounds=50, run_name="intr", data={"num_clients": 2})
    proc = fedapps_run(cfg, tmp_path / "res")
    lines = []
    deadline = time.time() + 120
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until the run has been submitted
        lines.append(line)
        if line.startswith("run ") and "started on" in line or time.time() > deadline:
            break
    _, pid = superlink_of("".join(lines))
    time.sleep(3)
    children = launch.descendants(pid)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(lines) + rest
    assert launch._proc_stat(pid) is None
    for child, started in children.items():
        st = launch._proc_stat(child)
        assert st is None or st[1] != started, f"process {child} started by the run is still alive"
    assert shutil.which("flwr") or FLWR.exists()
