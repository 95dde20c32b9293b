"""Reliability of `fedapps run` / `compare`: input errors exit 2 with a message, unusable runs exit non-zero,
skipped and reply-less rounds are recorded, compare resumes only runs made from the same config, and the
run owns its processes (unit tests here; the two `flwr run` process tests are in test_cli_processes.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import run_folder
from fedapps.config import ConfigError, check_run_name, config_hash, load_config, parse_yaml
from fedapps.flower import faults
from fedapps.reporting.results import (
    EXIT_FAILED,
    EXIT_REJECTED,
    EXIT_STATUSES,
    EXIT_UNMEASURED,
    DeliveryCheck,
    Problem,
    exit_status,
    last_round_problems,
    measured_problems,
    read_csv,
    rejection_problems,
    run_problems,
)
from fedapps_tools import cli, flwrcli, launch
from fedapps_tools.compare import resume_decision


def run_cli(*argv: str) -> int:
    return cli.main(list(argv))


# --------------------------------------------------------------------------- input errors -> exit 2


def test_duplicate_yaml_key_names_key_and_line(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 0\nrounds: 2\nclient:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' \(line 5; first at line 4\)"):
        load_config(path)
    assert run_cli("run", str(path), "--engine", "inprocess") == 2
    err = capsys.readouterr().err
    assert "duplicate key 'lr'" in err and str(path) in err


def test_duplicate_key_at_top_level_and_in_override():
    with pytest.raises(Exception, match="duplicate key 'rounds'"):
        parse_yaml("rounds: 1\nseed: 0\nrounds: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(None, ['strategy.params={"a":1,"a":2}'])
    assert parse_yaml("a: 1\nb: {c: 2}\n") == {"a": 1, "b": {"c": 2}}  # ordinary YAML still loads


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
        ("seed: 0\nrun_name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ],
)
def test_binary_or_non_utf8_config_exits_2(tmp_path, capsys, content, words):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert run_cli("run", str(path), "--engine", "inprocess") == 2
    err = capsys.readouterr().err
    assert words in err and str(path) in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["..", ".", "../escape", "/tmp/abs", "a/b", "a\\b", "   ", " x"])
def test_run_name_cannot_leave_the_output_folder(name, tiny_config, tmp_path, capsys):
    with pytest.raises(ConfigError, match="run_name"):
        check_run_name(name)
    out = tmp_path / "out"
    assert run_cli("run", str(tiny_config(run_name=name)), "--engine", "inprocess", "--output-dir", str(out)) == 2
    assert "run_name" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in tmp_path.iterdir() if p.suffix == ".yaml" or p == out
    )


def test_plain_run_names_are_fine():
    for name in ("", "fedavg-test", "run_1.2", "x..y"):
        check_run_name(name)


def test_data_error_exits_2_and_submits_no_run(tiny_config, capsys, monkeypatch):
    """A partition that cannot be built is a DataError (a ConfigError): exit 2 with a message, for both engines.
    The flower engine's SuperLink, launched to boot while the data are checked, is stopped again (its process gone,
    its FLWR_HOME removed) and no run is submitted."""
    cfg = tiny_config(data={"partition": "dirichlet", "min_samples": 1000})
    monkeypatch.setattr(launch, "run_with_flower", lambda *a, **k: pytest.fail("flwr must not start on a data error"))
    launched = []
    real_new_superlink = launch.new_superlink
    monkeypatch.setattr(launch, "new_superlink", lambda *a: launched.append(real_new_superlink(*a)) or launched[-1])
    for engine in ("inprocess", "flower"):
        assert run_cli("run", str(cfg), "--engine", engine) == 2
        err = capsys.readouterr().err
        assert "config error" in err and "min_samples" in err and "Traceback" not in err
    assert len(launched) == 1, "only the flower engine launches a SuperLink"
    link = launched[0]
    assert link.proc is not None and link.proc.poll() is not None, "the SuperLink was left running"
    assert not link.home.exists()


@pytest.mark.heavy
def test_the_command_exits_with_mains_code_and_its_output_flushed(tmp_path):
    """`python -m fedapps_tools.cli` (the `fedapps` console entry) leaves through os._exit: the exit code is main's
    and what was printed (stdout and stderr, also when piped) arrives whole."""
    import sys

    missing = tmp_path / "nothing-here.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "fedapps_tools.cli", "run", str(missing)],
        capture_output=True,
        text=True,
        cwd=Path(cli.__file__).resolve().parent.parent,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"config file '{missing}' not found" in proc.stderr
    table = "| method | accuracy |\n|---|---|\n" + "".join(f"| m{i} | 0.{i:03d} |\n" for i in range(2000))
    (tmp_path / "comparison.md").write_text(table)  # more than a pipe's buffer: printed, then os._exit
    proc = subprocess.run(
        [sys.executable, "-m", "fedapps_tools.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(cli.__file__).resolve().parent.parent,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == table


def test_unwritable_output_dir_exits_2_before_flower(tiny_config, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(launch, "run_with_flower", lambda *a, **k: pytest.fail("flwr must not start"))
    assert run_cli("run", str(tiny_config()), "--output-dir", str(blocker / "sub")) == 2
    err = capsys.readouterr().err
    assert "not writable" in err and "--output-dir" in err


def test_compare_duplicate_labels_exit_2(tiny_config, tmp_path, capsys):
    a = tiny_config()
    other = tmp_path / "x"
    other.mkdir()
    b = other / a.name
    b.write_text(a.read_text())
    assert (
        run_cli("compare", str(a), str(b), "--seeds", "0", "--engine", "inprocess", "--output-dir", str(tmp_path)) == 2
    )
    assert "share a file name" in capsys.readouterr().err


# --------------------------------------------------------------------------- quiet endings made loud


def failing_train(monkeypatch, fails):
    """Make the client 'train' operation raise for clients where fails(client_id) is true."""
    from fedapps.client.registry import OPERATIONS, ClientOp

    original = OPERATIONS["train"]

    def run(w, tag):
        if fails(w.client_id):
            raise RuntimeError(f"client {w.client_id}: disk on fire")
        return original.run(w, tag)

    monkeypatch.setitem(OPERATIONS, "train", ClientOp("train", run, original.default_tag))


def test_every_client_failing_fails_the_run(tiny_config, tmp_path, capsys, monkeypatch):
    failing_train(monkeypatch, lambda cid: True)
    out = tmp_path / "res"
    assert run_cli("run", str(tiny_config()), "--engine", "inprocess", "--output-dir", str(out)) == 1
    err = capsys.readouterr().err
    assert "no usable client reply" in err and "disk on fire" in err
    # the message counts what happened: 4 clients x 2 rounds of training messages, and nothing contradicts it (no
    # "minority of the replies" when none was usable, no "accuracy is from round None")
    assert "(8 training messages sent, 8 answered)" in err
    assert "minority" not in err and "round None" not in err
    summary = json.loads((run_folder(out) / "summary.json").read_text())
    # nothing was trained: what the evaluation-only message measured is the untrained initial model, and the run
    # is marked failed (problems, exit 1)
    assert summary["final_round"] == 2 and summary["usable_replies"] == 0
    assert summary["messages_sent"] == 8 and summary["messages_answered"] == 8  # they reached clients, all errors
    assert summary["problems"] and "no usable client reply" in summary["problems"][0]
    assert len(summary["problems"]) == 1  # the rest (rejected rounds, nothing measured) follows from it


def test_server_app_raises_so_flower_marks_the_run_failed(tiny_config, tmp_path, monkeypatch):
    import server_app
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.reporting.results import UnusableRun

    failing_train(monkeypatch, lambda cid: True)
    with pytest.raises(UnusableRun, match="no usable client reply"):
        server_app.run_experiment(InProcessGrid(4), str(tiny_config()), "", str(tmp_path))


def test_most_messages_never_delivered_fails_the_run(tiny_config, tmp_path, capsys, monkeypatch):
    from fedapps.flower.inprocess import InProcessGrid

    real = InProcessGrid
    monkeypatch.setattr("fedapps.flower.inprocess.InProcessGrid", lambda n: real(n, drop=lambda rnd, pid: pid != 0))
    out = tmp_path / "res"
    assert run_cli("run", str(tiny_config()), "--engine", "inprocess", "--output-dir", str(out)) == 1
    err = capsys.readouterr().err
    assert "only 2 of 8 sampled messages reached a client" in err
    summary = json.loads((run_folder(out) / "summary.json").read_text())
    assert summary["usable_replies"] == 2 and summary["accuracy_mean"] is not None  # results kept, run failed


def test_round_below_min_clients_is_skipped(tiny_config, tmp_path):
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    cfg = tiny_config(rounds=3, strategy={"name": "fedavg", "min_clients": 2})
    grid = InProcessGrid(4, drop=lambda rnd, pid: rnd == 2 and pid != 0)  # round 2: one usable reply
    summary = server_app.run_experiment(grid, str(cfg), "", str(tmp_path))
    rows = read_csv(tmp_path / "fedavg-digits-iid-s0" / "rounds.csv")
    assert [r["skipped"] for r in rows] == [0, 1, 0]
    assert [r["clients"] for r in rows] == [4, 1, 4]
    assert summary["skipped_rounds"] == [2] and summary["final_round"] == 3
    assert summary["final_round_had_no_replies"] is False
    # the skipped round is in rejections.csv too, with its reason (phase 'aggregate': the strategy's step)
    with (tmp_path / "fedavg-digits-iid-s0" / "rejections.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["phase"], r["node_id"]) for r in rows] == [("2", "aggregate", "")]
    assert "fedavg: round skipped: 1 usable replies, fewer than strategy.min_clients=2" in rows[0]["reason"]


def test_skipped_round_does_not_aggregate(tiny_config):
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.server.driver import RoundDriver
    from strategies import STRATEGIES

    cfg = load_config(tiny_config(rounds=2, strategy={"name": "fedavg", "min_clients": 3}))
    strategy = STRATEGIES["fedavg"](cfg)
    calls = []
    original = strategy.aggregate
    strategy.aggregate = lambda rnd, replies: calls.append(rnd) or original(rnd, replies)
    grid = InProcessGrid(4, drop=lambda rnd, pid: rnd == 2 and pid < 2)
    entries = [RoundDriver(strategy).run_round(grid, rnd, 60) for rnd in (1, 2)]
    assert calls == [1]
    assert [e.skipped for e in entries] == [False, True]
    assert [(e.sent, e.received) for e in entries] == [(4, 4), (4, 2)]


def test_last_round_without_replies_is_flagged(tiny_config, tmp_path, capsys):
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    grid = InProcessGrid(4, drop=lambda rnd, pid: rnd == 2)  # every message of round 2, not the evaluation after it
    summary = server_app.run_experiment(grid, str(tiny_config()), "", str(tmp_path))
    assert summary["final_round_had_no_replies"] is True
    # round 2 aggregated nothing, so its deployed models are round 1's, measured by the evaluation-only message
    assert summary["final_round"] == 2 and summary["rounds"] == 2 and summary["final_round_measured_clients"] == 4
    assert summary["accuracy_mean"] is not None and summary["problems"] == []
    on_disk = json.loads((tmp_path / "fedavg-digits-iid-s0" / "summary.json").read_text())
    assert on_disk["final_round_had_no_replies"] is True and on_disk["final_round"] == 2
    rows = read_csv(tmp_path / "fedavg-digits-iid-s0" / "rounds.csv")
    assert rows[0]["acc_mean"] is None  # round 1's deployed models rode on round 2's messages, all lost


# --------------------------------------------------------------------------- config hash and resume


def test_config_hash_ignores_where_not_what(tiny_config):
    from strategies import resolve

    def h(*overrides):
        cfg = load_config(tiny_config(), list(overrides))
        return config_hash(resolve(cfg).config(cfg))

    base = h()
    assert h("run_name=other", "output_dir=/elsewhere") == base
    assert h("client.lr=0.01") != base
    assert h("strategy.name=fedprox") != base
    assert h("strategy.name=fedprox", "strategy.params.fedprox.mu=0.5") != h("strategy.name=fedprox")
    assert len(base) == 64


def test_resume_decision(tmp_path):
    d = tmp_path / "run"
    assert resume_decision(d, 2, "abc") == (False, "running")
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"rounds": 2, "config_hash": "abc", "problems": []}))
    assert resume_decision(d, 2, "abc")[0] is True
    skip, why = resume_decision(d, 2, "abd")
    assert not skip and "config changed" in why
    assert not resume_decision(d, 3, "abc")[0]
    (d / "summary.json").write_text(json.dumps({"rounds": 2}))  # an older run: no hash stored
    assert resume_decision(d, 2, "abc") == (False, "rerunning (the earlier run stored no config hash)")
    (d / "config.sha256").write_text("abc\n")
    assert resume_decision(d, 2, "abc")[0] is True
    (d / "summary.json").write_text(json.dumps({"rounds": 2, "config_hash": "abc", "problems": ["no usable reply"]}))
    assert not resume_decision(d, 2, "abc")[0]
    (d / "summary.json").write_text("{broken")
    assert not resume_decision(d, 2, "abc")[0]
    # a complete run that lost replies to a round's timeout trained less than the config asks: run again
    (d / "summary.json").write_text(json.dumps({"rounds": 2, "config_hash": "abc", "problems": []}))
    (d / "rounds.csv").write_text("round,clients,replies_missing\n1,4,0\n2,2,2\n")
    skip, why = resume_decision(d, 2, "abc")
    assert not skip and "lost replies: 2 in round 2" in why
    (d / "rounds.csv").write_text("round,clients,replies_missing\n1,4,0\n2,4,0\n")
    assert resume_decision(d, 2, "abc")[0] is True


def test_run_writes_config_hash(tiny_config, tmp_path):
    from strategies import resolve

    path = tiny_config(rounds=1)
    assert run_cli("run", str(path), "--engine", "inprocess", "--output-dir", str(tmp_path)) == 0
    out = run_folder(tmp_path)
    cfg = load_config(path)
    expected = config_hash(resolve(cfg).config(cfg))
    assert (out / "config.sha256").read_text().strip() == expected
    assert json.loads((out / "summary.json").read_text())["config_hash"] == expected
    assert config_hash(load_config(out / "config.yaml")) == expected  # config.yaml is what was hashed


@pytest.mark.heavy
def test_compare_reruns_when_the_config_changed(tiny_config, tmp_path, capsys):
    cfg = tiny_config(rounds=1)
    args = ["compare", str(cfg), "--seeds", "0", "--engine", "inprocess", "--output-dir", str(tmp_path)]
    run_dir = tmp_path / "comparison" / "runs" / f"{cfg.stem}-s0"
    assert run_cli(*args) == 0
    first = json.loads((run_dir / "summary.json").read_text())
    capsys.readouterr()
    assert run_cli(*args) == 0
    assert "already complete with the same config, skipped" in capsys.readouterr().out
    assert run_cli(*args, "--set", "client.lr=0.01") == 0
    out = capsys.readouterr().out
    assert "config changed" in out and "skipped" not in out
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["config_hash"] != first["config_hash"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["client"]["lr"] == 0.01


def test_compare_continues_an_interrupted_run_from_its_checkpoint_to_the_uninterrupted_result(
    tiny_config, tmp_path, capsys
):
    """A run of the comparison SIGKILLed right after round 2 is resumed there (not trained again from round 1) and
    ends with exactly the rounds.csv of the same comparison made without the interruption."""
    import sys

    cfg = tiny_config(rounds=4)
    runs = {}
    for twin in ("ab", "cd"):  # results roots of equal path length: the state-dir path counts in bytes_down
        runs[twin] = tmp_path / twin / "comparison" / "runs"
    config = load_config(cfg, ["seed=0", f"run_name={cfg.stem}-s0"])
    killed = tmp_path / "killed.yaml"
    killed.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "seed": 0, "run_name": f"{cfg.stem}-s0"}))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "run_driver.py"), str(killed), str(runs["ab"])],
        env={**os.environ, "OMP_NUM_THREADS": "1", "FEDAPPS_TEST_KILL_AFTER_ROUND": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run_dir = runs["ab"] / config.resolved_run_name()
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "summary.json").exists()
    common = ["--seeds", "0", "--engine", "inprocess", "--quiet"]
    capsys.readouterr()
    assert run_cli("compare", str(cfg), *common, "--output-dir", str(tmp_path / "ab")) == 0
    assert "seed 0: resuming after round 2 (its checkpoint" in capsys.readouterr().out
    assert run_cli("compare", str(cfg), *common, "--output-dir", str(tmp_path / "cd")) == 0

    def rows(folder: Path) -> list[dict[str, str]]:
        with open(folder / "rounds.csv") as f:
            return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in csv.DictReader(f)]

    assert [r["round"] for r in rows(run_dir)] == ["1", "2", "3", "4"]
    assert rows(run_dir) == rows(runs["cd"] / config.resolved_run_name())


def test_compare_starts_over_when_the_checkpoint_is_of_another_config(tiny_config, tmp_path, capsys):
    """A checkpoint whose config differs (or that cannot be read) is not resumed: the folder is cleared first."""
    from fedapps import checkpoint
    from fedapps.config import dump_yaml
    from fedapps_tools.compare import checkpointed_round
    from strategies import resolve

    cfg = load_config(tiny_config(rounds=4))
    resolved = resolve(cfg).config(cfg)
    d = tmp_path / "run"
    d.mkdir()
    assert checkpointed_round(d, resolved) is None  # no checkpoint
    checkpoint.save_checkpoint(d, {"round": 2, "config": dump_yaml(resolved)})
    assert checkpointed_round(d, resolved) == 2
    other = load_config(tiny_config(rounds=4, client={"lr": 0.5}))
    assert checkpointed_round(d, resolve(other).config(other)) is None  # another config
    checkpoint.save_checkpoint(d, {"round": 4, "config": dump_yaml(resolved)})
    assert checkpointed_round(d, resolved) is None  # it covers every round: that run failed at its end
    (d / checkpoint.CHECKPOINT).write_bytes(b"not a checkpoint")
    assert checkpointed_round(d, resolved) is None


# --------------------------------------------------------------------------- owned processes


def test_free_port_is_bindable():
    import socket

    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_descendants_and_signal_only_the_noted_process():
    root = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        for _ in range(50):
            kids = launch.descendants(root.pid)
            if len(kids) >= 2:
                break
            time.sleep(0.1)
        assert len(kids) == 2
        pid, started = next(iter(kids.items()))
        flwrcli._signal(pid, started + 1, signal.SIGTERM)  # a different start time: another process, untouched
        time.sleep(0.2)
        assert launch._proc_stat(pid) is not None
        flwrcli._signal(pid, started, signal.SIGTERM)
        for _ in range(50):
            if launch._proc_stat(pid) is None:
                break
            time.sleep(0.1)
        assert launch._proc_stat(pid) is None
    finally:
        os.killpg(root.pid, signal.SIGTERM)
        root.wait(timeout=10)


def test_write_connection(tmp_path):
    import tomllib

    launch.write_connection(tmp_path, "127.0.0.1:4567")
    doc = tomllib.loads((tmp_path / "config.toml").read_text())
    assert doc["superlink"]["default"] == launch.CONNECTION
    assert doc["superlink"][launch.CONNECTION] == {"address": "127.0.0.1:4567", "insecure": True}


def test_resume_judges_an_earlier_run_by_its_config_under_todays_rules(tiny_config, tmp_path):
    """An earlier run is reused when its config.yaml computes the same thing as the config about to run, even if
    the hash it recorded came from older rules (keys added later, another data.root); a changed value re-runs."""
    from fedapps.config import dump_yaml
    from fedapps_tools.compare import resume_decision
    from strategies import resolve

    cfg = load_config(tiny_config(rounds=2))
    resolved = resolve(cfg).config(cfg)
    run = tmp_path / "run"
    run.mkdir()
    old = yaml.safe_load(dump_yaml(resolved))
    old["data"]["root"] = "/somewhere/else/data"  # another machine's data root
    del old["strategy"]["expected_clients"]  # a key added after the run was made
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    (run / "summary.json").write_text(json.dumps({"rounds": 2, "problems": [], "config_hash": "0" * 64}))
    assert resume_decision(run, 2, config_hash(resolved))[0] is True
    old["client"]["lr"] = resolved.client.lr * 2  # a real change: the earlier run computed something else
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    skip, why = resume_decision(run, 2, config_hash(resolved))
    assert skip is False and "config changed" in why


# --------------------------------------------------------------------------- exit statuses that mean something


def test_run_problems_by_hand():
    summary = {"num_clients": 10, "final_round_measured_clients": 5, "accuracy_mean": 0.5, "final_round": 3}
    assert measured_problems(summary, 0.5) == []
    [p] = measured_problems({**summary, "final_round_measured_clients": 4}, 0.5)
    assert p.code == EXIT_UNMEASURED and "measured on 4 of 10 clients" in p.text
    assert "min_measured_share=0.5 of them (5)" in p.text
    assert measured_problems({**summary, "final_round_measured_clients": 1}, 0.0) == []  # 0: one client is enough
    [p] = measured_problems({**summary, "accuracy_mean": None, "final_round_measured_clients": None}, 0.0)
    assert p.code == EXIT_UNMEASURED and "never measured" in p.text
    rows = [{"round": 1, "replies_ok": 2, "replies_rejected": 2}, {"round": 2, "replies_ok": 1, "replies_rejected": 2}]
    [p] = rejection_problems(rows)  # 2 of 4 is no majority; 2 of 3 is
    assert p.code == EXIT_REJECTED and "round 2: 2 of 3" in p.text and "round 1" not in p.text
    assert "aggregated a minority of their replies" in p.text
    [p] = rejection_problems([{"round": 1, "replies_ok": 0, "replies_rejected": 4}])
    assert "round 1: 4 of 4" in p.text and "nothing was aggregated" in p.text and "minority" not in p.text
    assert exit_status([]) == 0
    assert exit_status([Problem(EXIT_REJECTED, "a"), Problem(EXIT_UNMEASURED, "b")]) == EXIT_REJECTED
    found = run_problems({**summary, "final_round_measured_clients": 1}, rows, 0.5)
    assert [p.code for p in found] == [EXIT_REJECTED, EXIT_UNMEASURED]  # most basic first


def test_each_phase_is_counted_on_its_own():
    """The last round's final-evaluation replies (accepted) no longer outweigh its training replies (rejected): five
    rejected training replies beside five accepted evaluation replies were 5 of 10, no majority, and exited 0."""
    last = {
        "round": 3,
        "replies_ok": 5,
        "replies_rejected": 5,
        "train_replies_ok": 0,
        "train_replies_rejected": 5,
        "evaluate_replies_ok": 5,
        "evaluate_replies_rejected": 0,
    }
    [p] = rejection_problems([last])
    assert p.code == EXIT_REJECTED and "(round 3: 5 of 5)" in p.text and "training replies" in p.text
    assert rejection_problems([{**last, "train_replies_ok": 3, "train_replies_rejected": 2}]) == []  # 2 of 5: no
    # the final evaluation is judged by what it measured (the headline's rows), not by this rule
    assert rejection_problems([{**last, "train_replies_ok": 5, "train_replies_rejected": 0, "evaluate_replies_ok": 0,
                                "evaluate_replies_rejected": 5}]) == []  # fmt: skip
    # a row of a resumed run written before the per-phase columns: both phases together, as before
    assert rejection_problems([{"round": 1, "replies_ok": 5, "replies_rejected": 5}]) == []
    assert rejection_problems([{**last, "privacy_refused": 5}]) == []  # refusals past a privacy budget aside


def test_last_round_measurement_by_hand():
    """The last round's training replies measure the round before's deployed models: too few of the clients that
    answered (min_measured_share) is a problem, whatever the final evaluation measured; missing replies are the
    delivery check's."""
    before = {"round": 2, "measured_clients": 2}
    last = {"round": 3, "train_replies_ok": 2, "train_replies_rejected": 3}
    [p] = last_round_problems([before, last], 0.5)
    assert p.code == EXIT_UNMEASURED
    assert p.text.startswith("the last round (round 3) measured the deployed models after round 2 on 2 of the 5 ")
    assert "fewer than min_measured_share=0.5 of them (3)" in p.text
    assert last_round_problems([before, last], 0.4) == []  # 2 of 5 is enough at 0.4
    assert last_round_problems([{**before, "measured_clients": 3}, last], 0.5) == []
    assert last_round_problems([before, {**last, "train_replies_ok": 0, "train_replies_rejected": 0}], 0.5) == []
    assert last_round_problems([{**before, "measured_clients": None}, last], 0.5) == []  # a strategy that never does
    assert last_round_problems([last], 0.5) == []  # one round: nothing measured on its training replies


