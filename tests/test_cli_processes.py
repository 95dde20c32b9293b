"""`fedapps run` through real `flwr run` processes (Ray simulation), two of them at once (each `flwr run` costs ~20
CPU-seconds across its processes, so one pair answers three questions): each owns a SuperLink and neither stops the
other's (nor a bystander named like one); one of them imports the user's model and data through PYTHONPATH into the
ServerApp and every Ray worker; the other's headline covers too few clients, so it exits 3. What a stopped run leaves
(Ctrl-C, SIGKILL) and how it resumes: tests/test_resume.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import fedapps_run_argv, run_folder, write_config
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


@dataclass(frozen=True)
class Finished:
    rc: int
    output: str
    out: Path  # the results root it was given


@dataclass(frozen=True)
class Pair:
    user_code: Finished  # fedper on the user's model and data (tests/user_code.py), PYTHONPATH set
    few: Finished  # 3 clients, 2 of them failing the evaluation-only message
    bystander_alive: bool  # after both ended


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Pair:
    """Two `fedapps run`s started together, a bystander beside them that the old clean-up (pgrep -f
    flower-superlink) would have killed."""
    require_flower()
    tmp = tmp_path_factory.mktemp("two-runs")
    user_cfg = write_config(
        tmp / "user.yaml",
        rounds=2,
        strategy={"name": "fedper"},
        data={"source": "user_code:digits_dataset", "num_clients": 3},
        model={"name": "user_code:tiny_net"},
    )
    few_cfg = write_config(tmp / "few.yaml", rounds=1, run_name="few", data={"num_clients": 3})
    bystander = subprocess.Popen(["bash", "-c", "exec -a flower-superlink-bystander sleep 600"], start_new_session=True)
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        user_env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        procs["user_code"] = (fedapps_run(user_cfg, tmp / "user", env=user_env), tmp / "user")
        # clients 1 and 2 fail the evaluation-only message (fault injection through FEDAPPS_FAULTS)
        procs["few"] = (fedapps_run(few_cfg, tmp / "few", env={"FEDAPPS_FAULTS": "raise@1,2/*/evaluate"}), tmp / "few")
        done = {}
        for name, (proc, out) in procs.items():
            output, _ = proc.communicate(timeout=400)
            done[name] = Finished(proc.returncode, output, out)
        return Pair(**done, bystander_alive=bystander.poll() is None)
    finally:
        for proc, _ in procs.values():  # only after a failure: a run still going is stopped as Ctrl-C stops it
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        bystander.send_signal(signal.SIGTERM)
        bystander.wait(timeout=10)


@pytest.mark.heavy
def test_two_concurrent_runs_each_own_their_superlink(two_runs):
    links = [superlink_of(run.output) for run in (two_runs.user_code, two_runs.few)]
    assert links[0][0] != links[1][0] and links[0][1] != links[1][1], links  # one SuperLink each
    for _, pid in links:
        assert launch._proc_stat(pid) is None, f"SuperLink pid {pid} is still running after its run ended"
    assert two_runs.bystander_alive, "a process these runs did not start was stopped"


@pytest.mark.heavy
def test_flwr_run_imports_the_users_model_and_data_through_pythonpath(two_runs):
    """The user's folder on PYTHONPATH reaches the ServerApp and every client worker (the run alone would fail at
    its first import)."""
    run = two_runs.user_code
    assert run.rc == 0, run.output[-4000:]
    summary = json.loads((run_folder(run.out) / "summary.json").read_text())
    assert isinstance(summary["accuracy_mean"], float) and not summary["problems"], summary
    assert [r["clients"] for r in read_csv(run_folder(run.out) / "rounds.csv")] == [3, 3]


@pytest.mark.heavy
def test_a_headline_on_too_few_clients_exits_3_through_flwr_run(two_runs):
    """Under `flwr run` the ServerApp's verdict (summary.json exit_status) becomes the exit status: the headline
    covers 1 of 3 clients."""
    run = two_runs.few
    assert run.rc == 3, run.output[-4000:]
    assert "the headline was measured on 1 of 3 clients" in run.output, run.output[-4000:]
    summary = json.loads((run.out / "few" / "summary.json").read_text())
    assert summary["exit_status"] == 3 and summary["final_round_measured_clients"] == 1


def test_sigterm_inside_a_run_is_a_keyboard_interrupt():
    """`fedapps run` stops on SIGTERM (`kill`, a batch scheduler) as on Ctrl-C: what Ctrl-C stops and leaves is
    checked through `flwr run` by tests/test_resume.py; outside the context SIGTERM is what it was before."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        with launch.sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; the sleep is cut short
    assert signal.getsignal(signal.SIGTERM) is before
