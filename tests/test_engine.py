"""The in-process engine serves clients concurrently, each with its own deadline: a slow or hung client cannot time
out the others, and is abandoned (counted missing) at its deadline; results do not depend on how many clients are
served at once; Ctrl-C stops a run within a few seconds. A run folder is either a new run's or a resumed run of the
same config; a finished run removes its resume state unless asked to keep it."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import server_app
from fedapps.config import ConfigError
from fedapps.flower import faults
from fedapps.flower.inprocess import InProcessGrid, default_workers
from strategies import STRATEGIES
from tests.conftest import write_config

ROOT = Path(__file__).resolve().parent.parent
TIMING = "seconds"  # how measured durations end (wall_seconds, client_train_seconds): the only columns that may differ


def rows(run_dir: Path, timing: bool = False) -> list[dict[str, str]]:
    with (run_dir / "rounds.csv").open() as fh:
        return [{k: v for k, v in r.items() if timing or not k.endswith(TIMING)} for r in csv.DictReader(fh)]


def run(grid: InProcessGrid, config: Path, out: Path, overrides: str = "", **kwargs) -> Path:
    summary = server_app.run_experiment(grid, str(config), overrides, str(out), **kwargs)
    return Path(summary["run_dir"]) if "run_dir" in summary else next(out.iterdir())


def faulty(n: int, spec: str, workers: int = 2) -> InProcessGrid:
    return InProcessGrid(
        n, node_configs={i: {"faults": spec} for i in range(n)}, mods=[faults.faults_mod], workers=workers
    )


# --------------------------------------------------------------------------- slow and hung clients


@pytest.mark.heavy
def test_a_slow_client_served_first_does_not_time_out_the_others(tiny_config, tmp_path):
    """Client 0 (served first) takes 20 s in round 2, past the 6 s timeout: it alone is missing, the other four
    reply (served one after another within one deadline, all five were missing: the slow one used up the time);
    its node is still busy when the evaluation-only phase asks it. (Round 1 warms up: a process's first training
    step imports parts of torch, ~2 s on a busy machine.)"""
    cfg = tiny_config(rounds=2, data={"num_clients": 5}, strategy={"name": "fedavg", "timeout": 6})
    t0 = time.monotonic()
    got = rows(run(faulty(5, "late=20@0/2"), cfg, tmp_path / "out"))
    assert [(r["replies_ok"], r["replies_missing"], r["clients"]) for r in got] == [("5", "0", "5"), ("8", "2", "4")]
    assert time.monotonic() - t0 < 20


@pytest.mark.heavy
def test_a_hung_client_is_abandoned_every_round_and_the_run_goes_on(tiny_config, tmp_path):
    """Client 1 hangs (300 s) in round 2: abandoned at its 4 s deadline; its node is still busy in round 3, so
    the messages to it are missing too; the run ends in seconds with the others' results."""
    cfg = tiny_config(rounds=3, data={"num_clients": 3}, strategy={"name": "fedavg", "timeout": 4})
    t0 = time.monotonic()
    got = rows(run(faulty(3, "late=300@1/2"), cfg, tmp_path / "out"))
    assert time.monotonic() - t0 < 40
    assert [r["replies_missing"] for r in got] == ["0", "1", "2"]  # the last round: its evaluation-only phase too
    assert [r["clients"] for r in got] == ["3", "2", "2"]
    assert got[-1]["acc_client_1"] == "" and got[-1]["acc_client_0"] != ""


def test_a_node_busy_with_an_abandoned_message_serves_the_next_one_after_it(tmp_path):
    """Messages to one node never overlap: the second waits for the first (abandoned, still running) within its
    own deadline."""
    from flwr.app import Message, RecordDict

    from fedapps.wire import protocol

    active, overlaps = [], []

    def mod(msg, ctx, call_next):  # a client that takes 0.6 s and replies with nothing
        active.append(1)
        overlaps.append(len(active))
        time.sleep(0.6)
        active.pop()
        return Message(RecordDict(), reply_to=msg)

    grid = InProcessGrid(1, mods=[mod], workers=4)
    request = protocol.Request(ops=(), round=0, setup=protocol.Setup(data={"source": "digits", "num_clients": 1}))
    msg = lambda: protocol.Draft(100, request, message_type=protocol.QUERY_MESSAGE_TYPE).message()  # noqa: E731
    assert grid.send_and_receive([msg()], timeout=0.2) == []  # abandoned at 0.2 s, runs on
    (reply,) = grid.send_and_receive([msg()], timeout=5.0)  # waits for the node, then served
    assert not reply.has_error() and overlaps == [1, 1]