@pytest.mark.parametrize(
    "strategy, spec",
    [
        ("cwfedavg", "scale=100@4/1,2"),  # scaled ×100 in rounds 1-2, honest in round 3
        ("ifca", "scale=1000@4"),  # scaled ×1000 every round
    ],
)
def test_a_last_round_whose_training_replies_were_rejected_exits_non_zero(tmp_path, strategy, spec):
    """One hostile client (capture setting: digits, MLP, 5 clients) scales its model: the honest clients' next models
    blow up and their round-3 training replies are rejected (losses beyond 1e9), while the final evaluation's replies,
    measuring the wreck, are accepted. Counted together the last round had no majority of rejections and the run
    exited 0 with problems []; counted per phase it exits 4, and the last round measured too few (3)."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.reporting.results import UnusableRun
    from fedapps_tools import capture

    overrides = [o for o in capture.overrides(capture.case(f"{strategy}/scale"), "default") if "rounds=" not in o]
    grid = InProcessGrid(capture.CLIENTS, node_configs={i: {faults.NODE_KEY: spec} for i in range(5)})
    with pytest.raises(UnusableRun) as failed:
        server_app.run_experiment(grid, None, " ".join([*overrides, "rounds=3"]), str(tmp_path))
    assert failed.value.exit_status == EXIT_REJECTED
    rows = read_csv(tmp_path / "capture" / "rounds.csv")
    last = rows[-1]
    assert last["train_replies_rejected"] > last["train_replies_ok"]  # the training phase: mostly rejected ...
    assert last["evaluate_replies_ok"] == 5 and not last["evaluate_replies_rejected"]  # ... the evaluation: not
    assert 2 * last["replies_rejected"] <= last["replies_ok"] + last["replies_rejected"]  # together: no majority
    summary = json.loads((tmp_path / "capture" / "summary.json").read_text())
    assert summary["exit_status"] == EXIT_REJECTED and summary["final_round_measured_clients"] == 5
    assert summary["problems"][0].startswith("1 round(s) lost a majority of their training replies to rejection")
    assert f"(round 3: {last['train_replies_rejected']} of 5)" in summary["problems"][0]
    assert summary["problems"][1].startswith("the last round (round 3) measured the deployed models after round 2")


def exit_table() -> list[tuple[int, str]]:
    """docs/reliability.md's exit-code table: (code, case) per row, top to bottom."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    section = text.split("### Exit codes", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([a-z-]+)` \| .+ \|$", section, flags=re.M)
    return [(int(code), case) for code, case in rows]


