"""Checkpoints and resume: a run SIGKILLed right after round 2's checkpoint and resumed in a new process ends
with exactly the uninterrupted run's rounds.csv and summary (FedAvg, cwFedAvg, COSMOS); so does a `flwr run`
interrupted by Ctrl-C or killed (SIGKILL), resumed in a new simulation whose nodes have new ids; a resumption with
another config is refused, naming the key; the strategy state round-trips through state_dict."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import derived_run_dir, fedapps_run_argv, wire_run
from tests.conftest import write_config

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "run_driver.py"
TIMING = "seconds"  # how measured durations end (wall_seconds, client_train_seconds): the only columns that may differ

CONFIGS = {
    "fedavg": {"rounds": 4, "strategy": {"name": "fedavg", "fraction": 0.5}},  # sampling: the RNG is restored
    "cwfedavg": {
        "rounds": 4,
        "strategy": {"name": "cwfedavg", "fraction": 0.75},
        "data": {"partition": "pathological", "classes_per_client": 3},
    },
    "cosmos": {
        "rounds": 4,
        "strategy": {
            "name": "cosmos",
            "params": {
                "cosmos": {
                    "server_model": "cnn",
                    "pretrain_epochs": 1,
                    "server_epochs": 1,
                    "distill_epochs": 1,
                }
            },
        },
        "data": {"public_fraction": 0.2},
        "model": {"name": "mlp", "per_client": ["mlp", "cnn"]},
    },
}


def start(config: Path, out: Path, resume: Path | None = None, kill_after: int = 0) -> subprocess.Popen:
    """The driver in a new process (it stops by itself: at the end, or by its own SIGKILL)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDAPPS_TEST_KILL_AFTER_ROUND": str(kill_after)}
    args = [sys.executable, str(DRIVER), str(config), str(out)] + ([str(resume)] if resume else [])
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()  # only the process this test started
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(config: Path, out: Path, resume: Path | None = None, kill_after: int = 0) -> subprocess.CompletedProcess:
    return finish(start(config, out, resume, kill_after))


