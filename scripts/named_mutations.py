"""The named mutations of issue #10: each one applied to the source in turn, the tests meant to catch it run,
the source restored. Every mutation must be killed (a test fails); the script exits 1 if one survives.

    python scripts/named_mutations.py            # all
    python scripts/named_mutations.py wdr-squared kl-reversed

Part of `make mutate` (before mutmut's run over the maths modules). Each entry names the file, one exact piece
of source (it must occur exactly once, so a refactor that moves it makes this script fail loudly rather than
test nothing) and its mutated form.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMULAS = "tests/test_formulas.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "wdr-squared",
        "strategies/cwfedavg.py",
        "return 0.5 * lam * torch.linalg.vector_norm(target_distribution - class_distribution_from_rows(weight))",
        "return 0.5 * lam * torch.linalg.vector_norm(target_distribution - class_distribution_from_rows(weight)) ** 2",
        (FORMULAS,),
    ),
    Mutation(
        "wdr-uniform-target",
        "strategies/cwfedavg.py",
        "target = counts / counts.sum()",
        "target = torch.full_like(counts, 1.0 / len(counts))",
        (FORMULAS,),
    ),
    Mutation(
        "kl-reversed",
        "fedapps/client/ops.py",
        "per_sample = (target_probs * (torch.log(target_probs.clamp_min(1e-12)) - log_q)).sum(dim=-1)",
        "per_sample = (log_q.exp() * (log_q - torch.log(target_probs.clamp_min(1e-12)))).sum(dim=-1)",
        (FORMULAS,),
    ),
    Mutation(
        "kl-sum-reduction",
        "fedapps/client/ops.py",
        "    return weighted_mean(per_sample, sample_weights)\n\n\ndef weighted_mean",
        "    return per_sample.sum() if sample_weights is None else weighted_mean(per_sample, sample_weights)\n\n\n"
        "def weighted_mean",
        (FORMULAS,),
    ),
    Mutation(
        "fedamp-lambda-over-2", "strategies/fedamp.py", "    return lam / alpha_k\n", "    return lam\n", (FORMULAS,)
    ),
    Mutation(
        "fedamp-detached",
        "strategies/fedprox.py",
        "terms = [((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if n in anchor]",
        "terms = [((p.detach() - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if n in anchor]",
        (FORMULAS,),
    ),
]


def pytest(tests: tuple[str, ...], python: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-x", *tests],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ).returncode


def run(m: Mutation, python: str) -> tuple[bool, float]:
    """Apply, test, restore. True when the tests fail (the mutant is killed)."""
    path = ROOT / m.path
    source = path.read_text()
    if source.count(m.original) != 1:
        raise SystemExit(
            f"{m.name}: the original text occurs {source.count(m.original)} times in {m.path} "
            "(expected once); update scripts/named_mutations.py"
        )
    start = time.perf_counter()
    try:
        path.write_text(source.replace(m.original, m.mutated))
        code = pytest(m.tests, python)
    finally:
        path.write_text(source)
    return code != 0, time.perf_counter() - start


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s) {sorted(unknown)}; known: {[m.name for m in MUTATIONS]}")
    baseline = sorted({t for m in chosen for t in m.tests})
    if pytest(tuple(baseline), sys.executable) != 0:  # a failing or missing test would "kill" every mutant
        raise SystemExit(f"the unmutated code fails {' '.join(baseline)}: fix that first")
    survived = []
    for m in chosen:
        killed, seconds = run(m, sys.executable)
        print(
            f"{'killed  ' if killed else 'SURVIVED'} {m.name:22s} {m.path:24s} {seconds:5.1f} s  ({' '.join(m.tests)})"
        )
        if not killed:
            survived.append(m.name)
    print(f"named mutations: {len(chosen)}, killed {len(chosen) - len(survived)}, survived {len(survived)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