def finished_problems(rows=None, min_share=0.5, delivery=None, **summary) -> list[Problem]:
    """The problems the ServerApp finds in a finished run (server_app: run_problems): clean unless told otherwise."""
    base = {"num_clients": 4, "final_round": 2, "final_round_measured_clients": 4, "accuracy_mean": 0.8}
    clean = [
        {"round": 1, "measured_clients": 4, "train_replies_ok": 4, "train_replies_rejected": 0},
        {"round": 2, "measured_clients": 4, "train_replies_ok": 4, "train_replies_rejected": 0,
         "evaluate_replies_ok": 4, "evaluate_replies_rejected": 0},
    ]  # fmt: skip
    rows = clean if rows is None else rows
    return run_problems({**base, **summary}, rows, min_share, delivery or delivered(8, 8, 8))


def delivered(sent: int, answered: int, usable: int, errors: tuple[str, ...] = ()) -> DeliveryCheck:
    """A delivery check after messages ``sent``, ``answered`` and ``usable`` replies, with these error replies."""
    from types import SimpleNamespace

    check = DeliveryCheck()
    if errors:
        check.on_round(SimpleNamespace(sent=0, received=0, replies=[], errors=list(errors)))
    vars(check).update(sent=sent, answered=answered, usable=usable)
    return check


