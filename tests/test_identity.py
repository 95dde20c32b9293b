"""Identity is settled before round 1: every node is identified once (a message with no operation), the validator
binds node <-> client id on the replies, and from then on a reply claiming another client's id is rejected ALONE —
the victim's own reply stands. Compared with the run in which the attacker never answers at all."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import server_app
from fedapps.flower import faults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.wire import protocol

CLIENTS, ROUNDS = 4, 4
ATTACKER, VICTIM = 1, 2


def overrides(strategy: str) -> str:
    return " ".join(
        [
            f"strategy.name={strategy}",
            f"rounds={ROUNDS}",
            "data.source=digits",
            "data.partition=iid",
            f"data.num_clients={CLIENTS}",
            "client.epochs=1",
            "client.batch_size=16",
            "model.name=mlp",
            "run_name=identity",
        ]
    )


def run(tmp: Path, strategy: str, grid: InProcessGrid) -> tuple[list[dict], list[dict]]:
    """rounds.csv and rejections.csv of an in-process run on ``grid``."""
    cfg = tmp / "empty.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    cfg.write_text("{}")
    server_app.run_experiment(grid, str(cfg), overrides(strategy), str(tmp / "out"))
    folder = tmp / "out" / "identity"
    with (folder / "rounds.csv").open() as fh, (folder / "rejections.csv").open() as gh:
        return list(csv.DictReader(fh)), list(csv.DictReader(gh))


def client_columns(rows: list[dict], client: int) -> list[str]:
    return [r[f"acc_client_{client}"] for r in rows]


@pytest.mark.parametrize("strategy", ["fedavg", "cwfedavg"])
@pytest.mark.heavy
def test_a_client_claiming_another_id_every_round_is_rejected_alone(strategy, tmp_path):
    spoofing = InProcessGrid(
        CLIENTS, node_configs={ATTACKER: {"faults": f"spoof={VICTIM}@{ATTACKER}"}}, mods=[faults.faults_mod]
    )
    rows, rejections = run(tmp_path / "spoof", strategy, spoofing)
    # the reference: the attacker's node never answers anything (the run without the attacker)
    absent = InProcessGrid(CLIENTS, drop=lambda rnd, partition: partition == ATTACKER, mods=[faults.faults_mod])
    reference, none = run(tmp_path / "absent", strategy, absent)

    assert none == []
    assert [(r["round"], r["client_id"]) for r in rejections] == [(str(k), str(ATTACKER)) for k in range(1, ROUNDS + 1)]
    assert all(f"bound to client {ATTACKER} but claims client-id {VICTIM}" in r["reason"] for r in rejections)
    assert all(r["node_id"] == str(100 + ATTACKER) for r in rejections)
    assert [int(r["replies_rejected"]) for r in rows] == [1] * ROUNDS
    # the victim trained every round and its deployed model is measured every round, exactly as without the attacker
    assert all(v != "" for v in client_columns(rows, VICTIM))
    for client in (0, VICTIM, 3):
        assert client_columns(rows, client) == client_columns(reference, client), client
    assert [r["clients"] for r in rows] == [r["clients"] for r in reference] == [str(CLIENTS - 1)] * ROUNDS


def test_every_node_is_identified_once_before_round_one(tmp_path):
    grid = InProcessGrid(CLIENTS, record=True)
    run(tmp_path, "fedavg", grid)
    queries = [m for m in grid.sent if m.metadata.message_type == "query"]
    assert sorted(int(m.metadata.dst_node_id) for m in queries) == sorted(grid.contexts)
    assert all(protocol.request_of(m).ops == () for m in queries)
    first_train = next(i for i, m in enumerate(grid.sent) if m.metadata.message_type == "train")
    assert first_train == len(queries)  # all of them before the first round message


def test_a_contest_at_first_contact_binds_nobody(tmp_path):
    """The limit: a node that claims a victim's id from its very first message (the identify message too) leaves
    the server no way to tell the two apart (it has no other source of identity): both claims are rejected every
    time, the victim included, each with its reason in rejections.csv; the other clients are unaffected."""
    contest = InProcessGrid(
        CLIENTS, node_configs={ATTACKER: {"faults": f"spoof={VICTIM}@{ATTACKER}/*/*"}}, mods=[faults.faults_mod]
    )
    rows, rejections = run(tmp_path, "fedavg", contest)
    identify = [r for r in rejections if r["phase"] == "identify"]
    assert len(identify) == 2 and all("claimed by several nodes" in r["reason"] for r in identify)
    assert {r["node_id"] for r in identify} == {str(100 + ATTACKER), str(100 + VICTIM)}
    assert [r["clients"] for r in rows] == [str(CLIENTS - 2)] * ROUNDS
    assert all(v == "" for v in client_columns(rows, VICTIM))
