"""FedAvg's aggregation against a hand computation; FedAvg and Local end to end in-process;
partial participation and a dropped client."""

import json

import numpy as np
import pytest

import server_app
from deployed_toy import evaluate, tensors
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.aggregation import weighted_average
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from fedapps.wire.protocol import ARRAYS


def test_weighted_average_matches_hand_computation():
    a = {"w": np.array([[1.0, 2.0]], dtype=np.float32), "n": np.array(3, dtype=np.int64)}
    b = {"w": np.array([[3.0, 6.0]], dtype=np.float32), "n": np.array(5, dtype=np.int64)}
    c = {"w": np.array([[-1.0, 0.0]], dtype=np.float32), "n": np.array(7, dtype=np.int64)}
    out = weighted_average([a, b, c], [10, 30, 60])
    # (10*1 + 30*3 + 60*-1)/100 = 0.4 ; (10*2 + 30*6 + 0)/100 = 2.0
    np.testing.assert_allclose(out["w"], [[0.4, 2.0]], rtol=1e-6)
    assert out["w"].dtype == np.float32
    assert int(out["n"]) == 3  # integer buffers are not averaged


def test_weighted_average_rejects_empty():
    with pytest.raises(ValueError):
        weighted_average([], [])


def run(cfg_path, tmp_path, grid=None, overrides=""):
    from fedapps.config import load_config

    cfg = load_config(cfg_path, overrides)
    grid = grid or InProcessGrid(cfg.data.num_clients, record=True)
    summary = server_app.run_experiment(grid, str(cfg_path), overrides, str(tmp_path / "out"))
    return summary, grid, tmp_path / "out" / cfg.resolved_run_name()


def test_fedavg_round_trip_and_results(tiny_config, tmp_path):
    summary, grid, out = run(tiny_config(rounds=3), tmp_path)
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 3
    assert 0.5 < summary["accuracy_mean"] <= 1.0  # digits learns fast; round 3 evaluates 2 rounds of training
    for name in ("config.yaml", "rounds.csv", "summary.json", "accuracy.png", "partition.csv"):
        assert (out / name).is_file(), name
    header = (out / "rounds.csv").read_text().splitlines()[0].split(",")
    for col in ("acc_mean", "acc_weighted", "loss", "bytes_up", "bytes_down", "wall_seconds", "acc_client_0"):
        assert col in header
    # every client got the same global model in a round, and sent one back
    first_round = [m for m in grid.sent if m.metadata.group_id == "1"]
    assert len(first_round) == 4 and all(ARRAYS in m.content for m in first_round)
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0


def test_local_sends_no_weights(tiny_config, tmp_path):
    summary, grid, _ = run(tiny_config(strategy={"name": "local"}), tmp_path)
    assert summary["accuracy_mean"] > 0.5
    assert all(ARRAYS not in m.content for m in grid.sent + grid.replies)


def test_partial_participation_and_dropped_client(tiny_config, tmp_path):
    grid = InProcessGrid(4, drop=lambda rnd, pid: rnd == 2 and pid == 0, record=True)
    cfg = tiny_config(rounds=3, strategy={"name": "fedavg", "fraction": 0.75, "min_clients": 2})
    summary, grid, out = run(cfg, tmp_path, grid=grid)
    rows = (out / "rounds.csv").read_text().splitlines()
    assert len(rows) == 4  # header + 3 rounds: a missing reply does not stop the run
    per_round = {}
    for m in grid.sent:
        if m.metadata.message_type == "train":
            per_round.setdefault(m.metadata.group_id, 0)
            per_round[m.metadata.group_id] += 1
    assert set(per_round.values()) == {3}  # ceil(0.75 * 4) clients each round
    # the deployed models after the last round: one evaluation-only message to EVERY client, sampled or not
    final = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert sorted(m.metadata.dst_node_id for m in final) == sorted(grid.get_node_ids())
    assert summary["rounds"] == 3 and summary["accuracy_mean"] is not None
    assert summary["final_round"] == 3 and summary["final_round_measured_clients"] == 4


def test_client_error_is_dropped_not_fatal(tiny_config, tmp_path):
    from fedapps.client.registry import OPERATIONS, ClientOp

    grid = InProcessGrid(4)
    original = OPERATIONS["train"]

    def failing(w, tag):
        if w.client_id == 1:
            raise RuntimeError("disk on fire")
        return original.run(w, tag)

    OPERATIONS["train"] = ClientOp("train", failing, original.default_tag)
    try:
        summary, grid, out = run(tiny_config(), tmp_path, grid=grid)
    finally:
        OPERATIONS["train"] = original
    assert summary["rounds"] == 2
    last = json.loads((out / "summary.json").read_text())
    assert last["accuracy_mean"] is not None


def test_start_returns_flower_result_with_metrics_and_final_model(tiny_config):
    from fedapps.config import load_config
    from strategies import STRATEGIES, RunContext

    cfg = load_config(tiny_config(rounds=2))
    seen = []
    strategy = STRATEGIES["fedavg"](cfg, context=RunContext(on_round=seen.append))
    result = RoundDriver(strategy).start(InProcessGrid(cfg.data.num_clients))
    assert sorted(result.train_metrics_clientapp) == [1, 2] and [e.round for e in seen] == [1, 2]
    for rnd, entry in zip((1, 2), seen):
        metrics = result.train_metrics_clientapp[rnd]
        assert metrics["clients"] == 4
        accs = [r.metrics["after-acc"] for r in entry.replies]
        assert metrics["acc_after_training_mean"] == pytest.approx(sum(accs) / len(accs))
    # the deployed models of round 1 ride on round 2's messages, round 2's on the final evaluation-only message
    assert [[m.round for m in e.measurements] for e in seen] == [[], [1, 2]]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    for m in seen[1].measurements:
        accs = [r.metrics["deployed-acc"] for r in m.replies]
        assert len(accs) == 4
        assert result.evaluate_metrics_clientapp[m.round]["acc_mean"] == pytest.approx(sum(accs) / len(accs))
    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert set(final) == set(strategy.global_arrays)
    assert all(np.array_equal(final[k], strategy.global_arrays[k]) for k in final)


def test_strategies_write_no_files():
    """Reporting is the sinks' job: no strategy module opens, writes or plots a file itself."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "strategies"
    banned = {"write_text", "write_bytes", "savefig", "open", "write_csv", "mkdir"}
    for path in root.glob("*.py"):
        calls = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call)
        }
        assert not calls & banned, f"{path.name} calls {sorted(calls & banned)}"


def test_local_pretrain_epochs_lengthen_round_one_only(tiny_config, tmp_path):
    """Local's round 1 trains pretrain_epochs epochs (equal work with the pseudo-label methods' pre-training)."""
    cfg = tiny_config(rounds=2, strategy={"name": "local", "params": {"local": {"pretrain_epochs": 3}}})
    _, grid, _ = run(cfg, tmp_path)
    epochs = {
        m.metadata.group_id: protocol.request_of(m).training.section(protocol.TRAIN).epochs
        for m in grid.sent
        if m.metadata.message_type == protocol.MESSAGE_TYPE
    }
    assert epochs == {"1": 3, "2": None}  # the worker's train op reads train.* over client.* (test_ops_worker)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """FedAvg's deployed model after round rnd: the global model aggregated in that round."""
    return evaluate(tensors(s.global_arrays), data)


DEPLOYED_BY_HAND = {"fedavg": deployed_by_hand}