def run_here(config: Path, out: Path, keep_state: bool = False) -> None:
    """The uninterrupted reference run, in the test's own process (so three processes take part in all)."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    server_app.run_experiment(InProcessGrid(4), str(config), "", str(out), keep_state=keep_state)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "rounds.csv").open() as fh:
        return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in csv.DictReader(fh)]


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", sorted(CONFIGS))
def test_sigkill_after_round_two_then_resume_equals_uninterrupted(strategy, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", **CONFIGS[strategy])
    # output folders of equal path length: the state-dir path in every message counts in bytes_down
    killing = start(config, tmp_path / "b", kill_after=2)
    run_here(config, tmp_path / "a")  # meanwhile
    full_dir = next((tmp_path / "a").iterdir())

    killed = finish(killing)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = next((tmp_path / "b").iterdir())
    assert not (run_dir / "summary.json").exists()
    assert [r["round"] for r in rows(run_dir)] == ["1", "2"]
    # round 2's deployed models are measured on round 3's messages: pending in the checkpoint, taken after resuming
    assert [r["acc_mean"] != "" for r in rows(run_dir)] == [True, False]
    if strategy == "cwfedavg":  # its stack is kept in per-client files, only a round's repliers' rewritten
        stack_files = [p.name for p in (run_dir / "server-state" / "stack").glob("*.pt")]
        assert stack_files and all(".v1." in n or ".v2." in n for n in stack_files)
    if strategy == "cosmos":  # the private models are on disk, for the resumed run's clients to read back
        assert sorted(p.name for p in (run_dir / "client-state").iterdir())
    if strategy == "fedavg":  # the whole model comes with every message: nothing is kept on the client
        assert not (run_dir / "client-state").exists() or not any((run_dir / "client-state").iterdir())

    resumed = run(config, tmp_path / "b", resume=run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "after round 2" in resumed.stderr

    expected, got = rows(full_dir), rows(run_dir)
    assert [r["round"] for r in got] == ["1", "2", "3", "4"]
    assert got == expected  # every accuracy column (acc_mean, acc_weighted, per client, ...) exactly
    assert all(r["acc_mean"] != "" for r in got)
    a = json.loads((full_dir / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "accuracy_mean",
        "accuracy_weighted",
        "accuracy_mean_last5",
        "rounds",
        "bytes_up",
        "bytes_down",
        "messages_sent",
        "messages_answered",
        "usable_replies",
    ):
        assert b[key] == a[key], key
    assert {k: v for k, v in b.items() if "accuracy" in k} == {k: v for k, v in a.items() if "accuracy" in k}
    if strategy == "cosmos":
        assert b["cluster_members"] == a["cluster_members"]
    for folder in (full_dir, run_dir):  # a run that ends successfully removes its resume state
        assert not [n for n in ("checkpoint.pt", "client-state", "server-state") if (folder / n).exists()], folder


@pytest.mark.heavy
def test_evaluate_every_resumed_run_measures_the_same_rounds(tmp_path):
    """evaluate_every 5 over 12 rounds, killed after round 7 (round 5 measured, 6 and 7 not) and resumed: the same
    rows as the uninterrupted run, the deployed and after-training columns filled in rounds 5, 10 and 12 only."""
    config = write_config(
        tmp_path / "cfg.yaml",
        rounds=12,
        evaluate_every=5,
        strategy={"name": "fedbabu", "params": {"fedbabu": {"finetune_epochs": 1}}},
        data={"partition": "pathological", "classes_per_client": 3},
    )
    killing = start(config, tmp_path / "b", kill_after=7)
    run_here(config, tmp_path / "a")
    full_dir = next((tmp_path / "a").iterdir())
    killed = finish(killing)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = next((tmp_path / "b").iterdir())
    assert [r["round"] for r in rows(run_dir) if r["acc_mean"]] == ["5"]
    resumed = run(config, tmp_path / "b", resume=run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = rows(full_dir), rows(run_dir)
    assert got == expected
    for column in ("acc_mean", "acc_after_training_mean", "measured_clients"):
        assert [r["round"] for r in got if r[column]] == ["5", "10", "12"], column
    a = json.loads((full_dir / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    assert b["final_round"] == a["final_round"] == 12
    assert {k: v for k, v in b.items() if "accuracy" in k} == {k: v for k, v in a.items() if "accuracy" in k}


def test_resume_with_another_config_is_refused_naming_the_key(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", rounds=1)
    run_here(config, tmp_path / "a", keep_state=True)
    run_dir = next((tmp_path / "a").iterdir())
    other = write_config(tmp_path / "other.yaml", rounds=1, client={"lr": 0.01})
    from fedapps_tools import cli

    with pytest.raises(Exception) as info:
        import server_app
        from fedapps.flower.inprocess import InProcessGrid

        server_app.run_experiment(InProcessGrid(4), str(other), "", str(tmp_path / "x"), resume_dir=str(run_dir))
    assert "client.lr" in str(info.value) and "0.05" in str(info.value) and "0.01" in str(info.value)
    rc = cli.main(["run", str(other), "--engine", "inprocess", "--resume", str(run_dir)])
    assert rc == 2
    # the same config, with another output_dir / run_name, is accepted
    from fedapps import checkpoint
    from fedapps.config import dump_yaml, load_config

    saved = checkpoint.load_checkpoint(run_dir)
    same = load_config(config, "output_dir=/elsewhere run_name=renamed")
    from strategies import resolve

    checkpoint.check_same_config(saved["config"], dump_yaml(resolve(same).config(same)), run_dir)


def test_no_checkpoint_is_a_config_error(tmp_path):
    from fedapps import checkpoint
    from fedapps.config import ConfigError

    with pytest.raises(ConfigError, match="no checkpoint.pt"):
        checkpoint.load_checkpoint(tmp_path)


def test_row_files_write_changed_rows_only_and_keep_the_committed_version(tmp_path):
    """RowFiles: a save writes only the rows given, under a new version; the files it supersedes survive until
    the next save (a crash before the new checkpoint is written leaves the old map valid); restoring a map
    deletes every file it does not name; a named file that is missing is a ConfigError naming the folder."""
    import numpy as np

    from fedapps import checkpoint
    from fedapps.config import ConfigError

    files = checkpoint.RowFiles(tmp_path / "stack")
    first = files.save({c: {"w": np.full(3, c, np.float32)} for c in (1, 2, 3)})
    assert first == {1: "1.v1.pt", 2: "2.v1.pt", 3: "3.v1.pt"}
    second = files.save({2: {"w": np.full(3, 20, np.float32)}})
    assert second == {1: "1.v1.pt", 2: "2.v2.pt", 3: "3.v1.pt"}
    assert sorted(p.name for p in (tmp_path / "stack").iterdir()) == ["1.v1.pt", "2.v1.pt", "2.v2.pt", "3.v1.pt"]

    crashed = checkpoint.RowFiles(tmp_path / "stack")  # the process died before the second checkpoint was written
    rows = crashed.restore(first, 1)
    assert {c: float(r["w"][0]) for c, r in rows.items()} == {1: 1.0, 2: 2.0, 3: 3.0}
    assert sorted(p.name for p in (tmp_path / "stack").iterdir()) == ["1.v1.pt", "2.v1.pt", "3.v1.pt"]
    assert crashed.save({3: {"w": np.zeros(3, np.float32)}})[3] == "3.v2.pt"  # versions go on from the map's

    assert files.superseded == ["2.v1.pt"]
    files.save({1: {"w": np.zeros(3, np.float32)}})  # the next save deletes what the last one superseded
    assert not (tmp_path / "stack" / "2.v1.pt").exists() and (tmp_path / "stack" / "1.v1.pt").exists()

    (tmp_path / "stack" / "1.v1.pt").unlink()
    with pytest.raises(ConfigError, match="server-state file.*missing from .*stack"):
        checkpoint.RowFiles(tmp_path / "stack").restore(first, 1)


# --------------------------------------------------------------------------- through `flwr run`

FLOWER = {
    "rounds": 6,
    "strategy": {"name": "cwfedavg", "fraction": 0.75},
    "data": {"partition": "pathological", "classes_per_client": 3},
}


class FlowerRun:
    """`fedapps run` (engine flower: its own SuperLink, Ray simulation) in a process of its own, its output read
    on a thread; ``superlink`` is the SuperLink's pid once printed."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        import threading

        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            fedapps_run_argv(config, *args),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def superlink(self) -> int | None:
        import re

        m = re.search(r"^SuperLink \S+ \(pid (\d+)", self.output, re.M)
        return int(m.group(1)) if m else None

    def wait(self, timeout: float = 600) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc


