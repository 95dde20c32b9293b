"""Capture cases: one hostile client of a tiny federation against the strategies whose server combines clients
into OTHER clients' models, each with and without the strategy's robust option, beside the run with the attacker
dropped (the reference). Shared by tests/test_hostile_clients.py and scripts/capture_table.py.

Setting: digits, MLP, :data:`CLIENTS` clients (pathological partition, :data:`CLASSES_PER_CLIENT` classes each, so
every class is held by two clients), every client every round, in-process; client :data:`ATTACKER` is hostile (its
replies rewritten by a capture fault of :mod:`fedapps.faults`), client :data:`VICTIM` is the one a targeted attack
aims at. The reference run drops every reply of the attacker (it computes, nothing of it arrives), so the honest
clients' data and seeds are those of the attacked runs.

What is measured: the honest clients' deployed-model accuracy after the last round (the final evaluation-only
message), per client; from it the mean over honest clients and the VICTIM's: for a targeted attack the client it
targets, otherwise the honest client whose accuracy falls furthest below its own reference accuracy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedapps import faults, protocol
from fedapps.config import load_config
from fedapps.inprocess import InProcessGrid
from strategies import resolve

log = logging.getLogger("fedapps")

CLIENTS = 5
ATTACKER = 4  # the highest id: its reply comes last, after the victim's (what pred-copy needs in-process)
VICTIM = 0
CLASSES_PER_CLIENT = 4  # 5 clients × 4 classes = 20 slots over 10 classes: every class held by two clients
DEFAULT_ROUNDS = 8
REFERENCE = "reference"  # the arm with the attacker dropped
ARMS = ("default", "robust", REFERENCE)

BASE = ["data.source=digits", "model.name=mlp", f"data.num_clients={CLIENTS}",
        "data.partition=pathological", f"data.classes_per_client={CLASSES_PER_CLIENT}", "data.public_fraction=0.2",
        "client.epochs=1", "client.batch_size=16", "client.lr=0.05", "run_name=capture"]
# each strategy's own settings, smaller than the defaults where those make a round expensive
SHRINK = {
    "cosmos": ["server_model=mlp", "pretrain_epochs=2", "server_epochs=5", "distill_epochs=1", "server_lr=0.001",
               "distill_lr=0.001"],
    "fedmd": ["pretrain_epochs=2", "distill_epochs=1", "distill_lr=0.001"],
    "comet": ["pretrain_epochs=2", "distill_epochs=1", "distill_lr=0.001", "clusters=2"],
    "ifca": ["clusters=2"],
}


@dataclass(frozen=True)
class Case:
    """One strategy × attack: the fault spec of the attacker (``{A}`` / ``{V}``: attacker / victim ids), the
    strategy params that switch its robust option on, and whether the attack targets :data:`VICTIM`."""

    strategy: str
    attack: str
    spec: str
    robust: tuple[str, ...]
    targeted: bool = False
    setting: tuple[str, ...] = ()  # the strategy's own params for every arm of this case (beside SHRINK)
    rounds: int = DEFAULT_ROUNDS
    what: str = ""

    @property
    def name(self) -> str:
        return f"{self.strategy}/{self.attack}"

    def fault_spec(self) -> str:
        """The spec with the attacker's and victim's ids, and ``{LATER}``: every round after the first."""
        return self.spec.format(A=ATTACKER, V=VICTIM, LATER=",".join(str(r) for r in range(2, self.rounds + 1)))


CASES: tuple[Case, ...] = (
    Case("cwfedavg", "one-hot-rows", "one-hot-rows=0@{A}", ("median_clip=2",),
         what="classifier rows that make the attacker's class estimate p̂ one-hot on class 0, row 0 scaled ×100"),
    Case("cwfedavg", "scale", "scale=100@{A}", ("median_clip=2",), what="the whole model scaled ×100"),
    Case("cosmos", "copy-then-flip", "leak@{V}/1;pred-copy={V}@{A}/1;pred-flip@{A}/2,3,4,5,6,7,8,9,10",
         ("member_clip=0.5",), targeted=True,
         what="round 1: the victim's predictions copied (joins its cluster); then one-hot labels one class off the "
              "cluster's own"),
    Case("ifca", "scale", "scale=100@{A}", ("median_clip=2",), what="the whole model scaled ×100"),
    Case("pfedhn", "scale", "scale=100@{A}", ("median_clip=2",), what="the whole model scaled ×100"),
    Case("fedmd", "logits-1e4", "pred-const=0@{A}", ("consensus=probs",),
         what="logits +1e4 on class 0 and -1e4 elsewhere on every row of U (inside the validator's bound)"),
    Case("comet", "outlier", "pred-const=0@{A}", ("outlier_factor=3",), setting=("clusters=3",),
         what="a one-hot vote for class 0 on every row of U: far from every honest client (K = 3)"),
    Case("comet", "copy-then-flip", "leak@{V}/1;pred-copy={V}@{A}/1;pred-flip@{A}/{LATER}", ("outlier_factor=3",),
         targeted=True, what="round 1: the victim's predictions copied (joins its cluster); then one-hot labels one "
                             "class off the cluster's own"),
)


def case(name: str) -> Case:
    """The case ``strategy/attack``."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no capture case '{name}'; known: {', '.join(c.name for c in CASES)}")


