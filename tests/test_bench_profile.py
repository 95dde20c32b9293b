"""The per-message benchmarks' arithmetic (bench/fedrun.py) by hand, bench/message_profile.py end to end on a tiny
in-process setting, bench/gpu_check.py's CPU fallback and size flags, and the bare loop it holds Flower against."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str):
    """A bench module, loaded as the benchmarks load each other (bench/ on sys.path)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def row(clients: int, wall: float, exchange: float, client_wall: float, **phases: float) -> dict[str, str]:
    out = {"clients": str(clients), "wall_seconds": str(wall), "client_wall_seconds": str(client_wall)}
    for name in load("fedrun").PHASES:
        out[f"client_{name}_seconds"] = str(phases.get(name, 0.0))
    steps = {"exchange": exchange, "messages": 0.05, "replies": 0.05, "aggregate": wall - exchange - 0.1}
    out.update({f"round_{step}_seconds": str(seconds) for step, seconds in steps.items()})
    return out


def test_the_breakdown_per_message_by_hand():
    fedrun = load("fedrun")
    rows = [row(4, 1.0, 0.9, 1.6, train=1.2, model=0.2), row(6, 2.0, 1.6, 2.4, train=2.0, encoding=0.1)]
    b = fedrun.breakdown(rows, workers=2, span=3.5)
    assert b.messages == 10
    assert b.phases["train"] == pytest.approx(320.0)  # (1.2 + 2.0) s / 10 messages
    assert b.phases["model"] == pytest.approx(20.0) and b.phases["encoding"] == pytest.approx(10.0)
    assert b.client == pytest.approx(400.0)
    assert b.unattributed == pytest.approx(400.0 - 350.0)
    assert b.worker == pytest.approx(700.0)  # 2 workers x 3.5 s / 10 messages
    assert b.framework == pytest.approx(300.0)
    assert b.exchange == pytest.approx(2 * 2.5 * 100 - 400.0)  # 2 workers x 2.5 s exchanging / 10 messages - client
    assert b.server == pytest.approx(2 * 0.5 * 100)  # the server's steps: 0.5 s
    assert b.between == pytest.approx(2 * 0.5 * 100)  # 3.5 s end to end, 3 s in the rounds
    assert b.exchange + b.server + b.between == pytest.approx(b.framework)
    assert fedrun.breakdown(rows, workers=2).between == 0.0  # no span: the rounds' walls


def test_a_run_measures_its_rounds_and_their_span():
    fedrun = load("fedrun")
    run = fedrun.Run([{"round": str(r)} for r in range(1, 6)], {}, 1.0, 2, {1: 10.0, 2: 11.0, 4: 13.5, 5: 15.0})
    assert [r["round"] for r in run.measured()] == ["2", "3", "4"]
    assert run.measured_span() == 3.5  # from round 1's row to round 4's
    assert fedrun.Run(run.rows, {}, 1.0, 2).measured_span() is None


def test_message_profile_prints_the_breakdown_on_a_tiny_in_process_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDAPPS_BENCH_RESULTS", str(tmp_path))
    bench = load("message_profile")
    argv = ["--engine", "inprocess", "--strategies", "fedavg", "--clients", "2", "--rounds", "3"]
    results = bench.main([*argv, "--source", "digits", "--model", "mlp", "--workers", "1"])
    out = capsys.readouterr().out.splitlines()
    b = results["fedavg"]
    assert b.messages == 2 and all(v >= 0 for v in b.phases.values())
    assert b.phases["train"] > 0 and sum(b.phases.values()) <= b.client
    assert out[-1] == f"framework_ms_fedavg={round(b.framework, 2)} client_ms_fedavg={round(b.client, 2)}"
    assert any(line.startswith("fedavg     averaging") for line in out)
    assert (tmp_path / "message_profile.csv").exists()


def test_gpu_check_runs_its_cases_on_the_cpu_when_asked_and_sizes_them_by_flags():
    gpu_check = load("gpu_check")
    on_cpu = gpu_check.case_overrides("cwfedavg-bf16", "cpu", ["rounds=2"])
    assert (
        "client.device=cpu" in on_cpu and not any("mixed_precision" in o for o in on_cpu) and on_cpu[-1] == "rounds=2"
    )
    assert "client.device=cuda" in gpu_check.case_overrides("fedavg-cnn", "cuda", [])
    samples = ["data.synthetic_samples=64"]
    assert gpu_check.case_overrides("fedavg-resnet18", "cpu", samples)[-1] == samples[0]
    assert samples[0] not in gpu_check.case_overrides("fedavg-cnn", "cpu", samples)  # mnist5k: no synthetic samples
    assert set(gpu_check.RATIO_CASES) <= set(gpu_check.CASES)
    rows = [{"round": str(r)} for r in range(1, 5)]
    assert gpu_check.measured_rounds(rows) == rows[1:3] and gpu_check.measured_rounds(rows[:2]) == rows[:2]


def test_the_bare_loop_times_a_round_of_the_configs_clients():
    from fedapps.config import config_from_dict

    bareloop = load("bareloop")
    cfg = config_from_dict(
        {"data": {"source": "digits", "num_clients": 3}, "model": {"name": "mlp"}, "client": {"batch_size": 16}}
    )
    assert 0 < bareloop.round_seconds(cfg, 1, "cpu") < 30


@pytest.mark.heavy
def test_gpu_check_prints_gpu_ratio_end_to_end_on_the_cpu(tmp_path):
    """bench/gpu_check.sh on the CPU, 2 clients, 3 rounds on digits (the case's CNN, a quarter of mnist5k's images at
    8×8): a real `flwr run` and the bare loop, then gpu_ratio."""
    import os
    import subprocess

    env = {**os.environ, "FEDAPPS_BENCH_RESULTS": str(tmp_path)}
    cmd = ["bash", "bench/gpu_check.sh", "--device", "cpu", "--cases", "fedavg-cnn", "--clients", "2", "--rounds", "3"]
    cmd += ["--set", "data.source=digits"]
    proc = subprocess.run(cmd + ["--out", str(tmp_path)], cwd=BENCH.parent, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_ratio_fedavg-cnn=") and last.endswith("target=1.5"), proc.stdout
    assert float(last.split()[0].split("=")[1]) > 0
