"""What the server can infer (issue #29, docs/privacy.md): attacks as measurements, on what leaves each client.

A run goes through the real round loop (``server_app.run_experiment``, in-process) on a :class:`CaptureGrid`, which
keeps every message the server sent and every reply it received, per phase. The attacks read only those (and the
run's summary for its ε); they know no strategy by name: what a reply carries decides which attack applies.

- **Label-distribution inference** (per client and round; the figure is the L1 distance Σ_j |p̂_j − p_j| between
  the inferred and the true class distribution of the client's training split):
  * a reply with model arrays, from the classifier bias update (:func:`bias_update_distribution`): one epoch of SGD
    on cross-entropy moves bias j by (η/B)·Σ_x (y_j(x) − s_j(x)), so p_j ≈ s̄_j + B·Δb_j / (η·E·N) with s̄ the
    model's mean softmax over the client's data during its training; the server has not got that data, so s̄ is the
    mean softmax of the model sent and the model returned on dummy inputs (:func:`dummy_mean_softmax`);
  * the same reply, from the normalised L2 norms of the classifier rows (cwFedAvg's own estimator,
    :func:`strategies.cwfedavg.row_norm_distribution`, reused);
  * a reply with predictions on the public set U, the histogram of its predicted classes
    (:func:`prediction_histogram`).
- **Membership inference** (loss-threshold attack, :func:`loss_threshold_auc`): per client, the AUC of −loss as a
  score telling its training samples (members) from its test split (non-members, same distribution), on the model
  the server has of that client: the model it returned (the last training round's reply), else the model the server
  sent it for evaluation (COSMOS: its cluster model, trained from the members' pseudo-labels), else none (FedMD, FedCT,
  COMET: no model of a client exists at the server).

``fedapps attacks`` runs the arms (strategy × privacy mode) and writes docs/results/privacy-attacks.csv (with the
command, commit and machine) and the markdown table of docs/privacy.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedapps.config import ConfigError, ExperimentConfig, load_config
from fedapps.flower import MessageGrid
from fedapps.wire import protocol, validation
from fedapps.wire.protocol import ClientReply
from fedapps_tools.options import add_out_option, add_seeds_option, add_set_option

log = logging.getLogger("fedapps")

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the settings' configs are read from it
PARAM_SETTING = "configs/settings/param-dirichlet.yaml"  # parameter-sharing strategies: mnist5k, Dirichlet α = 0.1
AGNOSTIC_SETTING = "configs/settings/agnostic-cosmos-groups.yaml"  # pseudo-label strategies: mnist5k, COSMOS's groups
SETTING_OF = {
    "fedavg": PARAM_SETTING,
    "cwfedavg": PARAM_SETTING,
    "cosmos": AGNOSTIC_SETTING,
    "fedmd": AGNOSTIC_SETTING,
    "fedct": AGNOSTIC_SETTING,
    "comet": AGNOSTIC_SETTING,
}
# every run of a setting also gets these: the parameter-sharing setting's own client.lr (0.005, the paper's) needs
# hundreds of rounds to leave chance; 0.05 is what the parameter-sharing table chose on validation for cwFedAvg on this
# split (FedAvg: 0.1, within 0.002 of 0.05): a model that has learnt something in a few rounds
SETTING_OVERRIDES = {PARAM_SETTING: ("client.lr=0.05",), AGNOSTIC_SETTING: ()}
MODES = ("off", "sample", "client")
# the noise the DP arms run with (privacy.* keys); the other privacy keys keep their defaults (δ = 1e-5)
NOISE = ("privacy.noise_multiplier=1.0", "privacy.max_grad_norm=1.0")
BIAS_UPDATE, ROW_NORMS, HISTOGRAM = "bias update", "row norms", "predicted-class histogram"
UNIFORM_GUESS = "uniform guess"  # the L1 of an attacker who learns nothing: p̂ uniform
MEMBERSHIP = "loss-threshold AUC"


# --------------------------------------------------------------------------- the estimators (pure)


def bias_update_distribution(
    bias_sent: np.ndarray,
    bias_returned: np.ndarray,
    lr: float,
    batch_size: int,
    epochs: int,
    samples_per_epoch: int,
    mean_softmax: np.ndarray | None = None,
) -> np.ndarray:
    """The client's class distribution from its classifier-bias update under plain SGD with cross-entropy:
    p̂_j = s̄_j + B·(b_returned − b_sent)_j / (η·E·N), clipped at 0 and renormalised (all zero: uniform).

    Each step moves bias j by (η/B)·Σ_{x in the batch} (y_j(x) − s_j(x)); over E epochs of N samples the update is
    (η/B)·E·N·(p_j − s̄_j), s̄ the model's softmax averaged over those steps (``mean_softmax``; None: uniform, what an
    uninformed model predicts). The label-count identity of gradient-based label recovery (iDLG for one sample;
    RLU, Chen & Vikalo 2024, for local updates, which models s̄ instead of assuming it)."""
    from strategies.cwfedavg import normalise_rows  # local: the strategies load only when attacked

    delta = np.asarray(bias_returned, np.float64) - np.asarray(bias_sent, np.float64)
    k = delta.shape[-1]
    prior = np.full(k, 1.0 / k) if mean_softmax is None else np.asarray(mean_softmax, np.float64)
    estimate = prior + batch_size * delta / (lr * epochs * max(samples_per_epoch, 1))
    return normalise_rows(np.maximum(estimate, 0.0))


def dummy_mean_softmax(
    model: Any,
    states: Sequence[Mapping[str, np.ndarray]],
    input_shape: Sequence[int],
    samples: int = 256,
    seed: int = 0,
) -> np.ndarray:
    """s̄ for :func:`bias_update_distribution` without the client's data: each state (the model sent, the model
    returned) loaded in turn into ``model``, its softmax averaged over ``samples`` dummy inputs of ``input_shape``
    drawn uniformly in [0, 1), then averaged over the states (the start and the end of the local training)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.rand((samples, *input_shape), generator=generator)
    means = []
    with torch.no_grad():
        for state in states:
            model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=False)
            model.eval()
            means.append(torch.softmax(model(x).float(), dim=-1).mean(dim=0).numpy())
    return np.mean(means, axis=0)


