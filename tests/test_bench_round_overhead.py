"""bench/round_overhead.py's bare-parallel reference: the processes' partial sums, averaged, are FedAvg's
sample-weighted mean of every client's model, whatever the split of the clients between processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "round_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("round_overhead_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_partial_sums_over_processes_equal_the_one_process_fedavg_mean():
    bench = load_bench()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sizes = [5, 1, 7, 2, 9]  # unequal: a plain mean of the models differs from the weighted one
    updates = []
    for n in sizes:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        updates.append(({k: v.clone() for k, v in model.state_dict().items()}, n))
    by_hand = {k: sum(s[k] * n for s, n in updates) / sum(sizes) for k in updates[0][0]}
    one_process = bench.average([bench.weighted_sum(updates)])
    for split in ([0, 2, 4], [1, 3]), ([0], [1, 2, 3, 4]), ([4, 1], [0, 2, 3]):
        two_processes = bench.average([bench.weighted_sum([updates[i] for i in share]) for share in split])
        for k in by_hand:
            torch.testing.assert_close(one_process[k], by_hand[k])
            torch.testing.assert_close(two_processes[k], by_hand[k])
    plain_mean = {k: sum(s[k] for s, _ in updates) / len(updates) for k in by_hand}
    assert not torch.allclose(plain_mean["weight"], by_hand["weight"])  # the weights matter in this example


def load_proctree():
    load_bench()  # puts bench/ on sys.path, as the benchmarks do
    import proctree

    return proctree


def test_roles_of_a_runs_processes():
    proctree = load_proctree()
    assert proctree.role_of("ray::ClientAppActor.run") == "worker"
    assert proctree.role_of("/venv/bin/python /venv/bin/flwr-simulation --runtime-api-address x") == "server"
    assert proctree.role_of("python -m fedapps_tools.cli run cfg.yaml") == "cli"
    assert proctree.role_of("/venv/bin/flower-superlink --insecure --simulation") == "superlink"
    assert proctree.role_of("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x") == "ray"
    assert proctree.role_of("sleep 5") == "other"


def test_cpu_between_takes_the_window_between_markers():
    proctree = load_proctree()
    timeline = [
        (10.0, 0, {"worker": 1.0}),
        (11.0, 1, {"worker": 2.0, "server": 0.5}),
        (12.0, 1, {"worker": 3.5, "server": 0.7}),
        (13.5, 3, {"worker": 5.0, "server": 1.0, "ray": 0.2}),
        (14.0, 3, {"worker": 9.0, "server": 9.0, "ray": 9.0}),
    ]
    wall, cpu = proctree.cpu_between(timeline, 1, 2)  # marker 2 never seen: the first sample past it (3) closes
    assert wall == 2.5
    assert cpu == {"ray": 0.2, "server": 0.5, "worker": 3.0}


@pytest.mark.heavy
def test_cpu_sampler_counts_a_child_that_burns_cpu_and_exits(tmp_path):
    """The sampler's total includes a child process of the root (found in /proc), also after it has exited."""
    import subprocess

    proctree = load_proctree()
    code = (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
        "while time.process_time() - t < 0.6: pass'])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    sampler = proctree.CpuSampler(proc.pid, interval=0.05)
    proc.wait()
    total = sampler.stop()
    assert 0.4 <= total < 5  # the child's ~0.6 s (the last sample of each process may be missed by < 0.05 s)
    assert sampler.timeline and all(m == 0 for _, m, _ in sampler.timeline)
