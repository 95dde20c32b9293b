"""A 200-client federation through `flwr run`, 2 rounds, 5 % sampled per round (issue #15's smoke test; the
1,000-client figures come from bench/scale.py). cwFedAvg, because its server keeps per-client state (each
client's latest model, its class distribution) and its final evaluation reaches clients it never heard from."""

from __future__ import annotations

import json

import pytest

from conftest import flwr_run
from fedapps.models import build_model
from fedapps.reporting.results import read_csv

CLIENTS, SAMPLED = 200, 10


@pytest.mark.heavy
def test_200_clients_two_rounds_sampled_cohort(tmp_path):
    out = flwr_run(
        tmp_path,
        strategy={"name": "cwfedavg", "fraction": SAMPLED / CLIENTS},
        data={
            "source": "synthetic",
            "synthetic_shape": [1, 8, 8],
            "synthetic_classes": 10,
            "synthetic_samples": CLIENTS * 30,
            "partition": "iid",
            "num_clients": CLIENTS,
            "min_samples": 10,
        },
        model={"name": "mlp"},
    )
    rows = read_csv(out / "rounds.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["clients"] for r in rows] == [SAMPLED, SAMPLED]  # the cohort, not the federation
    assert [r["skipped"] for r in rows] == [0, 0]  # every sampled SuperNode (uint64 ids, many >= 2**63) replied
    assert [r["replies_ok"] for r in rows] == [SAMPLED, SAMPLED + CLIENTS]  # round 2 also carries the final evaluation
    # round 1's deployed models are measured by round 2's cohort; the final evaluation reaches every client
    assert [r["measured_clients"] for r in rows] == [SAMPLED, CLIENTS]
    assert summary["final_round_measured_clients"] == CLIENTS and summary["num_clients"] == CLIENTS
    assert summary["simulation_message_sweep"] == "one-pass"  # fedapps/flower/message_sweep.py is in effect
    per_client = [k for k in rows[0] if k.startswith("acc_client_")]
    assert len(per_client) == CLIENTS
    assert sum(rows[0][k] != "" and rows[0][k] is not None for k in per_client) == SAMPLED
    assert all(rows[1][k] not in ("", None) for k in per_client)
    # training traffic is per sampled client: one model down and one up each, so per-client bytes do not grow
    # with the federation (the final evaluation's bytes are counted apart)
    model_bytes = 4 * sum(p.numel() for p in build_model("mlp", 10, (1, 8, 8), seed=0).parameters())
    for r in rows:
        assert model_bytes <= r["bytes_down"] / SAMPLED < 1.2 * model_bytes
        assert model_bytes <= r["bytes_up"] / SAMPLED < 1.2 * model_bytes
    assert CLIENTS * model_bytes <= rows[1]["eval_bytes_down"] < 1.2 * CLIENTS * model_bytes
