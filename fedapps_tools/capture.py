"""Capture cases: one hostile client of a tiny federation against the strategies whose server combines clients
into OTHER clients' models, each with and without the strategy's robust option, beside the run with the attacker
dropped (the reference). Shared by tests/test_hostile_clients.py and scripts/capture_table.py.

Setting: digits, MLP, :data:`CLIENTS` clients (pathological partition, :data:`CLASSES_PER_CLIENT` classes each, so every
class is held by two clients), every client every round, in-process; client :data:`ATTACKER` is hostile (its replies
rewritten by a capture fault of :mod:`fedapps.flower.faults`), client :data:`VICTIM` is the one a targeted attack aims
at. The reference run drops every reply of the attacker (it computes, nothing of it arrives), so the honest clients'
data and seeds are those of the attacked runs.

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

from fedapps.config import load_config
from fedapps.flower import faults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from strategies import RunContext, resolve

log = logging.getLogger("fedapps")

CLIENTS = 5
ATTACKER = 4  # the highest id: its reply comes last, after the victim's (what pred-copy needs in-process)
VICTIM = 0
CLASSES_PER_CLIENT = 4  # 5 clients × 4 classes = 20 slots over 10 classes: every class held by two clients
DEFAULT_ROUNDS = 12
EARLY_ROUNDS = (1, 2, 3)  # the first rounds, reported apart: a defence that only catches up by round 12 still lost them
REFERENCE = "reference"  # the arm with the attacker dropped
REFERENCE_ROBUST = "reference-robust"  # ... and the robust option on: what the option costs without an attack
ARMS = ("default", "robust", REFERENCE, REFERENCE_ROBUST)
ROBUST_ARMS = ("robust", REFERENCE_ROBUST)
BOUND = (
    0.10  # the robust option bounds the damage when the victim's and the mean accuracy are within this of the reference
)
DIAGNOSTICS = (
    "diag_consensus_acc_on_U",
    "diag_target_acc_on_U",
    "diag_vote_acc_on_U",
)  # server-side extras a table shows where present

BASE = [
    "data.source=digits",
    "model.name=mlp",
    f"data.num_clients={CLIENTS}",
    "data.partition=pathological",
    f"data.classes_per_client={CLASSES_PER_CLIENT}",
    "data.public_fraction=0.2",
    "client.epochs=1",
    "client.batch_size=16",
    "client.lr=0.05",
    "run_name=capture",
]
# each strategy's own settings, smaller than the defaults where those make a round expensive
SHRINK = {
    "cosmos": [
        "server_model=mlp",
        "pretrain_epochs=2",
        "server_epochs=5",
        "distill_epochs=1",
        "server_lr=0.001",
        "distill_lr=0.001",
    ],
    "fedmd": ["pretrain_epochs=2", "distill_epochs=1", "distill_lr=0.001"],
    "fedct": ["pretrain_epochs=2", "distill_epochs=1", "distill_lr=0.001"],
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
    robust: tuple[str, ...]  # the strategy's own params (key=value), or whole config keys (strategy.<key>=value)
    targeted: bool = False
    setting: tuple[str, ...] = ()  # the strategy's own params for every arm of this case (beside SHRINK)
    rounds: int = DEFAULT_ROUNDS
    what: str = ""
    limits: str = ""  # where the robust option cannot bound the damage: why (the table says it; no test asserts it)
    variant: str = ""  # tells apart cases of the same strategy and attack (another robust setting)

    @property
    def name(self) -> str:
        return f"{self.strategy}/{self.attack}" + (f"/{self.variant}" if self.variant else "")

    def fault_spec(self) -> str:
        """The spec with the attacker's and victim's ids, and ``{LATER}``: every round after the first."""
        return self.spec.format(A=ATTACKER, V=VICTIM, LATER=",".join(str(r) for r in range(2, self.rounds + 1)))


CASES: tuple[Case, ...] = (
    Case(
        "cwfedavg",
        "one-hot-rows",
        "one-hot-rows=0@{A}",
        ("median_clip=2",),
        what="classifier rows that make the attacker's class estimate p̂ one-hot on class 0, row 0 scaled ×100",
    ),
    Case("cwfedavg", "scale", "scale=100@{A}", ("median_clip=2",), what="the whole model scaled ×100"),
    Case(
        "cosmos",
        "copy-then-vote",
        "leak@{V}/1;pred-copy={V}@{A}/1;pred-const=9@{A}/{LATER}",
        ("member_clip=0.5",),
        targeted=True,
        what="round 1: the victim's predictions copied (joins its cluster); then one-hot votes for class 9 on every "
        "row: a pull in one direction, round after round",
    ),
    Case(
        "cosmos",
        "copy-then-flip",
        "leak@{V}/1;pred-copy={V}@{A}/1;pred-flip@{A}/{LATER}",
        ("member_clip=0.5",),
        targeted=True,
        what="round 1: the victim's predictions copied (joins its cluster); then one-hot labels one class off the "
        "cluster's own",
    ),
    Case("ifca", "scale", "scale=100@{A}", ("median_clip=2",), what="the whole model scaled ×100"),
    Case("pfedhn", "scale", "scale=100@{A}", ("median_clip=0.5",), what="the whole model scaled ×100"),
    Case(
        "pfedhn",
        "scale",
        "scale=100@{A}",
        ("median_clip=1",),
        variant="c1",
        what="the whole model scaled ×100; the robust option at the median itself",
        limits="clipped to the median, the attacker's pull still points the same way every round (\"scale the "
        "model up\") and SGD's momentum adds it up, on some seeds past the bound; at half the median (the "
        "row above) it stays within it",
    ),
    Case(
        "fedavg",
        "scale",
        "scale=100@{A}",
        ("strategy.aggregation=median",),
        what="the whole model scaled ×100 (FedAvg's one global model: the robust averaging of strategy.aggregation)",
    ),
    Case(
        "fedct",
        "votes-for-0",
        "pred-const=0@{A}",
        ("qualified_threshold=0.4",),
        what="the hard label 0 on every row of U (a tied vote goes to the lowest class id)",
    ),
    Case(
        "fedmd",
        "logits-1e4",
        "pred-const=0@{A}",
        ("consensus=probs",),
        what="logits +1e4 on class 0 and -1e4 elsewhere on every row of U (inside the validator's bound)",
    ),
    Case(
        "fedmd",
        "logits-1e4",
        "pred-const=0@{A}",
        ("consensus=median",),
        variant="median",
        what="as above; the robust option the coordinate-wise median of the clients' probabilities",
    ),
    Case(
        "comet",
        "outlier",
        "pred-const=0@{A}",
        ("outlier_factor=3",),
        setting=("clusters=3",),
        what="a one-hot vote for class 0 on every row of U: far from every honest client (K = 3)",
    ),
    Case(
        "comet",
        "copy-then-flip",
        "leak@{V}/1;pred-copy={V}@{A}/1;pred-flip@{A}/{LATER}",
        ("outlier_factor=3",),
        targeted=True,
        what="round 1: the victim's predictions copied (joins its cluster); then one-hot labels one "
        "class off the cluster's own",
    ),
)


def case(name: str) -> Case:
    """The case ``strategy/attack``."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no capture case '{name}'; known: {', '.join(c.name for c in CASES)}")