UNREADABLE_STATE = (
    "<class 'fedapps.client.worker.PrivateStateError'>:<'client 3: saved private model unreadable: "
    "/run/client-state/3.r2.pt cannot be loaded (empty: ...); nothing in it was run. delete that file ...'>"
)


def test_the_exit_code_table_row_by_row(tiny_config, tmp_path, monkeypatch, capsys):
    """Every row of docs/reliability.md's exit-code table: its condition brought about (through the CLI for what the
    CLI decides, through run_problems for what a finished run's ServerApp decides) gives the row's code; every case
    is a row, and the conditions of a finished run are listed in the order run_problems checks them."""

    def cli_run(engine: str = "inprocess", *extra: str) -> int:
        return run_cli("run", str(tiny_config()), "--engine", engine, "--output-dir", str(tmp_path / "o"), *extra)

    def crashed() -> int:  # under flwr run: a status other than completed, and no summary.json verdict
        monkeypatch.setattr(launch, "start_run", lambda *a, **k: "7")
        monkeypatch.setattr(launch, "follow_run", lambda *a, **k: ("finished:failed", ["ERROR: boom"]))
        return cli_run("flower", "--superlink", "127.0.0.1:1")

    def interrupted() -> int:
        def stop(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(launch, "run_in_process", stop)
        return cli_run()

    last_round_few = [
        {"round": 1, "measured_clients": 1, "train_replies_ok": 4, "train_replies_rejected": 0},
        {"round": 2, "measured_clients": 4, "train_replies_ok": 2, "train_replies_rejected": 2},
    ]
    finished = {  # a finished run's conditions: the problems the ServerApp finds, its exit status the first one's
        "no-usable-reply": dict(delivery=delivered(8, 8, 0)),
        "undelivered": dict(delivery=delivered(8, 3, 3)),
        "private-state-unreadable": dict(delivery=delivered(8, 8, 6, (UNREADABLE_STATE,))),
        "training-rejected": dict(
            rows=[{"round": 1, "measured_clients": 4, "train_replies_ok": 1, "train_replies_rejected": 3}]
        ),
        "never-measured": dict(accuracy_mean=None, final_round_measured_clients=None),
        "measured-on-few": dict(final_round_measured_clients=1),
        # 2 of 4 training replies accepted (no majority rejected), at min_measured_share 0.75: 1 measured, 3 needed
        "last-round-measured-few": dict(rows=last_round_few, min_share=0.75),
        "ok": {},
    }
    cli_cases = {
        "config": lambda: run_cli("run", str(tmp_path / "missing.yaml"), "--engine", "inprocess"),
        "crashed": crashed,
        "interrupted": interrupted,
    }
    table = exit_table()
    assert sorted(case for _, case in table) == sorted([*finished, *cli_cases]), table
    for code, case in table:
        if case in cli_cases:
            with monkeypatch.context():
                assert cli_cases[case]() == code, case
        else:
            found = finished_problems(**finished[case])
            assert [p.case for p in found] == ([case] if code else []), (case, found)
            assert exit_status(found) == code, case

    # a finished run's conditions are checked in the table's order, top to bottom
    def everything(usable: int) -> list[Problem]:  # all of them but never-measured (the headline cannot be both)
        return finished_problems(
            rows=[{**last_round_few[0], "measured_clients": 0}, {**last_round_few[1], "train_replies_ok": 0}],
            delivery=delivered(8, 3, usable, (UNREADABLE_STATE,)),
            final_round_measured_clients=1,
        )

    order = [case for _, case in table if case in finished and case not in ("ok", "never-measured", "no-usable-reply")]
    assert [p.case for p in everything(1)] == order and exit_status(everything(1)) == EXIT_FAILED
    # no usable reply at all: the delivery rows alone (rejected rounds and too few measured follow from it)
    delivery_cases = ["no-usable-reply", "undelivered", "private-state-unreadable"]
    assert [p.case for p in everything(0)] == delivery_cases
    assert {code for code, _ in table} == set(EXIT_STATUSES)  # `fedapps run --help` lists the same codes


def grid_with(monkeypatch, **kwargs):
    """`fedapps run --engine inprocess` serves its clients through an InProcessGrid built with ``kwargs``."""
    from fedapps.flower.inprocess import InProcessGrid

    real = InProcessGrid
    monkeypatch.setattr("fedapps.flower.inprocess.InProcessGrid", lambda n: real(n, **kwargs))


@pytest.mark.parametrize("share, code", [(0.5, EXIT_UNMEASURED), (0.25, 0)])
def test_a_headline_measured_on_too_few_clients_exits_3(tiny_config, tmp_path, capsys, monkeypatch, share, code):
    # the evaluation-only message after the last round (group 3) reaches client 0 only: 1 of 4 clients measured
    grid_with(monkeypatch, drop=lambda rnd, pid: rnd == 3 and pid != 0)
    out = tmp_path / "res"
    assert (
        run_cli("run", str(tiny_config(min_measured_share=share)), "--engine", "inprocess", "--output-dir", str(out))
        == code
    )
    summary = json.loads((run_folder(out) / "summary.json").read_text())
    assert summary["final_round_measured_clients"] == 1 and summary["exit_status"] == code
    if code:
        assert summary["problems"] == [
            (
                "the headline was measured on 1 of 4 clients (after round 2), fewer than "
                "min_measured_share=0.5 of them (2)"
            )
        ]
        assert "measured on 1 of 4 clients" in capsys.readouterr().err
    else:
        assert summary["problems"] == []


def test_a_run_whose_headline_was_never_measured_exits_3(tiny_config, tmp_path, capsys, monkeypatch):
    grid_with(monkeypatch, drop=lambda rnd, pid: rnd == 2)  # 1 round: its evaluation-only message (group 2) is lost
    out = tmp_path / "res"
    assert run_cli("run", str(tiny_config(rounds=1)), "--engine", "inprocess", "--output-dir", str(out)) == 3
    summary = json.loads((run_folder(out) / "summary.json").read_text())
    assert summary["accuracy_mean"] is None and summary["exit_status"] == 3
    assert summary["problems"] == [
        (
            "the headline (deployed-model accuracy) was never measured: no client answered "
            "an evaluation of its deployed model"
        )
    ]


def test_a_round_that_lost_most_replies_to_rejection_exits_4(tiny_config, tmp_path, capsys, monkeypatch):
    grid_with(monkeypatch, node_configs={i: {"faults": "f64-huge@1,2,3/1"} for i in range(4)}, mods=[faults.faults_mod])
    out = tmp_path / "res"
    assert run_cli("run", str(tiny_config()), "--engine", "inprocess", "--output-dir", str(out)) == EXIT_REJECTED
    run_dir = run_folder(out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_status"] == EXIT_REJECTED and len(summary["problems"]) == 1
    assert (
        "1 round(s) lost a majority of their training replies to rejection (round 1: 3 of 4)" in summary["problems"][0]
    )
    assert summary["final_round_measured_clients"] == 4  # the headline itself was measured on every client
    rows = read_csv(run_dir / "rounds.csv")
    assert [r["replies_rejected"] for r in rows] == [3, 0]
    assert rows[0]["bytes_up_rejected"] > 3 * 10_000 and rows[1]["bytes_up_rejected"] == 0  # 3 float64 MLPs
    assert summary["bytes_up_rejected"] == rows[0]["bytes_up_rejected"]
    assert rows[0]["bytes_up"] < rows[1]["bytes_up"]  # one accepted reply's bytes against four's
    assert "lost a majority of their training replies" in capsys.readouterr().err


def test_the_exit_statuses_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        run_cli("run", "--help")
    text = " ".join(capsys.readouterr().out.split())
    for code in (
        "0 the run finished",
        "1 the run failed",
        "2 refused",
        "3 finished, but the headline",
        "4 finished, but some round lost a majority",
        "130 interrupted",
    ):
        assert code in text, code


def test_a_partition_leaving_clients_without_a_test_split_is_refused(tiny_config, tmp_path, capsys):
    cfg = tiny_config(data={"source": "digits", "partition": "iid", "num_clients": 1000})
    assert run_cli("run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path / "res")) == 2
    err = capsys.readouterr().err
    assert "data.source=digits data.num_clients=1000" in err and "without a test split" in err
    assert "at most data.num_clients=599 gives every client training data and a test split" in err
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())  # refused before anything ran
    # the count it names works (and one more does not)
    from fedapps.data import get_federation

    fed = get_federation({**load_config(cfg).to_dict()["data"], "num_clients": 599})
    assert fed.test_counts.sum(axis=1).min() >= 1 and fed.train_counts.sum(axis=1).min() >= 1
    with pytest.raises(ConfigError, match="without a test split"):
        get_federation({**load_config(cfg).to_dict()["data"], "num_clients": 600})


def test_a_validation_split_left_empty_is_refused(tiny_config):
    from fedapps.data import get_federation

    data = {
        **load_config(tiny_config()).to_dict()["data"],
        "num_clients": 300,
        "evaluate_on": "validation",
        "validation_fraction": 0.05,
    }
    with pytest.raises(
        ConfigError,
        match=r"data\.validation_fraction=0\.05\) leaves 300 of the 300 clients without a "
        r"validation split .* at most data\.num_clients=119 ",
    ):
        get_federation(data)