def test_through_the_wire_a_node_keeps_its_records_and_loses_what_is_not_in_them():
    """``wire=True``: each message is served on a Context decoded from Flower's encoding of the node's Context (a new
    object every time), whose ``state`` records come back to the node and whose other attributes do not; replies are
    decoded copies. Without it, the node's own Context object."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedapps.wire import protocol

    def run_twice(wire):
        seen = []

        def mod(msg, ctx, call_next):  # a client counting its messages in its state, and in an attribute
            count = int(ctx.state["n"]["n"]) + 1 if "n" in ctx.state else 1
            ctx.state["n"] = ConfigRecord({"n": count})
            seen.append((ctx, count, getattr(ctx, "scratch", None)))
            ctx.scratch = count
            return Message(RecordDict({"n": ConfigRecord({"n": count})}), reply_to=msg)

        grid = InProcessGrid(1, mods=[mod], wire=wire)
        request = protocol.Request(ops=(), round=0, setup=protocol.Setup(data={"source": "digits", "num_clients": 1}))
        replies = []
        for _ in range(2):
            msg = protocol.Draft(100, request, message_type=protocol.QUERY_MESSAGE_TYPE).message()
            (reply,) = grid.send_and_receive([msg])
            replies.append(int(reply.content["n"]["n"]))
        return seen, replies

    seen, replies = run_twice(wire=True)
    assert [c for _, c, _ in seen] == [1, 2] == replies and [s for _, _, s in seen] == [None, None]
    assert seen[0][0] is not seen[1][0]
    seen, replies = run_twice(wire=False)
    assert [c for _, c, _ in seen] == [1, 2] == replies and [s for _, _, s in seen] == [None, 1]
    assert seen[0][0] is seen[1][0]


# --------------------------------------------------------------------------- results independent of concurrency


@pytest.mark.heavy
def test_rounds_are_the_same_whatever_the_number_of_workers_with_dropout(tiny_config, tmp_path):
    """One client at a time or four at once: identical rounds.csv (timings aside). SqueezeNet has dropout (torch's
    global RNG, seeded per message): its messages hold the process's RNG lock (without it they differ)."""
    data = {"source": "synthetic", "synthetic_shape": [3, 16, 16], "synthetic_samples": 240}
    cfg = tiny_config(rounds=2, model={"name": "squeezenet"}, data=data, strategy={"name": "ditto"})
    one = rows(run(InProcessGrid(4, workers=1), cfg, tmp_path / "w1"))
    four = rows(run(InProcessGrid(4, workers=4), cfg, tmp_path / "w4"))
    assert one == four and all(r["acc_mean"] != "" for r in one[1:])


SHRINK = {
    "cosmos": ["server_model=mlp", "pretrain_epochs=1", "server_epochs=1", "distill_epochs=1"],
    "fedmd": ["pretrain_epochs=1", "distill_epochs=1"],
    "fedct": ["pretrain_epochs=1", "distill_epochs=1"],
    "comet": ["pretrain_epochs=1", "distill_epochs=1", "clusters=2"],
    "fedamp": ["lam=0.01"],
    "ifca": ["clusters=2"],
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_gives_the_same_rounds_whatever_the_workers_and_through_flowers_wire_format(strategy, tmp_path):
    """A client operation that shares process-wide state (a module, torch's RNG, a global hook) gives other numbers,
    or errors, when clients are served at once; 1 and 4 workers must agree exactly. The 4-worker run also sends every
    message, reply and node Context through Flower's protobuf encoding and back (``wire=True``, as `flwr run` does):
    client state kept outside ``context.state``'s records, or anything relying on a message or Context being the same
    object from one call to the next, fails or changes the numbers (a difference here is either cause: rerun without
    ``wire`` to tell)."""
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}")
    overrides = " ".join(
        [
            f"strategy.name={strategy}",
            "rounds=2",
            "data.source=digits",
            "data.partition=pathological",
            "data.num_clients=4",
            "client.epochs=1",
            "client.batch_size=16",
            "model.name=mlp",
            "data.public_fraction=0.2",
            "run_name=w",
            *(f"strategy.params.{strategy}.{kv}" for kv in SHRINK.get(strategy, [])),
        ]
    )
    one = rows(run(InProcessGrid(4, workers=1), cfg, tmp_path / "w1", overrides))
    four = rows(run(InProcessGrid(4, workers=4, wire=True), cfg, tmp_path / "w4", overrides))
    assert one == four and [r["replies_rejected"] for r in one] == ["0", "0"]


def test_each_client_trains_on_one_torch_thread(tiny_config, tmp_path):
    """Served on the engine's threads, a client's torch uses the process's one thread (no oversubscription)."""
    seen: set[int] = set()

    def mod(msg, ctx, call_next):
        seen.add(torch.get_num_threads())
        return call_next(msg, ctx)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(InProcessGrid(4, mods=[mod], workers=4), tiny_config(rounds=1), tmp_path / "out")
    finally:
        torch.set_num_threads(previous)
    assert seen == {1}


