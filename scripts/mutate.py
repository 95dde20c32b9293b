"""`make mutate`: mutation testing (mutmut 3) of the maths and aggregation functions.

mutmut copies the project to mutants/ (settings: [tool.mutmut] in pyproject.toml), rewrites every function of
the files listed there into variants with one small change each (an operator, a constant, an argument dropped
or set to None, ...), records which of the selected fast tests reach which function, and runs each variant
("mutant") against those tests only. A mutant is killed when a test fails, survived when all pass.

This script chooses WHICH functions count (SCOPE: the pure maths — aggregation rules, distances, clustering,
pseudo-label encoding, the loss terms, the formulas of cwFedAvg, FedAMP, FedUV, FedNH and pFedHN, the cosine
head's forward — not the strategies' message plumbing),
runs mutmut on them, prints the figures and writes mutation-report.md (every survivor with its diff).
docs/mutation.md argues the survivors that are equivalent; this script lists those it does not find there.

    python scripts/mutate.py                  # everything in SCOPE (15 to 60 minutes on 2 shared cores, by their load)
    python scripts/mutate.py fedapps.server.robust   # one module
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "mutation-report.md"
EQUIVALENT = ROOT / "docs" / "mutation.md"

# module -> functions mutated, "Class.method" for a method (mutmut does not mutate decorated functions: the numba
# kernels of pairwise_l1, the registered client terms and operations (client_op), FedNH's lru_cache'd uniform
# initialisation and its no_grad feature pass; those are pinned by scripts/named_mutations.py and the tests)
SCOPE: dict[str, list[str]] = {
    "fedapps.server.robust": ["cap_weights", "coordinate_median", "trimmed_mean", "combine"],
    "fedapps.server.pairwise_l1": ["l1_distance_matrix"],
    "fedapps.server.clustering": [
        "l2_distance_matrix",
        "distance_to_centres",
        "greedy_threshold_clustering",
        "assignment",
        "auto_threshold",
    ],
    "fedapps.wire.pseudolabels": ["label_dtype", "encode", "decode", "one_hot", "apply_temperature", "aggregate"],
    "fedapps.client.ops": ["kl_to_targets", "weighted_mean"],
    "strategies.cosmos": ["robustness_penalty"],
    "strategies.fedprox": ["proximal_penalty"],
    "strategies.fedamp": [
        "squared_distances",
        "attention_weights",
        "median_nonzero",
        "relative_attention_weights",
        "proximal_mu",
        "coupled_mu",
        "step_product",
        "largest_passing_lam",
        "flatten",
        "unflatten",
    ],
    "strategies.cwfedavg": [
        "class_distribution_from_rows",
        "wdr_penalty",
        "normalise_rows",
        "row_norm_distribution",
        "bias_evidence",
        "fedavg_weights",
        "class_weights",
        "mixing_matrix",
        "mix",
        "class_models",
        "l1_error",
    ],
    "strategies.feduv": [
        "iid_threshold",
        "variance_hinge",
        "pair_sq_distances",
        "median_rbf_uniformity",
        "log_gaussian_uniformity",
        "uniformity",
        "feduv_loss",
    ],
    "strategies.fednh": [
        "normalise_rows",
        "min_pairwise_angle",
        "uniform_prototypes",
        "orthogonal_prototypes",
        "class_prototypes",
        "update_prototypes",
    ],
    "strategies.pfedhn": [
        "embedding_size",
        "target_shapes",
        "hypernetwork_size",
        "HyperNetwork.embedding",
        "HyperNetwork.generate",
        "HyperNetwork.generate_batch",
        "accumulate_delta_gradient",
        "hypernetwork_step",
        "make_optimizer",
    ],
    "fedapps.models.heads": ["CosineClassifier.forward"],
}


def mangled(function: str) -> str:
    """mutmut's name for a function (x_f) or a method (xǁClassǁmethod)."""
    cls, _, name = function.rpartition(".")
    return f"xǁ{cls}ǁ{name}" if cls else f"x_{name}"


def patterns(modules: list[str]) -> list[str]:
    return [f"{m}.{mangled(f)}__mutmut_*" for m in modules for f in SCOPE[m]]


def mutmut(*args: str, log=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=log if log is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def results(chosen: list[str]) -> dict[str, str]:
    """mutmut's verdict for each mutant matching ``chosen``."""
    status: dict[str, str] = {}
    for line in mutmut("results", "--all", "true").stdout.splitlines():
        name, _, state = line.strip().partition(": ")
        if any(fnmatch.fnmatch(name, p) for p in chosen):
            status[name] = state
    return status


def main(argv: list[str]) -> int:
    modules = argv or list(SCOPE)
    unknown = [m for m in modules if m not in SCOPE]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; known: {list(SCOPE)}")
    chosen = patterns(modules)
    shutil.rmtree(ROOT / "mutants", ignore_errors=True)  # no stale copies or results from an earlier run
    start = time.perf_counter()
    with open(ROOT / "mutants.log", "w") as log:
        run = mutmut("run", "--max-children", str(os.cpu_count() or 2), *chosen, log=log)
    if run.returncode != 0:
        print((ROOT / "mutants.log").read_text()[-3000:])
        raise SystemExit(f"mutmut failed (exit {run.returncode}); its output is in mutants.log")
    status = results(chosen)
    # On shared cores a mutant whose tests fail slowly can pass mutmut's wall-time limit ((estimated time + 1 s)
    # × 15): each timed-out mutant gets a second run alone; those that time out again are reported as timeouts.
    first_timeouts = sorted(n for n, s in status.items() if s == "timeout")
    if first_timeouts:
        with open(ROOT / "mutants.log", "a") as log:
            mutmut("run", "--max-children", "1", *first_timeouts, log=log)
        status = results(chosen)
    minutes = (time.perf_counter() - start) / 60
    counts = Counter(status.values())
    survivors = sorted(n for n, s in status.items() if s == "survived")
    argued = set(re.findall(r"`([\w.ǁ]+__mutmut_\d+)`", EQUIVALENT.read_text())) if EQUIVALENT.exists() else set()
    unexplained = [n for n in survivors if n not in argued]
    lines = [
        f"# Mutation report ({date.today().isoformat()}, {minutes:.1f} min)",
        "",
        f"Command: `python scripts/mutate.py {' '.join(argv)}`".rstrip() + "; modules: " + ", ".join(modules),
        "",
        (
            f"mutants {len(status)}, killed {counts['killed']}, survived {counts['survived']}, "
            f"other {len(status) - counts['killed'] - counts['survived']} ({dict(counts)}); timed out at first "
            f"{len(first_timeouts)}, re-run alone"
        ),
        "",
        f"## Survivors ({len(survivors)}; {len(unexplained)} not argued equivalent in docs/mutation.md)",
        "",
    ]
    for name in survivors:
        diff = mutmut("show", name).stdout
        body = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        lines += [f"### `{name}`{'' if name in argued else '  (not argued)'}", "", "```diff", *body, "```", ""]
    REPORT.write_text("\n".join(lines) + "\n")
    print(
        f"mutants {len(status)}  killed {counts['killed']}  survived {counts['survived']}  "
        f"other {len(status) - counts['killed'] - counts['survived']} {dict(counts)}  ({minutes:.1f} min; "
        f"{len(first_timeouts)} timed out at first, re-run alone)"
    )
    print(f"survivors not argued equivalent in docs/mutation.md: {len(unexplained)}")
    for name in unexplained:
        print("   ", name)
    print(f"report: {REPORT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