def overrides(c: Case, arm: str, seed: int = 0) -> list[str]:
    """The config overrides of one arm of a case (the robust arm adds the robust params)."""
    params = [*SHRINK.get(c.strategy, []), *c.setting, *(c.robust if arm in ROBUST_ARMS else ())]
    return [
        f"strategy.name={c.strategy}",
        f"rounds={c.rounds}",
        f"seed={seed}",
        *BASE,
        *(kv if kv.startswith("strategy.") else f"strategy.params.{c.strategy}.{kv}" for kv in params),
    ]


def node_spec(c: Case, arm: str) -> str:
    """The fault spec every node gets (entries select their clients): the attack, or the attacker dropped in
    every phase of every round (the reference)."""
    return f"drop@{ATTACKER}/*/*" if arm in (REFERENCE, REFERENCE_ROBUST) else c.fault_spec()


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
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last round's extras
    strategy: Any = None  # the strategy object after the run (its server state, for the tests)
    by_round: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # round -> client -> accuracy
    extras: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # round -> that round's extras

    def honest_mean_at(self, rnd: int) -> float:
        """Mean deployed accuracy of the honest clients measured after round ``rnd`` (nan: none was, or the round was
        not measured)."""
        got = [a for cid, a in self.by_round.get(rnd, {}).items() if cid != ATTACKER]
        return float(np.mean(got)) if got else float("nan")

    @property
    def honest(self) -> dict[int, float]:
        return {c: a for c, a in self.accuracy.items() if c != ATTACKER}

    @property
    def mean(self) -> float:
        """Mean accuracy of the honest clients measured (nan: none was)."""
        return float(np.mean(list(self.honest.values()))) if self.honest else float("nan")

    @property
    def diagnostic(self) -> float | None:
        """The server-side measure of the last round where the strategy has one (FedMD's consensus, COMET's targets:
        their accuracy on U's true labels)."""
        return diagnostic_of(self.extra)

    def diagnostic_at(self, rnd: int) -> float | None:
        """The server-side measure of round ``rnd`` (:attr:`diagnostic`), where the strategy has one."""
        return diagnostic_of(self.extras.get(rnd, {}))