def test_default_workers_reads_the_environment(monkeypatch):
    monkeypatch.setenv("FEDAPPS_INPROCESS_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.setenv("FEDAPPS_INPROCESS_WORKERS", "zero")
    with pytest.raises(ValueError, match="FEDAPPS_INPROCESS_WORKERS"):
        default_workers()
    monkeypatch.delenv("FEDAPPS_INPROCESS_WORKERS")
    assert default_workers() == len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- Ctrl-C


@pytest.mark.heavy
def test_ctrl_c_stops_an_in_process_run_within_seconds(tmp_path):
    """SIGINT to `fedapps run --engine inprocess` in round 2, while client 0 hangs in its message: exit 130 in a few
    seconds, no round written after the signal, the checkpoint kept for --resume."""
    cfg = write_config(tmp_path / "cfg.yaml", rounds=200, run_name="intr")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDAPPS_FAULTS": "late=300@0/2"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedapps_tools.cli",
            "run",
            str(cfg),
            "--engine",
            "inprocess",
            "--output-dir",
            str(tmp_path / "out"),
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = tmp_path / "out" / "intr"
    deadline = time.monotonic() + 120
    while not ((run_dir / "rounds.csv").is_file() and len(rows(run_dir)) >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # round 2 is running, client 0 asleep in it
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, out[-3000:]
    assert took < 5, f"exit took {took:.1f} s"
    assert len(rows(run_dir)) == 1 and (run_dir / "checkpoint.pt").is_file()


# --------------------------------------------------------------------------- the run folder


@pytest.mark.heavy
def test_a_new_run_into_a_used_folder_is_refused(tiny_config, tmp_path):
    """A FedAvg run into the folder of a cwFedAvg run (same run_name) would keep the other's estimates and figures:
    refused (exit 2) before anything is written, naming how to go on."""
    from fedapps_tools import cli

    first = tiny_config(run_name="same", strategy={"name": "cwfedavg"}, data={"partition": "pathological"})
    out = tmp_path / "out"
    assert cli.main(["run", str(first), "--engine", "inprocess", "--output-dir", str(out), "--quiet"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (out / "same").iterdir()}
    assert "estimates.csv" in before
    second = tiny_config(run_name="same", strategy={"name": "fedavg"})
    assert cli.main(["run", str(second), "--engine", "inprocess", "--output-dir", str(out), "--quiet"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in (out / "same").iterdir()} == before
    with pytest.raises(ConfigError, match=r"already holds a run .*mv .*--set run_name=NAME") as info:
        server_app.run_experiment(InProcessGrid(4), str(second), "", str(out))
    assert "--resume" not in str(info.value)  # a finished run: nothing to continue


def test_an_interrupted_run_folder_names_resume(tiny_config, tmp_path):
    from fedapps import checkpoint

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / checkpoint.CHECKPOINT).write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"--resume {folder}")):
        checkpoint.check_fresh(folder)
    checkpoint.check_fresh(tmp_path / "new")  # a folder that does not exist, or an empty one, is fine
    (tmp_path / "empty").mkdir()
    checkpoint.check_fresh(tmp_path / "empty")


@pytest.mark.heavy
def test_a_finished_run_removes_its_resume_state_unless_kept(tiny_config, tmp_path):
    """cwFedAvg keeps private models on the clients (client-state/) and its stack on the server (server-state/):
    both, and checkpoint.pt, are gone after a successful end; --keep-state keeps them."""
    cfg = tiny_config(rounds=2, strategy={"name": "cwfedavg"}, data={"partition": "pathological"})
    kept = []

    def after_round(k):
        kept.append(
            sorted(p.name for p in folder.iterdir() if p.name in ("checkpoint.pt", "client-state", "server-state"))
        )

    folder = tmp_path / "a" / "cwfedavg-digits-pathological-s0"
    run(InProcessGrid(4), cfg, tmp_path / "a", after_round=after_round)
    assert kept[-1] == ["checkpoint.pt", "client-state", "server-state"]  # there while the run went
    assert not [p.name for p in folder.iterdir() if p.name in ("checkpoint.pt", "client-state", "server-state")]
    folder = tmp_path / "b" / "cwfedavg-digits-pathological-s0"
    run(InProcessGrid(4), cfg, tmp_path / "b", keep_state=True)
    assert {"checkpoint.pt", "client-state", "server-state"} <= {p.name for p in folder.iterdir()}


def test_a_resumed_run_keeps_the_rejections_of_the_rounds_it_does_not_repeat(tiny_config, tmp_path):
    """rejections.csv of a run stopped after round 2's checkpoint (round 3 ran on, unsaved) and resumed: the rows
    of rounds 1-2 stay, round 3's earlier rows are dropped, the repeated rounds add theirs."""
    cfg = tiny_config(rounds=4)

    class Stop(Exception):
        pass

    def stop_after(k):
        if k == 3:
            raise Stop

    grid = faulty(4, "raise@1/*")
    with pytest.raises(Stop):
        server_app.run_experiment(grid, str(cfg), "", str(tmp_path / "out"), after_round=stop_after)
    run_dir = tmp_path / "out" / "fedavg-digits-iid-s0"
    from fedapps import checkpoint

    saved = checkpoint.load(run_dir / "checkpoint.pt")
    saved["round"], saved["rows"] = 2, saved["rows"][:2]  # as if killed after round 3's rows, before its checkpoint
    checkpoint.save_checkpoint(run_dir, {k: v for k, v in saved.items() if k != "format"})
    server_app.run_experiment(faulty(4, "raise@1/*"), str(cfg), "", str(tmp_path / "out"), resume_dir=str(run_dir))
    with (run_dir / "rejections.csv").open() as fh:
        assert [r["round"] for r in csv.DictReader(fh)] == ["1", "2", "3", "4"]
