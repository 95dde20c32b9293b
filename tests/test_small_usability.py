"""The small things a user trips on: Ctrl-C says how to go on (and the printed command runs), Flower's colour codes
stay out of a piped log, one traffic unit (MiB), no "± 0.0000" from one seed, a misspelt name gets a "did you mean"."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys

import pytest

from conftest import run_folder, write_config
from fedapps.config import ConfigError, did_you_mean, load_config
from fedapps_tools import cli, interrupted
from fedapps_tools.compare import _pm, markdown_table
from fedapps_tools.logfilter import for_output


def test_an_interrupted_run_prints_a_resume_command_that_runs_as_printed(tmp_path, capsys, monkeypatch):
    from fedapps import checkpoint

    config = write_config(tmp_path / "cfg.yaml", rounds=2)
    out = tmp_path / "out"
    original = checkpoint.save_checkpoint

    def save_then_interrupt(run_dir, data):  # Ctrl-C right after round 1's checkpoint
        original(run_dir, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_interrupt)
    argv = ["run", str(config), "--engine", "inprocess", "--output-dir", str(out), "--set", "client.lr=0.05"]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    run_dir = run_folder(out)
    assert f"its checkpoint is in {run_dir}" in err
    command = re.search(r"resume the run from its last finished round with:\n  (.+)\n", err).group(1)
    assert command == shlex.join(["fedapps", *argv, "--resume", str(run_dir)])
    monkeypatch.setattr(checkpoint, "save_checkpoint", original)
    assert cli.main(shlex.split(command)[1:]) == 0  # as printed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_round"] == 2


def test_the_resume_hint_without_a_checkpoint_and_for_compare(tmp_path):
    run_dir = tmp_path / "r"
    cmd, resumes = interrupted.resume_command(["run", "c.yaml", "--resume", "old"], None)
    assert cmd == "fedapps run c.yaml --resume old" and not resumes  # nothing known: the command again
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("x")
    cmd, resumes = interrupted.resume_command(["run", "c.yaml"], run_dir)
    assert cmd == "fedapps run c.yaml --overwrite" and not resumes  # a new run refuses a used folder
    assert "no round was checkpointed" in interrupted.message(["run", "c.yaml"], run_dir)
    cmd, resumes = interrupted.resume_command(["compare", "a.yaml", "b.yaml", "--seeds", "0", "1"], None)
    assert cmd == "fedapps compare a.yaml b.yaml --seeds 0 1" and resumes
    assert interrupted.without_resume(["run", "c", "--resume=x", "--quiet"]) == ["run", "c", "--quiet"]


def test_flowers_colour_codes_stay_out_of_a_pipe(monkeypatch):
    from fedapps_tools.flwrcli import LogStream

    line = "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation\n"
    assert for_output(line, terminal=False) == "INFO :      Starting Flower Simulation\n"
    assert for_output(line, terminal=True) == line
    piped = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stdout", piped)
    stream = LogStream.__new__(LogStream)
    stream.lines, stream._quiet, stream._filter = [], False, None
    stream._emit(line)
    assert piped.getvalue() == "INFO :      Starting Flower Simulation\n" and "\x1b" not in piped.getvalue()
    assert stream.lines == [line]  # kept as received for the failure report


def test_round_lines_and_summaries_speak_mib(tmp_path, capsys):
    config = write_config(tmp_path / "cfg.yaml", rounds=1)
    assert cli.main(["run", str(config), "--engine", "inprocess", "--output-dir", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    round_line = next(line for line in text.splitlines() if "round 1/1" in line)
    up = float(re.search(r"up ([0-9.]+) MiB", round_line).group(1))
    summary = json.loads(next((tmp_path / "o").iterdir()).joinpath("summary.json").read_text())
    assert up == pytest.approx(summary["bytes_up"] / 2**20, abs=0.006)
    assert not re.search(r"\d MB\b", text), "a traffic figure in MB"


def test_one_seed_prints_no_plus_minus_zero():
    row = {"seeds": 1, "accuracy_mean": 0.95, "accuracy_mean_sem": 0.0}
    assert _pm(row, "accuracy_mean") == "0.9500"
    assert _pm({**row, "seeds": 3, "accuracy_mean_sem": 0.01}, "accuracy_mean") == "0.9500 ± 0.0100"
    table = markdown_table(
        [
            {
                "config": "a",
                "strategy": "fedavg",
                "seeds": 1,
                **dict.fromkeys(("accuracy_mean", "accuracy_weighted", "accuracy_worst10", "accuracy_std"), 0.5),
                **dict.fromkeys(("accuracy_mean_sem", "accuracy_weighted_sem", "accuracy_worst10_sem"), 0.0),
                "accuracy_std_sem": 0.0,
                "accuracy_after_training_mean": 0.4,
                "accuracy_after_training_mean_sem": 0.0,
                "bytes_up_per_client_round": 1.0,
                "bytes_down_per_client_round": 1.0,
                "wall_seconds": 1.0,
            }
        ]
    )
    assert "± 0.0000" not in table and "| 0.5000 |" in table


def test_a_misspelt_name_gets_a_did_you_mean(tmp_path):
    assert did_you_mean("fedavgg", ["fedavg", "cwfedavg", "local"]) == " (did you mean 'fedavg' or 'cwfedavg'?)"
    assert did_you_mean("FedAvg", ["fedavg", "local"]) == " (did you mean 'fedavg'?)"
    assert did_you_mean("zzz", ["fedavg", "local"]) == ""
    config = write_config(tmp_path / "cfg.yaml")
    from strategies import resolve

    for override, hint in (
        ("strategy.name=fedprx", "did you mean 'fedprox'"),
        ("data.partiton=iid", "did you mean 'partition'"),
        ("client.device=cude", "did you mean 'cuda'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(hint)):
            resolve(load_config(config, [override]))
