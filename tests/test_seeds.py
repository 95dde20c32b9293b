"""fedapps.seeds.derive_seed: distinct purposes and parts give distinct seeds, in range for torch and numpy,
and the same value in another process (no salted ``hash``)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from fedapps.seeds import derive_rng, derive_seed

ROOT = Path(__file__).resolve().parent.parent


def test_distinct_purposes_and_parts_give_distinct_seeds():
    seen = {}
    for seed in (0, 1, 2, 1000):
        for purpose in ("client-batches", "client-global", "holdout", "cosmos-server-init"):
            for parts in ((), (0,), (1,), (0, 1), (1, 0), (2, 3), (17,)):
                value = derive_seed(seed, purpose, *parts)
                key = (seed, purpose, parts)
                assert value not in seen, f"{key} collides with {seen.get(value)}"
                seen[value] = key
    # the old arithmetic collided: seed*1000+17+k for (seed 0, k 1000) == (seed 1, k 0); these do not
    assert derive_seed(0, "cosmos-server-init", 1000) != derive_seed(1, "cosmos-server-init", 0)


def test_range_fits_torch_and_numpy_and_is_deterministic():
    for seed in (0, 7, -1, 2**40):
        value = derive_seed(seed, "x", 3, 2**63 + 5)  # negative seeds and 64-bit node-id-like parts are accepted
        assert isinstance(value, int) and 0 <= value < 2**63
        assert value == derive_seed(seed, "x", 3, 2**63 + 5)
        torch.Generator().manual_seed(value)
        np.random.default_rng(value)
    assert derive_rng(5, "y", 1).integers(1 << 30) == derive_rng(5, "y", 1).integers(1 << 30)


def test_same_value_in_another_process():
    expected = [derive_seed(3, "client-batches", 7, 2), derive_seed(0, "cosmos-server-distill", 1, 0)]
    code = (
        "from fedapps.seeds import derive_seed; "
        "print(derive_seed(3, 'client-batches', 7, 2), derive_seed(0, 'cosmos-server-distill', 1, 0))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert [int(v) for v in out.stdout.split()] == expected


def test_trailing_zero_and_word_splitting_do_not_collide():
    assert derive_seed(0, "p") != derive_seed(0, "p", 0)
    assert derive_seed(0, "p", 5, 1) != derive_seed(0, "p", 5 + (1 << 32))
    assert derive_seed(0, "p", 1) != derive_seed(1, "p", 0)
