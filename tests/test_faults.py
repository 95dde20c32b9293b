"""Untrusted replies never crash or steer a run: every registered strategy with injected faults (fedapps.flower.faults).

Each case runs a strategy in-process (digits, MLP, 2 clients, 2 rounds) with one fault on client 1 and checks
that the run completes, that the faulty reply is rejected with its reason, and that the server's state after
the run equals that of a run where client 1's reply never arrived (``drop``: the client computed, its reply
was lost) — i.e. the faulty reply changed nothing. The state compared is everything the strategy object keeps
(its models, estimates, clusters, consensus, affinities, rng ...; timings and the validator's own records
left out) plus every accepted reply's metrics per round.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, is_dataclass
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

import server_app
from fedapps.config import load_config
from fedapps.flower import faults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.driver import RoundDriver
from fedapps.server.strategy import REPLY_KINDS
from strategies import STRATEGIES, RunContext, resolve

CLIENTS, ROUNDS = 2, 2
FAULTY = 1  # the client that misbehaves

# smaller than the defaults where a strategy's own settings make a round expensive or need more clients
SHRINK = {
    "cosmos": ["server_model=mlp", "pretrain_epochs=1", "server_epochs=1", "distill_epochs=1"],
    "fedmd": ["pretrain_epochs=1", "distill_epochs=1"],
    "fedct": ["pretrain_epochs=1", "distill_epochs=1"],
    "comet": ["pretrain_epochs=1", "distill_epochs=1", "clusters=2"],
    "fedrep": ["head_epochs=1"],
    "fedbabu": ["finetune_epochs=1"],
    "fednh": ["finetune_epochs=1"],
    "ifca": ["clusters=2"],
    "cfl": ["warmup_rounds=0"],
    "fedamp": ["lam=0.01"],  # λ/α_K = 1: lr·λ/α_K = 0.05 at this file's lr 0.05 (FedAMP.check refuses >= 1)
}
# which reply kind each strategy's round messages ask for: what its class declares (reply_kind)
ARRAYS, PREDICTIONS, METRICS_ONLY = (
    tuple(n for n, c in sorted(STRATEGIES.items()) if c.reply_kind == k) for k in REPLY_KINDS
)

REASON = {
    "shape": "has shape",
    "transpose": "has shape",
    "undecodable": "cannot be decoded",
    "int-arrays": "has dtype int64",
    "nan-arrays": "non-finite",
    "huge-n": "exceeds client",
    "zero-n": "not a positive integer",
    "list-n": "'num-examples' must be an integer",
    "list-id": "'client-id' must be an integer",
    "no-eval-n": "lacks",
    "acc-50": "not an accuracy",
    "n-1e9": "test-set size",
    "bad-id": "outside the federation",
    "spoof": "bound to",
    "duplicate": "duplicate reply",
    "raise": "client error",
    "pred-shape": "has shape",
    "pred-huge": "predictions unusable",
    "pred-undecodable": "cannot be decoded",
    "pred-dtype": "has dtype",
    "fingerprint": "public set mismatch",
}
METRIC_KINDS = ("huge-n", "zero-n", "list-n", "list-id", "no-eval-n", "acc-50", "n-1e9", "bad-id")


def overrides(strategy: str, clients: int = CLIENTS, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        f"strategy.name={strategy}",
        f"rounds={ROUNDS}",
        "data.source=digits",
        f"data.num_clients={clients}",
        f"strategy.min_clients={clients}",
        "client.epochs=1",
        "client.batch_size=16",
        "model.name=mlp",
        "data.public_fraction=0.2",
        "run_name=faults",
        *(f"strategy.params.{strategy}.{kv}" for kv in SHRINK.get(strategy, [])),
        *extra,
    ]


@dataclass
class Run:
    strategy: Any
    logs: list

    def rejections(self, rnd: int) -> list:
        return [r for log in self.logs if log.round == rnd for r in log.rejections]


def run(
    strategy: str,
    spec: str = "",
    clients: int = CLIENTS,
    extra: tuple[str, ...] = (),
    faulty: int = FAULTY,
    mods: tuple = (),
) -> Run:
    """One in-process run; ``spec``: the fault spec of client ``faulty``; ``mods``: client mods after the faults'."""
    cfg = load_config(None, overrides(strategy, clients, extra))
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    logs: list = []
    torch.manual_seed(0)  # r_B's input noise (strategies.cosmos.robustness_penalty) draws from torch's global RNG
    s = resolved.build(cfg, RunContext(on_round=logs.append))
    grid = InProcessGrid(
        clients, node_configs={faulty: {"faults": spec}} if spec else None, mods=[faults.faults_mod, *mods]
    )
    RoundDriver(s).start(grid, num_rounds=ROUNDS, timeout=cfg.strategy.timeout)
    return Run(s, logs)


