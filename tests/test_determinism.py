"""Determinism: every random draw comes from a seeded stream, so the same config and seed give identical
per-round metrics in two processes (COSMOS with per-client architectures, a CNN server model, r_B
noise, clustering); the state of a strategy round-trips through state_dict/load_state_dict."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_folder, run_in_process, write_config

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "run_driver.py"
TIMING = "seconds"  # how measured durations end (wall_seconds, client_train_seconds): the only columns that may differ

COSMOS = {
    "rounds": 2,
    "strategy": {
        "name": "cosmos",
        "params": {"cosmos": {"server_model": "cnn", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}},
    },
    "data": {"public_fraction": 0.2},
    "model": {"name": "mlp", "per_client": ["mlp", "cnn"]},
}


def rounds(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "rounds.csv").open() as fh:
        return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in csv.DictReader(fh)]


@pytest.mark.heavy
def test_same_config_and_seed_give_identical_rounds_in_two_processes(tmp_path):
    """A fresh process and this one (which has run other tests before: other seeds drawn, other models built) give
    the same rows."""
    from fedapps.flower.inprocess import InProcessGrid

    config = write_config(tmp_path / "cfg.yaml", **COSMOS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDAPPS_TEST_KILL_AFTER_ROUND": "0"}
    # output folders of equal path length: the state-dir path in every message counts in bytes_down
    fresh = subprocess.Popen(
        [sys.executable, str(DRIVER), str(config), str(tmp_path / "a")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, here = run_in_process(config, tmp_path / "b", InProcessGrid(4))  # meanwhile
    _, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, err[-3000:]
    a, b = rounds(next((tmp_path / "a").iterdir())), rounds(here)
    assert len(a) == 2 and "acc_mean" in a[0] and "acc_client_3" in a[0]
    assert a == b  # acc_mean, acc_weighted, every acc_client_i, losses, clusters, bytes: exactly


@pytest.mark.heavy
def test_dropout_is_seeded_per_message(tiny_config):
    """A model with dropout (alexnet) trained by the worker: the same message twice gives the same model,
    whatever the global RNG was before (the worker seeds it per message)."""
    import dataclasses

    from flwr.app import Context, RecordDict

    from fedapps.client.worker import STATE_MODEL, handle
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.server.strategy import PersonalisedStrategy, RunContext
    from fedapps.wire import protocol

    InProcessGrid(1)  # sets a task identity so that Message() works outside Flower
    cfg_path = tiny_config(
        model={"name": "alexnet"},
        data={"source": "synthetic", "synthetic_shape": [3, 32, 32], "synthetic_samples": 80, "num_clients": 2},
    )
    from fedapps.config import load_config

    cfg = load_config(cfg_path)
    base = PersonalisedStrategy.__new__(PersonalisedStrategy)
    base.cfg, base.context = cfg, RunContext()
    setup = PersonalisedStrategy.setup(base)
    request = protocol.Request(
        ops=("train",), round=1, setup=dataclasses.replace(setup, client={**setup.client, "epochs": 1})
    )
    states = []
    for junk in (1, 2):
        torch.manual_seed(junk)
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        handle(protocol.Draft(1, request).message(), ctx)
        states.append(ctx.state[STATE_MODEL].to_torch_state_dict())
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


@pytest.mark.heavy
def test_every_strategy_state_round_trips(tiny_config):
    """state_dict() of each strategy after one round loads into a fresh instance and gives the same state."""
    import pickle

    import server_app  # noqa: F401  (the app layer: strategies registered)
    from fedapps.config import load_config
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.server.driver import RoundDriver
    from strategies import STRATEGIES, resolve

    for name, cls in sorted(STRATEGIES.items()):
        sections = {"strategy": {"name": name}, "rounds": 1, "data": {"num_clients": 6}}
        if cls.needs_public_set:
            sections["data"]["public_fraction"] = 0.2
        if name == "cosmos":
            sections["strategy"]["params"] = {
                "cosmos": {"server_model": "mlp", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}
            }
        if name == "fedamp":  # λ/α_K = 1: lr·λ/α_K = 0.05 at the tiny config's lr 0.05, below FedAMP.check's limit of 1
            sections["strategy"]["params"] = {"fedamp": {"lam": 0.01}}
        cfg = load_config(tiny_config(**sections))
        resolved = resolve(cfg)
        s = resolved.build(resolved.config(cfg))
        RoundDriver(s).start(InProcessGrid(6), num_rounds=1)
        saved = pickle.loads(pickle.dumps(RoundDriver(s).checkpoint_state()))
        fresh = resolved.build(resolved.config(cfg))
        RoundDriver(fresh).load_checkpoint_state(saved)
        again = RoundDriver(fresh).checkpoint_state()
        assert pickle.dumps(sorted(again["strategy"])) == pickle.dumps(sorted(saved["strategy"])), name
        assert again["rng"] == saved["rng"] and again["node_to_client"] == saved["node_to_client"], name
        for key, value in saved["strategy"].items():
            _assert_same(value, again["strategy"][key], f"{name}.{key}")


def _assert_same(a, b, where):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=True), where
    elif isinstance(a, (int, float, str, bool, type(None))):
        assert a == b or (a != a and b != b), where


@pytest.mark.heavy
def test_flower_engine_and_inprocess_engine_give_identical_rounds(flower_run_of_tiny_config):
    """FedAvg on 3 clients, 2 rounds: `flwr run` (Ray simulation, replies in arrival order) and the in-process
    grid give the same rounds.csv exactly (the round loop sorts replies by client id before any sum)."""
    from fedapps_tools import cli

    cfg, proc, flower_dir = flower_run_of_tiny_config
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # output folders of equal path length ("fl"/"ip"): the state-dir path counts in bytes_down
    tmp_path = flower_dir.parent.parent
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path / "ip"), "--quiet"]) == 0
    flower, inprocess = (rounds(run_folder(tmp_path / d)) for d in ("fl", "ip"))
    assert [r["acc_mean"] for r in flower] == [r["acc_mean"] for r in inprocess]
    assert flower == inprocess