def diagnostic_of(extra: dict[str, Any]) -> float | None:
    """The first of :data:`DIAGNOSTICS` a round's extras hold."""
    for key in DIAGNOSTICS:
        if isinstance(extra.get(key), (int, float)):
            return float(extra[key])
    return None


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
    strategy = resolved.build(cfg, RunContext(on_round=logs.append))
    spec = node_spec(c, arm)
    grid = InProcessGrid(
        CLIENTS, node_configs={i: {faults.NODE_KEY: spec} for i in range(CLIENTS)}, mods=[faults.faults_mod]
    )
    RoundDriver(strategy).start(grid, num_rounds=cfg.rounds, timeout=cfg.strategy.timeout)
    final = [m for entry in logs for m in entry.measurements if m.final]
    acc_key = protocol.metric_name(protocol.DEPLOYED_TAG, "acc")
    accuracy = {r.client_id: float(r.metrics[acc_key]) for m in final for r in m.replies if acc_key in r.metrics}
    by_round = {
        m.round: {r.client_id: float(r.metrics[acc_key]) for r in m.replies if acc_key in r.metrics}
        for entry in logs
        for m in entry.measurements
    }
    return Outcome(
        c,
        arm,
        seed,
        accuracy,
        time.perf_counter() - t0,
        time.process_time() - c0,
        sum(e.replies_rejected for e in logs),
        strategy.final_summary(),
        dict(logs[-1].extra) if logs else {},
        strategy,
        by_round,
        {entry.round: dict(entry.extra) for entry in logs},
    )


def honest_ids() -> list[int]:
    return [c for c in range(CLIENTS) if c != ATTACKER]


def victim_of(c: Case, got: Outcome, reference: Outcome) -> int:
    """The victim: the targeted client, else the honest client whose accuracy fell furthest below its reference in
    ``got`` (the default arm: the robust arm of the same seed is judged on the same client; an honest client not
    measured counts as accuracy 0; ties: the lower id)."""
    if c.targeted:
        return VICTIM
    drops = {cid: reference.accuracy.get(cid, 0.0) - got.accuracy.get(cid, 0.0) for cid in honest_ids()}
    return min(drops, key=lambda cid: (-drops[cid], cid))


def summarise(got: Outcome, reference: Outcome, victim: int) -> dict[str, Any]:
    """A run's figures against its reference: the victim's accuracy (0 where it was not measured: its replies were
    rejected), the mean honest accuracy (over the honest clients measured) and how many were measured."""
    return {
        "victim": victim,
        "victim_acc": got.accuracy.get(victim, 0.0),
        "victim_ref": reference.accuracy.get(victim, float("nan")),
        "mean_acc": got.mean,
        "mean_ref": reference.mean,
        "measured": len(got.honest),
        "rejected": got.rejected,
        "diagnostic": got.diagnostic,
        "diagnostic_ref": reference.diagnostic,
        **{f"mean_r{k}": got.honest_mean_at(k) for k in EARLY_ROUNDS},
        **{f"victim_r{k}": got.by_round.get(k, {}).get(victim, 0.0) for k in EARLY_ROUNDS},
        **{f"diagnostic_r{k}": got.diagnostic_at(k) for k in EARLY_ROUNDS},
    }


def bounded(rows: list[dict[str, Any]], bound: float = BOUND) -> bool:
    """Whether the victim's and the mean accuracy of ``rows`` (one arm of a case, over seeds) are, averaged over
    the seeds, both within ``bound`` of the reference's, with every honest client measured in every run."""
    if not rows or any(r["measured"] != len(honest_ids()) for r in rows):
        return False
    victim_drop = float(np.mean([r["victim_ref"] - r["victim_acc"] for r in rows]))
    mean_drop = float(np.mean([r["mean_ref"] - r["mean_acc"] for r in rows]))
    return victim_drop <= bound and mean_drop <= bound