def overrides(c: Case, arm: str, seed: int = 0) -> list[str]:
    """The config overrides of one arm of a case (the robust arm adds the robust params)."""
    params = [*SHRINK.get(c.strategy, []), *c.setting, *(c.robust if arm == "robust" else ())]
    return [f"strategy.name={c.strategy}", f"rounds={c.rounds}", f"seed={seed}", *BASE,
            *(f"strategy.params.{c.strategy}.{kv}" for kv in params)]


def node_spec(c: Case, arm: str) -> str:
    """The fault spec every node gets (entries select their clients): the attack, or the attacker dropped in
    every phase of every round (the reference)."""
    return f"drop@{ATTACKER}/*/*" if arm == REFERENCE else c.fault_spec()


@dataclass
class Outcome:
    """One run: every client's final deployed-model accuracy, and how long it took."""

    case: Case
    arm: str
    seed: int
    accuracy: dict[int, float]
    seconds: float
    cpu_seconds: float
    rejected: int
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # the strategy's final_summary()

    @property
    def honest(self) -> dict[int, float]:
        return {c: a for c, a in self.accuracy.items() if c != ATTACKER}

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.honest.values())))


def run_arm(c: Case, arm: str, seed: int = 0) -> Outcome:
    """One arm of a case, in-process; the final deployed accuracy of every client that was measured."""
    if arm not in ARMS:
        raise ValueError(f"arm '{arm}'; allowed: {', '.join(ARMS)}")
    cfg = load_config(None, overrides(c, arm, seed))
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    logs: list = []
    faults.clear_board()
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)  # r_B's input noise draws from torch's global RNG
    strategy = resolved.build(cfg, on_round=logs.append)
    spec = node_spec(c, arm)
    grid = InProcessGrid(CLIENTS, node_configs={i: {faults.NODE_KEY: spec} for i in range(CLIENTS)},
                         mods=[faults.faults_mod])
    strategy.start(grid, num_rounds=cfg.rounds, timeout=cfg.strategy.timeout)
    final = [m for entry in logs for m in entry.measurements if m.final]
    acc_key = protocol.metric_name(protocol.DEPLOYED_TAG, "acc")
    accuracy = {r.client_id: float(r.metrics[acc_key]) for m in final for r in m.replies if acc_key in r.metrics}
    return Outcome(c, arm, seed, accuracy, time.perf_counter() - t0, time.process_time() - c0,
                   sum(e.replies_rejected for e in logs), strategy.final_summary())


def victim_of(c: Case, got: Outcome, reference: Outcome) -> int:
    """The victim: the targeted client, else the honest client whose accuracy fell furthest below its reference
    (ties: the lower id)."""
    if c.targeted:
        return VICTIM
    drops = {cid: reference.accuracy.get(cid, 0.0) - acc for cid, acc in got.honest.items()}
    return min(drops, key=lambda cid: (-drops[cid], cid))


def summarise(c: Case, got: Outcome, reference: Outcome) -> dict[str, Any]:
    """A row's figures: mean honest accuracy and the victim's, of the run and of the reference."""
    victim = victim_of(c, got, reference)
    return {"victim": victim, "victim_acc": got.accuracy.get(victim, float("nan")),
            "victim_ref": reference.accuracy.get(victim, float("nan")), "mean_acc": got.mean,
            "mean_ref": reference.mean, "rejected": got.rejected}


