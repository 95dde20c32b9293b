"""bench/round_overhead.py's bare-parallel reference: the processes' partial sums, averaged, are FedAvg's
sample-weighted mean of every client's model, whatever the split of the clients between processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