def require_flower() -> None:
    if not (Path(sys.executable).parent / "flower-superlink").exists():
        pytest.skip(f"flower-superlink is not installed next to {sys.executable}: cannot start Flower here")


@pytest.fixture(scope="module")
def flower_reference(tmp_path_factory):
    """The uninterrupted run of FLOWER: its rounds.csv rows (timings aside) and its summary. It runs in process
    through Flower's wire format with Flower-sized node ids (:func:`conftest.wire_run`), which gives a `flwr run`'s
    rows exactly (the strategies' cohorts and bytes do not depend on the engine) at a tenth of its cost: the
    resumed `flwr run`s below must end where an uninterrupted run of any engine ends."""
    require_flower()
    tmp = tmp_path_factory.mktemp("flower-ref")
    folder = wire_run(tmp, **FLOWER)
    return rows(folder), json.loads((folder / "summary.json").read_text())


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_an_interrupted_flwr_run_resumes_to_the_uninterrupted_rounds(how, flower_reference, tmp_path):
    """`fedapps run` under `flwr run` stopped after round 2 of 6 — by Ctrl-C (SIGINT to fedapps: it stops what it
    started), or by SIGKILL to every process of the run at once (a crash: nothing cleans up) — then
    `fedapps run CONFIG --resume RUN_DIR`: the resumed run, in a new simulation whose nodes have new ids, ends with
    exactly the uninterrupted run's rounds.csv (timings aside) and summary (its wall time aside)."""
    from fedapps_tools.flwrcli import _proc_stat, descendants

    config = write_config(tmp_path / "cfg.yaml", **FLOWER)
    out = tmp_path / ("int" if how == "SIGINT" else "kil")
    # every client holds its round-3 reply back (it sleeps before computing: no state moves), so the stop lands
    # after round 2 however fast rounds 3-6 would be; the resumed run has no faults
    run = FlowerRun(config, "--output-dir", str(out), env={"FEDAPPS_FAULTS": "late=300@*/3"})
    run_dir = derived_run_dir(out, config)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.proc.poll() is None:
        if (run_dir / "rounds.csv").is_file() and len(rows(run_dir)) >= 2:
            break
        time.sleep(0.05)
    assert run.proc.poll() is None, run.output[-4000:]
    link = run.superlink
    started = {link: _proc_stat(link)[1], **descendants(link)}
    t0 = time.monotonic()
    if how == "SIGINT":
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(60) == 130, run.output[-4000:]
        assert time.monotonic() - t0 < 10, f"Ctrl-C took {time.monotonic() - t0:.1f} s"
    else:
        for pid, ticks in [(run.proc.pid, None), *started.items()]:
            st = _proc_stat(pid)
            if st is not None and (ticks is None or st[1] == ticks):
                os.kill(pid, signal.SIGKILL)
        run.wait(60)

    def alive() -> list[int]:
        return [pid for pid, ticks in started.items() if (_proc_stat(pid) or (0, -1))[1] == ticks]

    gone_by = time.monotonic() + 10  # a killed process with much memory takes a moment to exit on a busy machine
    while alive() and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not alive(), f"processes of the run still alive: {alive()}"
    stopped_at = len(rows(run_dir))
    assert stopped_at == 2 and not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "client-state").is_dir()

    resumed = FlowerRun(config, "--resume", str(run_dir))
    assert resumed.wait() == 0, resumed.output[-4000:]
    reference, reference_summary = flower_reference
    assert rows(run_dir) == reference  # every accuracy, loss, byte count and cohort, exactly
    summary = json.loads((run_dir / "summary.json").read_text())
    # the same summary but the wall time (the interrupted part up to its checkpoint, a new start-up, the rest) and
    # what names the run or the engine: the run's name (`fedapps run` adds the config's hash) and the Flower
    # simulation's message-sweep mode, which an in-process run has not
    engine = {"run_name", "simulation_message_sweep"}
    assert sorted(k for k in summary if k not in engine and summary[k] != reference_summary.get(k)) == ["wall_seconds"]
    assert sorted(set(reference_summary) - set(summary)) == []
    assert summary["run_name"].startswith(reference_summary["run_name"] + "-")
    assert not (run_dir / "checkpoint.pt").exists()