def prediction_histogram(predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """The share of U's rows a client's predictions assign to each class: the argmax of soft predictions (probabilities
    or logits), or hard labels as sent (the abstain marker, ``num_classes``, counts for no class)."""
    from strategies.cwfedavg import normalise_rows  # local: the strategies load only when attacked

    values = np.asarray(predictions)
    labels = values.astype(np.int64) if np.issubdtype(values.dtype, np.integer) else values.argmax(axis=-1)
    labels = labels[(labels >= 0) & (labels < num_classes)]
    return normalise_rows(np.bincount(labels, minlength=num_classes).astype(np.float64))


def loss_threshold_auc(
    member_losses: Sequence[float] | np.ndarray, nonmember_losses: Sequence[float] | np.ndarray
) -> float:
    """AUC of the loss-threshold membership attack (Yeom et al. 2018): the probability that a member's −loss is above
    a non-member's, ties counting one half (the Mann–Whitney statistic, from average ranks). 0.5: no signal."""
    members = -np.asarray(member_losses, np.float64)
    others = -np.asarray(nonmember_losses, np.float64)
    if not len(members) or not len(others):
        return math.nan
    scores = np.concatenate([members, others])
    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties share their average rank
    n = len(members)
    return float((ranks[:n].sum() - n * (n + 1) / 2.0) / (n * len(others)))


def per_sample_losses(model: Any, x: Any, y: Any) -> np.ndarray:
    """Cross-entropy of every sample of (x, y) under ``model`` (eval mode, no gradient)."""
    import torch
    import torch.nn.functional as F

    from fedapps.client import ops

    with torch.no_grad():
        logits = ops.predict(model, x, output="logits")
        return F.cross_entropy(logits, y.cpu(), reduction="none").numpy()


# --------------------------------------------------------------------------- capturing what the server receives


@dataclass
class Phase:
    """One ``send_and_receive`` of the round loop: the messages the server sent and the replies it got back."""

    round: int
    message_type: str
    messages: list[Any]
    replies: list[Any]

    def exchanges(self) -> list[tuple[Any, Any]]:
        """(message, reply) per node that answered (the grid delivers at most one reply per message's node; a
        duplicate is paired with the same message)."""
        sent = {int(m.metadata.dst_node_id): m for m in self.messages}
        return [(sent[int(r.metadata.src_node_id)], r) for r in self.replies if int(r.metadata.src_node_id) in sent]


class CaptureGrid:
    """A grid around another (the in-process one, Flower's): every phase's messages and replies, kept in
    :attr:`phases`, exactly as the server sent and received them. It changes nothing on the way."""

    def __init__(self, inner: MessageGrid) -> None:
        self.inner = inner
        self.phases: list[Phase] = []

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list[Any]:
        messages = list(messages)
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        if messages:
            first = messages[0].metadata
            self.phases.append(Phase(int(first.group_id or 0), str(first.message_type), messages, replies))
        return replies

    def received(self, message_type: str = protocol.MESSAGE_TYPE) -> list[tuple[int, Any, ClientReply]]:
        """(round, message, parsed reply) of every usable reply to a message of ``message_type`` (default: the round
        messages), in the order received; error replies and replies that do not parse are left out."""
        out = []
        for phase in self.phases:
            if phase.message_type != message_type:
                continue
            for msg, reply in phase.exchanges():
                try:
                    out.append((phase.round, msg, validation.parse_reply(reply)))
                except protocol.ReplyError:
                    continue
        return out


# --------------------------------------------------------------------------- the attacks on a captured run


@dataclass(frozen=True)
class LocalTraining:
    """The local-training settings of a message's ``train`` section (the server set them: it knows them)."""

    lr: float
    batch_size: int
    epochs: int
    drop_last: bool

    @classmethod
    def of(cls, msg: Any) -> LocalTraining:
        request = protocol.request_of(msg)
        s = {**request.setup.client, **request.training.section(protocol.TRAIN).optimiser()}
        return cls(float(s["lr"]), int(s["batch_size"]), int(s["epochs"]), bool(s.get("drop_last", False)))

    def samples_per_epoch(self, n: int) -> int:
        return (n // self.batch_size) * self.batch_size if self.drop_last else n


def sent_arrays(msg: Any) -> dict[str, np.ndarray]:
    """The model arrays a message carried (empty without)."""
    if protocol.ARRAYS not in msg.content:
        return {}
    return {k: protocol.from_wire(v.numpy(), np.float32) for k, v in msg.content.array_records[protocol.ARRAYS].items()}


MeanSoftmax = Callable[[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], np.ndarray]


def label_estimates(
    msg: Any, reply: ClientReply, head: str, num_classes: int, mean_softmax: MeanSoftmax | None = None
) -> dict[str, np.ndarray]:
    """Every label-distribution estimate one reply allows: from its classifier (``head``: the module name) when it
    returned model arrays, from its predictions on U when it sent those. ``mean_softmax(sent, returned)`` gives the
    bias-update estimate its s̄ (e.g. :func:`dummy_mean_softmax`); None: uniform."""
    from strategies.cwfedavg import row_norm_distribution  # local: the strategies load only when attacked

    out: dict[str, np.ndarray] = {}
    arrays, sent = reply.arrays or {}, sent_arrays(msg)
    weight, bias = f"{head}.weight", f"{head}.bias"
    if weight in arrays:
        out[ROW_NORMS] = row_norm_distribution(arrays[weight])
    if bias in arrays and bias in sent:
        t = LocalTraining.of(msg)
        s_bar = None if mean_softmax is None else mean_softmax(sent, arrays)
        out[BIAS_UPDATE] = bias_update_distribution(
            sent[bias], arrays[bias], t.lr, t.batch_size, t.epochs, t.samples_per_epoch(reply.num_examples), s_bar
        )
    if reply.predictions and protocol.PREDICTION_ARRAY in reply.predictions:
        out[HISTOGRAM] = prediction_histogram(reply.predictions[protocol.PREDICTION_ARRAY], num_classes)
    return out


def label_inference(
    capture: CaptureGrid, true_p: np.ndarray, head: str, mean_softmax: MeanSoftmax | None = None
) -> dict[tuple[str, int], dict[int, float]]:
    """(estimator, round) -> {client: L1(p̂, p)} over every usable round reply (``mean_softmax``: see
    :func:`label_estimates`); ``UNIFORM_GUESS`` too (the same clients, p̂ uniform)."""
    from strategies.cwfedavg import l1_error  # local: the strategies load only when attacked

    out: dict[tuple[str, int], dict[int, float]] = {}
    k = true_p.shape[1]
    for rnd, msg, reply in capture.received():
        if not 0 <= reply.client_id < len(true_p):
            continue
        p = true_p[reply.client_id]
        estimates = label_estimates(msg, reply, head, k, mean_softmax)
        if estimates:
            estimates[UNIFORM_GUESS] = np.full(k, 1.0 / k)
        for name, p_hat in estimates.items():
            out.setdefault((name, rnd), {})[reply.client_id] = l1_error(p_hat, p)
    return out


def models_of_clients(
    capture: CaptureGrid, model_name: str
) -> tuple[str, dict[int, tuple[str, dict[str, np.ndarray]]]]:
    """Which model the server has of each client, and whose: ``("returned", {client: (arch, arrays)})`` from the last
    round reply carrying model arrays; else ``("sent for evaluation", ...)`` from the last ``eval-arrays`` record sent
    to the client (the server's own model of it); else ``("none", {})``."""
    returned: dict[int, tuple[str, dict[str, np.ndarray]]] = {}
    for _, _, reply in capture.received():
        if reply.arrays:
            returned[reply.client_id] = (model_name, reply.arrays)
    if returned:
        return "returned", returned
    evaluated: dict[int, tuple[str, dict[str, np.ndarray]]] = {}
    for phase in capture.phases:
        for msg, reply in phase.exchanges():
            if protocol.EVAL_ARRAYS not in msg.content:
                continue
            try:
                client = validation.parse_reply(reply).client_id
            except protocol.ReplyError:
                continue
            arch = protocol.request_of(msg).evaluation.received_model or model_name
            record = msg.content.array_records[protocol.EVAL_ARRAYS]
            evaluated[client] = (arch, {k: protocol.from_wire(v.numpy(), np.float32) for k, v in record.items()})
    if evaluated:
        return "sent for evaluation", evaluated
    return "none", {}


def membership_inference(models: Mapping[int, tuple[str, Mapping[str, np.ndarray]]], fed: Any) -> dict[int, float]:
    """Client -> AUC of the loss-threshold attack on its model: its training split against its test split."""
    import torch

    from fedapps.models import build_model

    out = {}
    for client, (arch, arrays) in sorted(models.items()):
        data = fed.client(client)
        model = build_model(arch, fed.num_classes, fed.input_shape)
        missing = set(model.state_dict()) - set(arrays)
        if {n for n, _ in model.named_parameters()} & missing:
            raise ValueError(f"client {client}'s model lacks parameters {sorted(missing)[:3]} of '{arch}'")
        model.load_state_dict({k: torch.as_tensor(v) for k, v in arrays.items()}, strict=False)
        out[client] = loss_threshold_auc(
            per_sample_losses(model, data.train_x, data.train_y), per_sample_losses(model, data.test_x, data.test_y)
        )
    return out


# --------------------------------------------------------------------------- the arms


@dataclass(frozen=True)
class Arm:
    """One run of the table: a strategy on its setting, a privacy mode, the strategy's own settings (``key=value``:
    what it needs to run under that mode, or a variant) and a label that tells variants apart."""

    strategy: str
    mode: str
    params: tuple[str, ...] = ()
    variant: str = ""

    @property
    def name(self) -> str:
        return self.strategy + (f" ({self.variant})" if self.variant else "")

    @property
    def key(self) -> tuple[str, str, str]:
        """What tells arms apart in the CSV (:func:`arm_key` of its rows)."""
        return self.strategy, self.variant, self.mode

    @property
    def folder(self) -> str:
        """The arm's run folder's name: strategy, mode, variant, in letters, digits and dashes."""
        return re.sub(r"[^a-z0-9]+", "-", f"{self.strategy} {self.mode} {self.variant}".lower()).strip("-")

    def overrides(self, rounds: int, seed: int, extra: Sequence[str] = ()) -> list[str]:
        privacy = [] if self.mode == "off" else [f"privacy.mode={self.mode}", *NOISE]
        return [
            f"strategy.name={self.strategy}",
            f"rounds={rounds}",
            f"seed={seed}",
            *privacy,
            *(f"strategy.params.{self.strategy}.{kv}" for kv in self.params),
            *extra,
        ]


# what each strategy needs under sample-level DP (docs/privacy.md's table): cwFedAvg without WDR, COSMOS without its
# label-free weighting; the variant without DP beside it tells what the setting itself changes
ARMS: tuple[Arm, ...] = (
    Arm("fedavg", "off"),
    Arm("fedavg", "sample"),
    Arm("cwfedavg", "off", variant="WDR λ=10"),
    Arm("cwfedavg", "off", ("wdr_lambda=0",), "λ=0"),
    Arm("cwfedavg", "sample", ("wdr_lambda=0",), "λ=0"),
    Arm("cosmos", "off"),
    Arm("cosmos", "sample", ("weighting=none",), "weighting none"),
    Arm("cosmos", "client"),
    Arm("fedmd", "off"),
    Arm("fedmd", "sample"),
    Arm("fedmd", "client", ("consensus=probs",), "consensus probs"),  # logits have no norm bound: average probabilities
    Arm("fedct", "off"),
    Arm("fedct", "sample"),
    Arm("fedct", "client"),
    Arm("comet", "off"),
    Arm("comet", "sample"),
    Arm("comet", "client"),
)


@dataclass
class Measured:
    """One arm's figures: label inference per (estimator, round) and membership per client, over the clients."""

    arm: Arm
    labels: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)
    membership: dict[int, float] = field(default_factory=dict)
    membership_model: str = "none"
    epsilon: float | None = None
    delta: float | None = None
    accuracy: float | None = None
    seconds: float = 0.0
    refused: str = ""  # the config error that refused the arm (a mode the strategy does not allow)
    problems: str = ""  # what the round loop found wrong with the run's result (it is attacked all the same)


def run_captured(
    config: Path, overrides: Sequence[str], out: Path, cfg: ExperimentConfig
) -> tuple[dict[str, Any], CaptureGrid]:
    """One run through the real round loop (in-process), its traffic captured: its summary and the capture. A run whose
    result the loop calls unusable (its summary's ``problems``) is still attacked: the replies it got were sent."""
    import torch

    import server_app
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.reporting.results import UnusableRun

    torch.set_num_threads(int(os.environ.get("FEDAPPS_CLIENT_THREADS", "1")))
    capture = CaptureGrid(InProcessGrid(cfg.data.num_clients))
    try:
        summary = server_app.run_experiment(capture, str(config), " ".join(overrides), str(out))
    except UnusableRun as exc:
        log.warning("attacks: %s", exc)
        summary = json.loads((out / cfg.resolved_run_name() / "summary.json").read_text())
    return summary, capture


def run_epsilon(summary: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """The run's largest ε over its clients and its δ, as its summary records them (None: no DP)."""
    privacy = summary.get("privacy") or {}
    eps = privacy.get("epsilon_max")
    return (float(eps) if eps is not None else None), privacy.get("delta")


def measure(arm: Arm, rounds: int, seed: int, work: Path, extra: Sequence[str] = ()) -> Measured:
    """Run one arm and attack what its clients sent."""
    from fedapps.data import get_federation
    from fedapps.models import build_model, classifier_name
    from strategies.cwfedavg import normalise_rows  # local: the strategies load only when attacked

    setting = SETTING_OF[arm.strategy]
    config = ROOT / setting
    overrides = arm.overrides(rounds, seed, [*SETTING_OVERRIDES[setting], *extra])
    got = Measured(arm)
    try:
        cfg: ExperimentConfig = load_config(config, overrides)
    except ConfigError as exc:
        got.refused = str(exc)
        return got
    t0 = time.perf_counter()
    try:
        summary, capture = run_captured(config, overrides, work / arm.folder, cfg)
    except ConfigError as exc:  # e.g. a privacy mode the strategy refuses
        got.refused = str(exc)
        return got
    got.seconds = time.perf_counter() - t0
    fed = get_federation(dataclasses.asdict(cfg.data))
    model = build_model(cfg.model.name, fed.num_classes, fed.input_shape)

    def mean_softmax(sent: Mapping[str, np.ndarray], returned: Mapping[str, np.ndarray]) -> np.ndarray:
        return dummy_mean_softmax(model, [sent, returned], fed.input_shape)

    got.labels = label_inference(capture, normalise_rows(fed.train_counts), classifier_name(model), mean_softmax)
    got.membership_model, models = models_of_clients(capture, cfg.model.name)
    got.membership = membership_inference(models, fed)
    got.epsilon, got.delta = run_epsilon(summary)
    acc = summary.get("accuracy_mean")
    got.accuracy = float(acc) if isinstance(acc, (int, float)) else None
    got.problems = "; ".join(summary.get("problems") or [])
    return got


# --------------------------------------------------------------------------- CSV and table


def mean_sem(values: Iterable[float]) -> tuple[float, float, int]:
    v = np.asarray([x for x in values if math.isfinite(x)], np.float64)
    if not len(v):
        return math.nan, math.nan, 0
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0, len(v)


def rows_of(got: Measured, stamp: Mapping[str, Any]) -> list[dict[str, Any]]:
    """CSV rows of one arm: one per (estimator, round) of label inference, one for membership (or one saying why the
    arm did not run)."""
    a = got.arm
    base = {
        "strategy": a.strategy,
        "variant": a.variant,
        "privacy": a.mode,
        "params": " ".join(a.params),
        "epsilon": "" if got.epsilon is None else round(got.epsilon, 3),
        "delta": got.delta if got.delta is not None else "",
        "accuracy": "" if got.accuracy is None else round(got.accuracy, 4),
        "seconds": round(got.seconds, 1),
        "problems": got.problems,
    }

    def row(attack: str, estimator: str, rnd: Any, values: Iterable[float], note: str = "") -> dict[str, Any]:
        mean, sem, n = mean_sem(values)
        figures = {"value": round(mean, 4), "sem": round(sem, 4)} if n else {"value": "", "sem": ""}
        return {
            **base,
            "attack": attack,
            "estimator": estimator,
            "round": rnd,
            **figures,
            "clients": n,
            "note": note,
            **stamp,
        }

    if got.refused:
        return [row("refused", "", "", (), got.refused)]
    rows = [row("label L1", est, rnd, per_client.values()) for (est, rnd), per_client in sorted(got.labels.items())]
    no_model = "" if got.membership else "no model of a client at the server"
    rows.append(row(MEMBERSHIP, got.membership_model, "last", got.membership.values(), no_model))
    return rows


def arm_key(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """The arm a CSV row belongs to (:attr:`Arm.key`)."""
    return str(row["strategy"]), str(row["variant"]), str(row["privacy"])


def in_arm_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows grouped by arm in :data:`ARMS`' order (an arm it does not list last), each arm's rows as they were."""
    order = {a.key: i for i, a in enumerate(ARMS)}
    return sorted(rows, key=lambda r: order.get(arm_key(r), len(order)))


def table_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The markdown table: one line per arm; label inference in its first and last round, membership AUC."""

    def cell(r: Mapping[str, Any] | None) -> str:
        if r is None or r.get("value") in ("", None):
            return "—"
        return f"{float(r['value']):.2f} ± {float(r['sem']):.2f}"

    arms: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        arms.setdefault((r["strategy"], r["variant"], r["privacy"]), []).append(r)
    lines = [
        (
            "| strategy | DP | ε (δ) | accuracy | label estimator | L1, round 1 | L1, last round | "
            "L1 of a uniform guess | membership AUC (model attacked) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (strategy, variant, mode), got in arms.items():
        name = strategy + (f" ({variant})" if variant else "")
        if got[0]["attack"] == "refused":
            lines.append(f"| {name} | {mode} | refused: {got[0]['note'][:120]} | | | | | | |")
            continue
        eps = f"{got[0]['epsilon']} ({got[0]['delta']})" if got[0]["epsilon"] != "" else "∞"
        label_rows = [r for r in got if r["attack"] == "label L1"]
        last = max((int(r["round"]) for r in label_rows), default=0)
        by = {(r["estimator"], int(r["round"])): r for r in label_rows}
        mia = next(r for r in got if r["attack"] == MEMBERSHIP)
        mia_cell = f"{cell(mia)} ({mia['estimator']})" if mia["value"] != "" else "— (no model of a client)"
        estimators = sorted({r["estimator"] for r in label_rows} - {UNIFORM_GUESS})
        for i, est in enumerate(estimators):
            lines.append(
                f"| {name if i == 0 else ''} | {mode if i == 0 else ''} | {eps if i == 0 else ''} | "
                f"{got[0]['accuracy'] if i == 0 else ''} | {est} | {cell(by.get((est, 1)))} | "
                f"{cell(by.get((est, last)))} | {cell(by.get((UNIFORM_GUESS, last))) if i == 0 else ''} | "
                f"{mia_cell if i == 0 else ''} |"
            )
    return lines


BEGIN, END = "<!-- begin: fedapps attacks -->", "<!-- end: fedapps attacks -->"
DEFAULT_CSV = "privacy-attacks.csv"  # the rows' file in --out DIR


class DeprecatedSeed(argparse.Action):
    """``--seed N`` (before --seeds): still read, with a deprecation message."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
        print(
            "attacks: --seed is deprecated; write --seeds N (the same option as in every other command)",
            file=sys.stderr,
        )
        namespace.seeds = [int(values)]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "attacks",
        help="what the server can infer: run strategies × privacy modes in-process on mnist5k, capture what leaves "
        "each client, measure label-distribution and membership inference",
        description="What the server can infer: run strategies × privacy modes in-process on mnist5k, capture what "
        "leaves each client, and measure label-distribution inference (L1) and membership inference (AUC).",
    )
    names = sorted({a.strategy for a in ARMS})
    p.add_argument(
        "--strategies",
        nargs="+",
        default=names,
        choices=names,
        metavar="NAME",
        help=f"strategies to attack (default: all: {', '.join(names)})",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help=f"privacy modes (default: all: {' '.join(MODES)})",
    )
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds of every run (default 3)")
    add_seeds_option(p, [0], "the runs' seed (one: each arm is measured on one run)")
    p.add_argument("--seed", type=int, action=DeprecatedSeed, help=argparse.SUPPRESS)
    add_set_option(p, "every run's config (e.g. privacy.noise_multiplier=2)")
    p.add_argument(
        "--work", default=None, metavar="DIR", help="where the runs' folders go (default: a temporary folder)"
    )
    add_out_option(
        p,
        f"the rows are written into, as {DEFAULT_CSV} (e.g. docs/results; default: the table is printed only)",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="keep the rows --out already holds for the arms not run now (e.g. add the client-mode arms to a table)",
    )
    p.add_argument(
        "--doc",
        default=None,
        metavar="PAGE",
        help=f"write the table into PAGE between the lines '{BEGIN}' and '{END}' (e.g. docs/privacy.md; "
        "default: the table is printed only)",
    )
    p.add_argument(
        "--from-csv",
        default=None,
        metavar="CSV",
        help="run nothing: the table of the rows in CSV (a file --out wrote), printed and, with --doc, written",
    )
    return p


def csv_path(out: str | None) -> Path | None:
    """``--out DIR`` -> DIR/privacy-attacks.csv. A name ending in .csv (the option named the file before) is still
    taken as the file, with a deprecation message."""
    if not out:
        return None
    if out.endswith(".csv"):
        print(
            f"attacks: --out {out}: --out names a folder now ({DEFAULT_CSV} is written into it); a file name is "
            "deprecated and still honoured this time",
            file=sys.stderr,
        )
        return Path(out)
    return Path(out) / DEFAULT_CSV


def provenance_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """Which command, commit and machine made the rows (each distinct one)."""
    made = dict.fromkeys(f"`{r['command']}` at commit `{r['commit']}` on {r['machine']}, {r['date']}" for r in rows)
    return "Measured by " + "; ".join(made) + "."


def write_between_markers(page: Path, lines: Sequence[str]) -> None:
    """Replace what stands between :data:`BEGIN` and :data:`END` in ``page`` with ``lines``."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page} has no '{BEGIN}' ... '{END}' lines to write the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def command_line(args: argparse.Namespace) -> str:
    """The command that makes the rows (recorded in each): every option not at its default."""
    parts = ["fedapps attacks"]
    names = sorted({a.strategy for a in ARMS})
    if args.strategies != names:
        parts += ["--strategies", *args.strategies]
    if args.modes != list(MODES):
        parts += ["--modes", *args.modes]
    if args.rounds != 3:
        parts += ["--rounds", str(args.rounds)]
    if args.seeds != [0]:
        parts += ["--seeds", ",".join(map(str, args.seeds))]
    if args.overrides:
        parts += ["--set", *args.overrides]
    for flag, value in (("--out", args.out), ("--doc", args.doc)):
        if value:
            parts += [flag, value]
    if args.update:
        parts.append("--update")
    return shlex.join(parts[:1]) + (" " + shlex.join(parts[1:]) if parts[1:] else "")


def run(args: argparse.Namespace) -> int:
    from fedapps.reporting.results import write_csv
    from fedapps_tools.tables_run import provenance
    from fedapps_tools.tables_spec import read_rows

    rows: list[dict[str, Any]] = []
    if args.from_csv:
        rows = [dict(r) for r in read_rows(Path(args.from_csv))]
    else:
        if len(args.seeds) != 1:
            raise ConfigError(
                f"attacks measures each arm on one run, but --seeds names {len(args.seeds)} seeds; pass one "
                f"(--seeds {args.seeds[0]})"
            )
        stamp = {"command": command_line(args), **provenance()}
        arms = [a for a in ARMS if a.strategy in args.strategies and a.mode in args.modes]
        out = csv_path(args.out)
        if args.update and out is not None and out.is_file():  # the rows of the arms not run now stay
            rows = [dict(r) for r in read_rows(out) if arm_key(r) not in {a.key for a in arms}]
        with tempfile.TemporaryDirectory(prefix="fedapps-attacks-") as tmp:
            work = Path(args.work or tmp)
            for arm in arms:
                got = measure(arm, args.rounds, args.seeds[0], work, args.overrides)
                log.info("attacks: %s, privacy %s: %s", arm.name, arm.mode, got.refused or f"{got.seconds:.0f} s")
                rows = in_arm_order([*rows, *rows_of(got, stamp)])
                if out is not None:  # written as it goes: a long table survives an interruption
                    out.parent.mkdir(parents=True, exist_ok=True)
                    write_csv(out, rows)
    lines = [*table_lines(rows), "", provenance_line(rows)]
    print("\n".join(lines))
    if args.doc:
        write_between_markers(Path(args.doc), lines)
    return 0
