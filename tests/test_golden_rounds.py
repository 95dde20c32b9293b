"""Results do not move when the code around the training does: FedAvg, cwFedAvg and COSMOS on a fixed tiny config
give the rounds.csv results written in ``tests/golden/`` (accuracies exactly, losses to 1e-6 relative).

The golden files were made by this file's ``--write`` at commit fb7af4d^ (before the per-message work of the
throughput issue: phase clock, array codec, shared settings record, device-resident data) and the code after it
reproduces them. A change that is MEANT to change results (a fix of an algorithm, a new default) regenerates them
with ``python tests/test_golden_rounds.py --write`` and says so in its commit; anything else that moves them is a bug.
`flwr run` and the in-process engine give identical rounds (tests/test_determinism.py), so this pins both."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
STRATEGIES = ("fedavg", "cwfedavg", "cosmos")

# the whole config, pinned here: a default that changes elsewhere must not move the golden runs
CONFIG = {
    "seed": 0,
    "rounds": 3,
    "data": {"source": "digits", "partition": "dirichlet", "alpha": 0.5, "num_clients": 5, "public_fraction": 0.2},
    "model": {"name": "mlp"},
    "client": {"epochs": 1, "batch_size": 16, "lr": 0.05, "optimizer": "sgd"},
}

# COSMOS's defaults are the paper's (a VGG-16 per cluster, 5 distillation epochs): small and short here
STRATEGY_PARAMS = {"cosmos": {"server_model": "mlp", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}}


def result_columns(header: list[str]) -> list[str]:
    """The columns that are results (accuracies and losses): not timings, byte counts or reply counts."""
    return [c for c in header if c.startswith("acc_") or c in ("loss", "loss_after_training", "train_loss")]


def golden_run(strategy: str, out: Path) -> list[dict[str, str]]:
    """``strategy`` on :data:`CONFIG` in-process, its rounds.csv reduced to the round and the result columns."""
    from fedapps_tools import cli

    cfg = out / f"{strategy}.yaml"
    params = {strategy: STRATEGY_PARAMS[strategy]} if strategy in STRATEGY_PARAMS else {}
    cfg.write_text(yaml.safe_dump({**CONFIG, "strategy": {"name": strategy, "params": params}}))
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(out), "--quiet"]) == 0
    (run,) = [d for d in out.iterdir() if d.is_dir() and d.name.startswith(strategy + "-")]
    with open(run / "rounds.csv") as f:
        rows = list(csv.DictReader(f))
    keep = ["round", *result_columns(list(rows[0]))]
    return [{k: r[k] for k in keep} for r in rows]


def write_rows(rows: list[dict[str, str]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def differences(golden: list[dict[str, str]], now: list[dict[str, str]]) -> list[str]:
    """Where ``now`` departs from ``golden``: accuracies must be equal, losses within 1e-6 relative."""
    if [list(r) for r in golden] != [list(r) for r in now]:
        return [f"columns or rounds differ: {list(golden[0])} x {len(golden)} vs {list(now[0])} x {len(now)}"]
    found = []
    for g, n in zip(golden, now, strict=True):
        for k, gv in g.items():
            a, b = float(gv), float(n[k])
            same = a == b if (k.startswith("acc_") or k == "round") else math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
            if not same and not (math.isnan(a) and math.isnan(b)):
                found.append(f"round {g['round']} {k}: golden {gv}, now {n[k]}")
    return found


def test_differences_sees_a_moved_accuracy_and_a_moved_loss_but_not_float_noise():
    golden = [{"round": "1", "acc_mean": "0.5", "loss": "1.0"}]
    assert differences(golden, [{"round": "1", "acc_mean": "0.5", "loss": str(1.0 + 1e-9)}]) == []
    assert differences(golden, [{"round": "1", "acc_mean": "0.5000001", "loss": "1.0"}])
    assert differences(golden, [{"round": "1", "acc_mean": "0.5", "loss": "1.00001"}])
    assert differences(golden, [{"round": "2", "acc_mean": "0.5", "loss": "1.0"}])
    assert differences(golden, [{"round": "1", "acc_mean": "0.5", "loss": "1.0", "acc_client_0": "1"}])


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_results_match_the_golden_rounds(strategy, tmp_path):
    golden_file = GOLDEN / f"{strategy}.csv"
    with open(golden_file) as f:
        golden = list(csv.DictReader(f))
    assert len(golden) == CONFIG["rounds"] and "acc_mean" in golden[0] and "acc_client_4" in golden[0]
    assert differences(golden, golden_run(strategy, tmp_path)) == []


if __name__ == "__main__":  # python tests/test_golden_rounds.py --write [strategy ...]
    import tempfile

    if "--write" not in sys.argv:
        sys.exit("usage: python tests/test_golden_rounds.py --write [strategy ...]")
    sys.path.insert(0, str(ROOT))
    GOLDEN.mkdir(exist_ok=True)
    for name in [a for a in sys.argv[1:] if a != "--write"] or STRATEGIES:
        with tempfile.TemporaryDirectory() as tmp:
            write_rows(golden_run(name, Path(tmp)), GOLDEN / f"{name}.csv")
        print(f"wrote {GOLDEN / name}.csv")