@cache
def baseline(strategy: str, spec: str, faulty: int = FAULTY) -> Run:
    return run(strategy, spec, faulty=faulty)


# --------------------------------------------------------------------------- comparing server state

SKIP = {"on_round", "cfg", "params"}


def snapshot(value: Any, depth: int = 0) -> Any:
    """A comparable image of a strategy's state (arrays by dtype/shape/bytes, models by their state dict)."""
    if depth > 12:
        return "<deep>"
    if isinstance(value, torch.nn.Module):
        return snapshot(value.state_dict(), depth + 1)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.random.Generator):
        return ("rng", repr(value.bit_generator.state))
    if isinstance(value, dict):
        return {
            str(k): snapshot(v, depth + 1)
            for k, v in value.items()
            if not ("seconds" in str(k) or str(k).startswith("t-") or str(k) in SKIP)
        }
    if isinstance(value, (list, tuple)):
        return [snapshot(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (str, int, float, bool, type(None), np.generic)):
        return value
    if hasattr(value, "items") and hasattr(value, "keys"):  # Flower records
        return {k: snapshot(v.numpy() if hasattr(v, "numpy") else v, depth + 1) for k, v in value.items()}
    if is_dataclass(value) or hasattr(value, "__dict__"):
        return (type(value).__name__, snapshot(vars(value), depth + 1))
    return repr(value)


SERVICES = ("replies", "nodes")  # a strategy's services: what the comparison needs of them is taken below


def server_state(r: Run, skip_round_of_fault: int | None = None) -> dict:
    s = r.strategy
    # the algorithm's attributes and the round loop's state (node_to_client is compared below: bound in another round
    # when the reply was dropped)
    state = snapshot(
        {**{k: v for k, v in vars(s).items() if k not in SERVICES}, "identify_asked": s.nodes.identify_asked}
    )
    per_round = [
        (log.round, sorted((x.client_id, snapshot(x.metrics)) for x in log.replies), snapshot(log.extra))
        for log in r.logs
    ]
    return {"strategy": state, "rounds": per_round, "final": snapshot(r.strategy.final_arrays())}


def assert_same_state(got: Run, want: Run) -> None:
    a, b = server_state(got), server_state(want)
    for key in ("final", "rounds"):
        assert a[key] == b[key], f"{key} differs from the run without the faulty reply"
    diff = sorted(k for k in set(a["strategy"]) | set(b["strategy"]) if a["strategy"].get(k) != b["strategy"].get(k))
    assert not diff, f"server state differs from the run without the faulty reply in: {diff}"
    assert got.strategy.nodes.node_to_client == want.strategy.nodes.node_to_client


# --------------------------------------------------------------------------- the cases


def cases() -> list[tuple[str, str, int]]:
    """(strategy, fault kind, round): EVERY strategy × every fault kind that applies to what it asks for — the
    metric faults, a duplicated reply and (round 2, once identities are bound) a spoofed id for all; the array
    faults for the parameter-exchanging strategies, the prediction faults for the pseudo-label ones."""
    out: list[tuple[str, str, int]] = []
    for s in sorted(STRATEGIES):
        kinds = METRIC_KINDS + ("duplicate",)
        if s in ARRAYS:
            kinds += faults.ARRAY_FAULTS
        elif s in PREDICTIONS:
            kinds += faults.PREDICTION_FAULTS
        out += [(s, k, 1) for k in kinds] + [(s, "spoof", 2)]
    return sorted(set(out))


def test_every_strategy_declares_a_known_reply_kind():
    assert sorted(ARRAYS + PREDICTIONS + METRICS_ONLY) == sorted(STRATEGIES)
    assert (
        {"fedavg", "cwfedavg"} <= set(ARRAYS) and {"cosmos", "fedmd"} <= set(PREDICTIONS) and METRICS_ONLY == ("local",)
    )


@pytest.mark.parametrize("strategy,kind,rnd", cases())
def test_a_faulty_reply_is_rejected_and_changes_nothing(strategy, kind, rnd):
    got = run(strategy, f"{kind}@{FAULTY}/{rnd}")
    rejected = got.rejections(rnd)
    assert len(rejected) == 1, [r.reason for r in rejected]
    assert REASON[kind] in rejected[0].reason, rejected[0].reason
    assert rejected[0].round == rnd and rejected[0].node_id == 100 + FAULTY
    # the run where the faulty reply never arrived (a duplicate's first copy is the client's genuine reply)
    want = baseline(strategy, "" if kind == "duplicate" else f"drop@{FAULTY}/{rnd}")
    assert [x.replies_rejected for x in got.logs] == [int(x.round == rnd) for x in got.logs]
    assert [x.replies_ok for x in got.logs] == [x.replies_ok for x in want.logs]  # (both phases, where two)
    assert [x.replies_missing for x in got.logs] == [0] * ROUNDS
    assert_same_state(got, want)


def test_a_late_reply_counts_as_missing():
    got = run("fedavg", f"late=3@{FAULTY}/1", extra=("strategy.timeout=2.5",))
    assert got.logs[0].replies_missing == 1 and got.logs[0].replies_rejected == 0 and got.logs[0].replies_ok == 1
    assert got.logs[1].replies_missing == 0
    assert_same_state(got, baseline("fedavg", f"drop@{FAULTY}/1"))


def test_raise_is_an_error_reply_counted_as_rejected():
    got = run("fedavg", f"raise@{FAULTY}/1")
    [rej] = got.rejections(1)
    assert "InjectedFault" in rej.reason and got.logs[0].replies_rejected == 1
    assert_same_state(got, baseline("fedavg", f"drop@{FAULTY}/1"))  # FedAvg's clients keep no state


def test_fault_specs_are_parsed_and_checked():
    [f] = faults.parse_faults("late=2.5@1,3/2/evaluate")
    assert (f.kind, f.arg, f.clients, f.rounds, f.phase) == (
        "late",
        "2.5",
        frozenset({1, 3}),
        frozenset({2}),
        "evaluate",
    )
    assert f.applies(3, 2, "evaluate") and not f.applies(3, 2, "train") and not f.applies(2, 2, "evaluate")
    assert faults.parse_faults("raise@*")[0].applies(7, 99, "train")
    with pytest.raises(ValueError, match="unknown kind 'explode'"):
        faults.parse_faults("explode@1")
    with pytest.raises(ValueError, match="CLIENTS"):
        faults.parse_faults("raise@one")


# --------------------------------------------------------------------------- 30 % of clients failing


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_thirty_percent_failing_every_round(strategy, tmp_path):
    """3 of 10 clients raise every round: the run completes with a numeric accuracy, the failures are counted
    in replies_rejected and listed in rejections.csv."""
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("{}")
    failing = "0,4,7"
    grid = InProcessGrid(
        10, node_configs={i: {"faults": f"raise@{failing}/*"} for i in range(10)}, mods=[faults.faults_mod]
    )
    # min_clients 5: the 7 healthy replies are enough to aggregate (a round below min_clients is skipped)
    args = overrides(strategy, 10, extra=("strategy.min_clients=5",))
    summary = server_app.run_experiment(grid, str(cfg_path), " ".join(args), str(tmp_path / "out"))
    assert isinstance(summary["accuracy_mean"], float) and 0.0 <= summary["accuracy_mean"] <= 1.0
    run_dir = tmp_path / "out" / "faults"
    with (run_dir / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["replies_rejected"]) for r in rows] == [3] * ROUNDS
    # the last round's count includes the evaluation-only phase (the faults hit training messages only): every
    # client, except, for COSMOS, the 3 that never replied and so have no cluster model to be evaluated
    final = 7 if STRATEGIES[strategy].deployed.source == "server" else 10
    assert [int(r["replies_ok"]) for r in rows] == [7] * (ROUNDS - 1) + [7 + final]
    assert int(rows[-1]["measured_clients"]) == final  # the headline covers every client with a deployed model
    assert [int(r["replies_missing"]) for r in rows] == [0] * ROUNDS
    with (run_dir / "rejections.csv").open() as fh:
        rejections = list(csv.DictReader(fh))
    assert len(rejections) == 3 * ROUNDS
    assert {r["round"] for r in rejections} == {str(i) for i in range(1, ROUNDS + 1)}
    assert all("InjectedFault" in r["reason"] for r in rejections)
    # identified before round 1 (the faults hit training messages only): each rejection names its client
    assert {r["client_id"] for r in rejections if r["round"] == "1"} == set(failing.split(","))
