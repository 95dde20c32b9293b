"""What a run measured, and the sinks that write it down.

The round loop hands every sink each round's record; at the end, the summary and the strategy's artefacts
(:class:`Artifact`: tables, JSON documents, figure data). :class:`FileSink` writes ``<output-dir>/<run-name>/``:
the resolved config, partition statistics, rounds.csv (rewritten every round, so an interrupted run keeps what
it did), summary.json, accuracy.png and the artefacts. Strategies never write files themselves.

Row r of rounds.csv holds round r's training phase (bytes, losses, extras, ``acc_after_training_*``: the
clients' models right after their local update) and the DEPLOYED models after round r (``acc_mean``,
``acc_weighted``, ``acc_worst10``, ``acc_std``, ``loss``, ``acc_client_<i>``, ``measured_clients``;
docs/evaluation.md). The deployed models
are measured one message later (round r+1's, or the evaluation-only message after the last round), so those
columns stay empty until then and are filled in by :func:`merge_measurement`. The headline of summary.json is
the deployed models' accuracy after the last measured round. A round that ``evaluate_every`` leaves unmeasured
keeps both its deployed and its after-training columns empty (never 0); figures and tables skip it.

Fairness across clients, beside every mean over clients: ``*_worst10`` is the mean accuracy of the worst
ceil(10 % of n) of the n clients measured (:func:`worst_share_mean`; 3 clients: the worst one), ``*_std`` the
population standard deviation of their accuracies (:func:`client_std`).

Whether the result means something (:func:`run_problems`): summary.json's ``problems`` lists, in words, why not
(nothing usable or delivered; a round that lost a majority of its training replies to rejection, counted apart
from the final evaluation's; a headline measured on fewer than
``min_measured_share`` of the clients; a last round whose training replies measured the deployed models on too few
of the clients that answered) and ``exit_status`` is the exit status it gives (EXIT_*; docs/reliability.md's table).
Bytes of rejected replies are ``bytes_up_rejected``, never part of ``bytes_up`` / ``eval_bytes_up``;
rejections.csv lists every rejected reply (phase ``train``, ``evaluate``, ``query``, ``describe``) and every
reply or step a strategy left out (phase ``aggregate``).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedapps.config import ExperimentConfig, config_hash, dump_yaml
from fedapps.reporting import plots
from fedapps.wire import protocol, validation

log = logging.getLogger("fedapps")

ARTIFACT_KINDS = ("table", "json", "heatmaps", "clusters")
PROTOCOL = "deployed-model"  # what every headline number measures (docs/evaluation.md); named in summary.json


@dataclass
class Artifact:
    """Something a strategy measured, as data; a sink decides how to write it.

    kind ``table``: a list of row dicts (CSV); ``json``: a JSON-serialisable document; ``heatmaps``: a list of (title,
    row ids, matrix) panels; ``clusters``: the keyword arguments of :func:`fedapps.reporting.plots.plot_clusters`
    (without ``path``). ``name`` is the file stem.
    """

    name: str
    kind: str
    data: Any

    def __post_init__(self) -> None:
        if self.kind not in ARTIFACT_KINDS:
            raise ValueError(f"unknown artifact kind '{self.kind}'; allowed: {', '.join(ARTIFACT_KINDS)}")


# exit statuses of `fedapps run` (fedapps_tools.cli) and summary.json's ``exit_status``
EXIT_OK = 0
EXIT_FAILED = 1  # the run failed: it crashed, or no reply was usable at all, or most messages never reached a client
EXIT_CONFIG = 2  # refused before it started (config, data, options)
EXIT_UNMEASURED = 3  # finished, but the headline was not measured, or on fewer than min_measured_share of the clients
EXIT_REJECTED = 4  # finished, but some round lost a majority of its training replies to rejection (rejections.csv)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM
EXIT_STATUSES = {
    EXIT_OK: "the run finished and its headline is meaningful",
    EXIT_FAILED: "the run failed (crashed, no usable reply at all, or most messages never reached a client)",
    EXIT_CONFIG: "refused before it started: a config, data or option error",
    EXIT_UNMEASURED: (
        "finished, but the headline was not measured, or on fewer than min_measured_share of the clients, or the "
        "last round's training replies measured the deployed models on too few of the clients that answered"
    ),
    EXIT_REJECTED: "finished, but some round lost a majority of its training replies to rejection",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM)",
}


class UnusableRun(RuntimeError):
    """A run whose result is not meaningful (:func:`run_problems`): nothing usable, a headline measured on too few
    clients, or rounds built on a majority of rejected replies; ``exit_status`` says which (EXIT_*).

    The ServerApp raises it after writing the results, so the Flower run ends ``finished:failed``."""

    def __init__(self, message: str, exit_status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class Problem:
    """Why a run's result is not meaningful, and the exit status it gives (EXIT_*); ``case``: the row of
    docs/reliability.md's exit-code table it is (tests/test_cli_reliability.py checks the table row by row)."""

    code: int
    text: str
    case: str = ""


MIB = 1024 * 1024  # bytes in the unit every traffic figure is printed in

TRAIN_PHASE, EVAL_PHASE = protocol.MESSAGE_TYPE, protocol.EVAL_MESSAGE_TYPE
PHASES = (TRAIN_PHASE, EVAL_PHASE)  # the phases of a round whose reply counts rounds.csv keeps apart


def phase_columns(phase: str) -> tuple[str, str]:
    """The rounds.csv columns of one phase's reply counts: ``<phase>_replies_ok``, ``<phase>_replies_rejected``."""
    return f"{phase}_replies_ok", f"{phase}_replies_rejected"


def phase_counts(row: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """A rounds.csv row's (accepted, rejected) replies per phase; privacy-budget refusals are not counted as rejected
    (a client that refused to train past its budget did as it was configured to). A row without per-phase columns
    (written before they existed: a resumed run's earlier rounds) counts both phases together, as training."""
    refused = int(row.get("privacy_refused") or 0)
    out: dict[str, tuple[int, int]] = {}
    for phase in PHASES:
        ok_key, rejected_key = phase_columns(phase)
        if row.get(ok_key) not in (None, "") or row.get(rejected_key) not in (None, ""):
            out[phase] = (int(row.get(ok_key) or 0), int(row.get(rejected_key) or 0))
    if not out:
        out[TRAIN_PHASE] = (int(row.get("replies_ok") or 0), int(row.get("replies_rejected") or 0))
    if TRAIN_PHASE in out:
        ok, rejected = out[TRAIN_PHASE]
        out[TRAIN_PHASE] = (ok, max(0, rejected - refused))
    return out


def rejection_problems(rows: Sequence[Mapping[str, Any]]) -> list[Problem]:
    """Rounds (rounds.csv rows) whose TRAINING replies were mostly rejected: more rejected than accepted, counted on
    their own, so that the final evaluation's accepted replies in the last round cannot hide a training phase whose
    replies were not (the final evaluation is judged by what it measured: :func:`measured_problems`). A round's
    missing replies are not counted (they are the delivery check's)."""
    lost, kept = [], 0
    for r in rows:
        ok, rejected = phase_counts(r).get(TRAIN_PHASE, (0, 0))
        if 2 * rejected > ok + rejected:
            lost.append(f"round {r.get('round')}: {rejected} of {ok + rejected}")
            kept += ok
    if not lost:
        return []
    built = (
        "those rounds aggregated a minority of their replies"
        if kept
        else "no reply of those rounds was usable: nothing was aggregated in them"
    )
    return [
        Problem(
            EXIT_REJECTED,
            case="training-rejected",
            text=f"{len(lost)} round(s) lost a majority of their training replies to rejection ("
            f"{'; '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}): {built}; see rejections.csv for the reasons",
        )
    ]


def last_round_problems(rows: Sequence[Mapping[str, Any]], min_share: float) -> list[Problem]:
    """The last round's training replies also measure the deployed models of the round before (rounds.csv's
    ``measured_clients`` of that row): measured on fewer than ``min_share`` of the clients whose training replies
    arrived (accepted or rejected; missing ones are the delivery check's), the last round trained on too few
    clients, whatever its final evaluation measured. Nothing to judge for a one-round run, a strategy that measures
    no deployed model on its training messages, or a last round no reply reached."""
    if len(rows) < 2:
        return []
    last, before = rows[-1], rows[-2]
    measured = before.get("measured_clients")
    counts = phase_counts(last).get(TRAIN_PHASE)
    if measured in (None, "") or counts is None:
        return []
    ok, rejected = counts
    arrived = ok + rejected
    need = math.ceil(min_share * arrived - 1e-9)
    if not arrived or int(measured) >= need:
        return []
    return [
        Problem(
            EXIT_UNMEASURED,
            case="last-round-measured-few",
            text=f"the last round (round {last.get('round')}) measured the deployed models after round "
            f"{before.get('round')} on {int(measured)} of the {arrived} clients whose training replies arrived, "
            f"fewer than min_measured_share={min_share:g} of them ({need}): the last round trained on too few "
            "clients; see rejections.csv",
        )
    ]


def measured_problems(summary: Mapping[str, Any], min_share: float) -> list[Problem]:
    """The headline (deployed-model accuracy after the last measured round) must exist and cover at least
    ``min_share`` of ``num_clients`` (at least one client)."""
    clients = int(summary.get("num_clients") or 0)
    measured = int(summary.get("final_round_measured_clients") or 0)
    need = max(1, math.ceil(min_share * clients - 1e-9))
    if summary.get("accuracy_mean") is None or measured == 0:
        return [
            Problem(
                EXIT_UNMEASURED,
                case="never-measured",
                text="the headline (deployed-model accuracy) was never measured: no client "
                "answered an evaluation of its deployed model",
            )
        ]
    if measured < need:
        return [
            Problem(
                EXIT_UNMEASURED,
                case="measured-on-few",
                text=f"the headline was measured on {measured} of {clients} clients (after round "
                f"{summary.get('final_round')}), fewer than min_measured_share="
                f"{min_share:g} of them ({need})",
            )
        ]
    return []


def run_problems(
    summary: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    min_share: float,
    delivery: DeliveryCheck | None = None,
) -> list[Problem]:
    """Everything that makes a finished run's result not meaningful, most basic first: nothing delivered or usable
    (:class:`DeliveryCheck`), phases of rounds lost to rejection, a headline measured on too few clients, a last round
    whose training replies measured too few (docs/reliability.md's exit-code table, row by row)."""
    out = [Problem(EXIT_FAILED, text, case) for case, text in (delivery.cases() if delivery is not None else [])]
    if delivery is not None and delivery.usable == 0:  # nothing usable: the rest follows and would only restate it
        return out
    return out + rejection_problems(rows) + measured_problems(summary, min_share) + last_round_problems(rows, min_share)


def exit_status(problems: Sequence[Problem]) -> int:
    """The exit status of a run with these problems: the first one's (EXIT_OK without any)."""
    return problems[0].code if problems else EXIT_OK


def summary_exit_status(path: Path, since: float = 0.0) -> int | None:
    """``exit_status`` of a summary.json written at or after ``since`` (a Unix time); None when there is none,
    it is older, or it does not say."""
    try:
        if path.stat().st_mtime < since:
            return None
        value = json.loads(path.read_text()).get("exit_status")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class DeliveryCheck:
    """A result sink that counts, over the whole run, the training messages sent, those that got any reply
    (an error reply counts: the message reached a client), and the usable replies; :meth:`problems` says
    what makes the run unusable."""

    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.usable = 0
        self.errors: list[str] = []  # distinct error reasons of client replies (first few)
        self.unreadable_state: list[str] = []  # distinct reasons of clients whose saved private model would not load

    def on_round(self, entry: Any) -> None:
        self.sent += int(getattr(entry, "sent", 0))
        self.answered += int(getattr(entry, "received", 0))
        self.usable += len(entry.replies)
        for reason in getattr(entry, "errors", ()):
            if reason not in self.errors and len(self.errors) < 5:
                self.errors.append(reason)
            if protocol.PRIVATE_STATE_UNREADABLE in reason and reason not in self.unreadable_state:
                self.unreadable_state.append(reason)

    def on_finish(self, summary: Mapping[str, Any], artifacts: list[Artifact]) -> None:
        pass

    def totals(self) -> dict[str, Any]:
        return {"messages_sent": self.sent, "messages_answered": self.answered, "usable_replies": self.usable}

    def problems(self) -> list[str]:
        """What makes the run unusable, in words (:meth:`cases` with the exit-code table's case of each)."""
        return [text for _, text in self.cases()]

    def cases(self) -> list[tuple[str, str]]:
        """(case of docs/reliability.md's exit-code table, text) of each thing that makes the run unusable."""
        out = []
        errors = f"; client errors: {' | '.join(self.errors)}" if self.errors else ""
        if self.usable == 0:
            text = (
                f"no usable client reply in the whole run ({self.sent} training messages sent, {self.answered} "
                "answered)"
                f": nothing was trained{errors}"
            )
            out.append(("no-usable-reply", text))
        if self.sent and 2 * self.answered < self.sent:
            text = (
                f"only {self.answered} of {self.sent} sampled messages reached a client (got any reply): "
                "check that the SuperNodes are up, the node ids, and strategy.timeout"
            )
            out.append(("undelivered", text))
        if self.unreadable_state:
            shown = " | ".join(validation.error_reason(r) for r in self.unreadable_state[:3])
            more = f" (and {len(self.unreadable_state) - 3} more)" if len(self.unreadable_state) > 3 else ""
            text = (
                f"{len(self.unreadable_state)} client(s) refused their messages because their saved private model "
                f"could not be loaded safely, and took no further part: {shown}{more}"
            )
            out.append(("private-state-unreadable", text))
        return out


class ResultSink(Protocol):
    """Receives a run's records as they are made (files today; experiment trackers plug in here)."""

    def on_round(self, entry: Any) -> None: ...

    def on_finish(self, summary: Mapping[str, Any], artifacts: list[Artifact]) -> None: ...


WORST_SHARE_PERCENT = 10  # acc_worst10: the mean accuracy of the worst ceil(10 % of n) clients


def worst_share_count(n: int, percent: int = WORST_SHARE_PERCENT) -> int:
    """How many clients "the worst ``percent`` %" of ``n`` clients are: ceil(n·percent/100), at least 1 (3 clients:
    1; 10: 1; 11: 2; 30: 3). Integer arithmetic: ``math.ceil(30 * 0.1)`` would give 4."""
    if n < 1:
        raise ValueError(f"the worst {percent} % of {n} clients: there must be at least one client")
    return max(1, -(-n * percent // 100))


def worst_share_mean(accuracies: Sequence[float], percent: int = WORST_SHARE_PERCENT) -> float:
    """Fairness across clients: the MEAN accuracy of the worst :func:`worst_share_count` clients (the lowest
    accuracies; ties make no difference to the value)."""
    k = worst_share_count(len(accuracies), percent)
    return sum(sorted(float(a) for a in accuracies)[:k]) / k


def client_std(accuracies: Sequence[float]) -> float:
    """Spread across clients: the POPULATION standard deviation of the clients' accuracies,
    sqrt(Σ(a_i − mean)² / n) — the measured clients are the federation described, not a sample of a larger one
    (one client: 0)."""
    if not accuracies:
        raise ValueError("the standard deviation over clients needs at least one client")
    vals = [float(a) for a in accuracies]
    mean = sum(vals) / len(vals)
    return math.sqrt(sum((a - mean) ** 2 for a in vals) / len(vals))


def accuracy_stats(metrics: Iterable[Mapping[str, Any]], tag: str) -> dict[str, float]:
    """Of evaluation ``tag``, over the clients that reported it: the accuracy as mean over clients
    (``acc_mean``), sample-weighted (``acc_weighted``), of the worst 10 % of clients (``acc_worst10``,
    :func:`worst_share_mean`) and its population std over clients (``acc_std``, :func:`client_std`); and the
    sample-weighted loss."""
    rows = [m for m in metrics if f"{tag}-acc" in m]
    if not rows:
        return {}
    n = sum(float(m[f"{tag}-n"]) for m in rows)
    correct = sum(float(m[f"{tag}-correct"]) for m in rows)
    per_client = [float(m[f"{tag}-acc"]) for m in rows]
    return {
        "acc_mean": sum(per_client) / len(per_client),
        "acc_weighted": correct / n if n else 0.0,
        "acc_worst10": worst_share_mean(per_client),
        "acc_std": client_std(per_client),
        "loss": sum(float(m[f"{tag}-loss"]) * float(m[f"{tag}-n"]) for m in rows) / n if n else 0.0,
    }


def eval_tags(metrics: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every evaluation tag present in the replies (keys '<tag>-acc')."""
    tags: list[str] = []
    for m in metrics:
        for k in m:
            if k.endswith("-acc") and k[:-4] not in tags:
                tags.append(k[:-4])
    return tags


def after_training_stats(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The clients' models right after their local update: ``acc_after_training_mean`` / ``_weighted`` /
    ``_worst10`` / ``_std`` and ``loss_after_training`` (the second column of the protocol)."""
    stats = accuracy_stats(metrics, protocol.AFTER_TAG)
    return {AFTER_TRAINING_COLUMNS[k]: v for k, v in stats.items()}


AFTER_TRAINING_COLUMNS = {  # accuracy_stats' names -> rounds.csv's after-training columns
    "acc_mean": "acc_after_training_mean",
    "acc_weighted": "acc_after_training_weighted",
    "acc_worst10": "acc_after_training_worst10",
    "acc_std": "acc_after_training_std",
    "loss": "loss_after_training",
}


def measured_columns(metrics: Iterable[Mapping[str, Any]], num_clients: int) -> dict[str, Any]:
    """A deployed-model measurement (replies' metrics carrying ``deployed-*``) as the columns of the row of the
    round it measures: ``measured_clients``, ``acc_mean``, ``acc_weighted``, ``acc_worst10``, ``acc_std``, ``loss``
    and ``acc_client_<i>``, and ``<name>_acc_mean`` / ``_weighted`` of each companion evaluation (tag
    ``deployed.<name>``)."""
    rows = [m for m in metrics if protocol.metric_name(protocol.DEPLOYED_TAG, "acc") in m]
    out: dict[str, Any] = {"measured_clients": len(rows), **accuracy_stats(rows, protocol.DEPLOYED_TAG)}
    for tag in eval_tags(rows):
        name = protocol.companion_name(tag)
        if name is not None:
            out.update({f"{name}_{k}": v for k, v in accuracy_stats(rows, tag).items() if k != "loss"})
    for m in rows:
        cid = int(m[protocol.CLIENT_ID])
        if 0 <= cid < num_clients:
            out[f"acc_client_{cid}"] = float(m[protocol.metric_name(protocol.DEPLOYED_TAG, "acc")])
    return out


def merge_measurement(rows: list[dict[str, Any]], round_: int, columns: Mapping[str, Any]) -> bool:
    """Write a deployed-model measurement (:func:`measured_columns`) into the row of the round it measures;
    False (nothing written) when there is no such row."""
    for row in rows:
        if row.get("round") == round_:
            row.update(columns)
            return True
    return False


def round_row(entry: Any, num_clients: int) -> dict[str, Any]:
    """One row of rounds.csv from a RoundLog: the round's training phase; the deployed-model columns empty until
    :func:`merge_measurement` fills them in."""
    metrics = [r.metrics for r in entry.replies]
    row: dict[str, Any] = {
        "round": entry.round,
        "clients": len(entry.replies),
        "skipped": int(bool(getattr(entry, "skipped", False))),  # too few usable replies: not aggregated
        # the deployed models after this round (measured one message later)
        "acc_mean": "",
        "acc_weighted": "",
        "acc_worst10": "",
        "acc_std": "",
        "loss": "",
        "measured_clients": "",
        "bytes_up": entry.bytes_up,
        # bytes of the replies the validator rejected (both phases): not algorithm traffic, counted apart
        "bytes_up_rejected": getattr(entry, "bytes_up_rejected", 0),
        "bytes_down": entry.bytes_down,
        "eval_bytes_up": entry.eval_bytes_up,
        "eval_bytes_down": entry.eval_bytes_down,
        "wall_seconds": round(entry.wall_seconds, 3),
        # seconds the clients spent serving the round's training messages (sum of their t-total): the rest of
        # workers x wall_seconds is transport, the server step and waiting (bench/round_overhead.py)
        "client_seconds": round(sum(float(m.get(protocol.TOTAL_TIME, 0.0)) for m in metrics), 3),
        # reply validation (fedapps.wire.validation): accepted, rejected (see rejections.csv), asked for but not
        # received
        "replies_ok": getattr(entry, "replies_ok", len(entry.replies)),
        "replies_rejected": getattr(entry, "replies_rejected", 0),
        "replies_missing": getattr(entry, "replies_missing", 0),
    }
    for phase, (ok, rejected) in getattr(entry, "replies_by_phase", {}).items():  # the same counts per phase
        row.update(dict(zip(phase_columns(phase), (ok, rejected), strict=True)))
    row.update(profile_columns([r.profile if isinstance(r, protocol.ClientReply) else None for r in entry.replies]))
    # the server's steps of the round (fedapps.server.rounds.StepClock): messages built, the exchange with the
    # clients, the replies checked, the aggregation; the rest of wall_seconds is the final evaluation's
    for step, seconds in getattr(entry, "steps", {}).items():
        row[f"round_{step}_seconds"] = round(seconds, 4)
    row.update(dict.fromkeys(AFTER_TRAINING_COLUMNS.values(), ""))  # empty in a round not measured (evaluate_every)
    row.update(after_training_stats(metrics))
    losses = [float(m["train-loss"]) for m in metrics if "train-loss" in m]
    row["train_loss"] = sum(losses) / len(losses) if losses else ""
    row.update(privacy_columns(metrics, getattr(entry, "rejections", [])))
    for tag in eval_tags(metrics):  # companions (deployed.<name>) measure the previous round: measured_columns
        if tag not in (protocol.DEPLOYED_TAG, protocol.AFTER_TAG) and protocol.companion_name(tag) is None:
            for k, v in accuracy_stats(metrics, tag).items():
                if k != "loss":
                    row[f"{tag}_{k}"] = v
    for k, v in entry.extra.items():
        if isinstance(v, (int, float, str)):
            row[k] = v
    for i in range(num_clients):
        row[f"acc_client_{i}"] = ""  # the deployed model of client i (filled in with the measurement)
    return row


def profile_columns(profiles: Iterable[protocol.MessageProfile | None]) -> dict[str, float]:
    """Where the clients' time on a round's training messages went (their replies' profiles,
    :class:`fedapps.wire.protocol.MessageProfile`): per phase the seconds summed over the replies,
    ``client_<phase>_seconds``, and ``client_wall_seconds``, the sum of the messages' walls on the clients (a reply
    without a profile adds nothing). Divided by ``clients``: the mean per message."""
    present = [p for p in profiles if p is not None]
    out = {}
    for name in protocol.PROFILE_FIELDS:
        out[f"client_{name}_seconds"] = round(sum(getattr(p, name) for p in present), 4)
    return out


def privacy_columns(metrics: Iterable[Mapping[str, Any]], rejections: Iterable[Any]) -> dict[str, Any]:
    """Differential privacy in a round's row (docs/privacy.md): the ε each replying client reported
    (``epsilon_client_<i>``: of all its training so far), their maximum (``epsilon_max``) and the replies refused
    past ``privacy.epsilon_budget`` (``privacy_refused``); nothing when the round has neither (privacy off)."""
    eps = {
        int(m[protocol.CLIENT_ID]): float(m[protocol.PRIVACY_EPSILON]) for m in metrics if protocol.PRIVACY_EPSILON in m
    }
    refused = sum(1 for r in rejections if protocol.PRIVACY_REFUSED in str(getattr(r, "reason", "")))
    if not eps and not refused:
        return {}
    out: dict[str, Any] = {"epsilon_max": max(eps.values()) if eps else "", "privacy_refused": refused}
    out.update({f"epsilon_client_{cid}": value for cid, value in sorted(eps.items())})
    return out


EPSILON_COLUMN = "epsilon_client_"


def privacy_summary(cfg: ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's ``privacy``: the unit and settings of the mode, each client's latest ε (sample: reported by the
    client, of all its training in the run; client: the server's accountant, of all the releases its predictions
    entered), their maximum and the replies refused past the budget (sample)."""
    latest: dict[int, float] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith(EPSILON_COLUMN) and _number(value) is not None:
                latest[int(key[len(EPSILON_COLUMN) :])] = float(value)
    p = cfg.privacy
    if p.mode == "client":
        unit = (
            "one client: all its predictions on U in the run (the server clips each client's and adds Gaussian "
            "noise to their aggregates: central DP, the server is trusted)"
        )
        # clip_norm None: sqrt(rows of U); fixed-size cohorts are not Poisson: no amplification, each client's
        # own releases count
        mechanism: dict[str, Any] = {"clip_norm": p.clip_norm or None, "sampling_amplification": False}
    else:
        unit = "one training sample of a client (sample-level DP-SGD on its local training)"
        mechanism = {"max_grad_norm": p.max_grad_norm}
    return {
        "mode": p.mode,
        "unit": unit,
        "delta": p.delta,
        "noise_multiplier": p.noise_multiplier,
        **mechanism,
        "epsilon_budget": p.epsilon_budget or None,
        "reproducible_noise": p.reproducible_noise,
        "epsilon_max": max(latest.values()) if latest else None,
        "epsilon_per_client": {str(c): e for c, e in sorted(latest.items())},
        "refused": sum(int(r.get("privacy_refused") or 0) for r in rows),
    }


def eta_seconds(spent: float, steps_timed: int, steps_left: int) -> float | None:
    """Time still needed for ``steps_left`` steps at the mean pace of the ``steps_timed`` steps that took
    ``spent`` seconds; None before any step was timed (no pace known yet)."""
    if steps_timed <= 0:
        return None
    return spent / steps_timed * max(0, steps_left)


def format_duration(seconds: float | None, words: bool = False) -> str:
    """A duration as a person reads it: compact for progress lines ('42s', '3m05s', '1h02m'), or in words for the
    end-of-run summary ('2.5 s', '29 s', '1 min 29 s', '2 h 05 min'); '?' when unknown."""
    if seconds is None:
        return "?"
    raw = max(0.0, float(seconds))
    if words and raw < 10:
        return f"{raw:.1f} s"
    s = int(round(raw))
    minute, hour = (" min ", " h ") if words else ("m", "h")
    second, tail = (" s", " min") if words else ("s", "m")
    if s < 60:
        return f"{s}{second}"
    if s < 3600:
        return f"{s // 60}{minute}{s % 60:{'d' if words else '02d'}}{second}"
    return f"{s // 3600}{hour}{s % 3600 // 60:02d}{tail}"


class Progress:
    """Elapsed time and ETA over ``total`` steps; the pace comes from the steps that did work (``step(True)``),
    so steps skipped as already done (resumed compare/tune) neither cost time nor distort the estimate."""

    def __init__(self, total: int, clock: Any = time.monotonic) -> None:
        self.total, self.clock = total, clock
        self.started = self.last = clock()
        self.done = self.timed = 0
        self.spent = 0.0

    def step(self, worked: bool = True) -> None:
        now = self.clock()
        self.done += 1
        if worked:
            self.timed += 1
            self.spent += now - self.last
        self.last = now

    def line(self) -> str:
        elapsed = self.clock() - self.started
        return (
            f"elapsed {format_duration(elapsed)}, "
            f"ETA {format_duration(eta_seconds(self.spent, self.timed, self.total - self.done))}"
        )


class FileSink:
    """Writes one run's results folder as the run goes, and logs a progress line per round."""

    def __init__(self, cfg: ExperimentConfig, output_dir: str | Path, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        # run_dir: an existing run folder to write into (a resumed run), whatever the config's run name
        self.dir = (
            Path(run_dir) if run_dir is not None else Path(output_dir).expanduser().resolve() / cfg.resolved_run_name()
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "rounds.csv") + (() if run_dir is not None else (REJECTIONS,)):
            (self.dir / stale).unlink(missing_ok=True)  # a resumed run keeps rejections.csv (see restore_rows)
        (self.dir / "config.yaml").write_text(dump_yaml(cfg))
        self.config_hash = config_hash(cfg)
        (self.dir / "config.sha256").write_text(self.config_hash + "\n")
        self.rows: list[dict[str, Any]] = []
        self.progress = Progress(cfg.rounds)

    def restore_rows(self, rows: Sequence[Mapping[str, Any]], last_round: int) -> None:
        """The rows of the rounds already run (from a checkpoint of round ``last_round``): kept and rounds.csv
        rewritten; rejections.csv keeps its rows up to that round (later ones were of rounds now run again)."""
        self.rows = [dict(r) for r in rows]
        write_csv(self.dir / "rounds.csv", self.rows)
        trim_rejections(self.dir / REJECTIONS, last_round)
        self.progress = Progress(self.cfg.rounds - len(self.rows))  # the pace of the rounds this process runs

    def write_partition(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Samples per client per class (train and test) as partition.csv."""
        write_csv(self.dir / "partition.csv", rows)

    def on_round(self, entry: Any) -> None:
        """Append a round, file its deployed-model measurements under the rounds they measure, rewrite
        rounds.csv; log a progress line."""
        row = round_row(entry, self.cfg.data.num_clients)
        self.rows.append(row)
        measured = []
        for m in getattr(entry, "measurements", []):
            columns = measured_columns([r.metrics for r in m.replies], self.cfg.data.num_clients)
            if merge_measurement(self.rows, m.round, columns):
                measured.append(
                    f"deployed after round {m.round}: acc_mean {_fmt(columns.get('acc_mean'))}  "
                    f"acc_weighted {_fmt(columns.get('acc_weighted'))}  "
                    f"acc_worst10 {_fmt(columns.get('acc_worst10'))} ({columns['measured_clients']} clients)"
                )
            else:
                log.warning("no row of round %d for its deployed-model measurement", m.round)
        write_csv(self.dir / "rounds.csv", self.rows)
        append_rejections(self.dir / REJECTIONS, [*getattr(entry, "rejections", []), *getattr(entry, "skips", [])])
        self.progress.step()
        log.info(
            "round %d/%d  clients %d  after training: acc_mean %s  up %.2f MiB  down %.2f MiB  %.1f s  (%s)%s",
            entry.round,
            self.cfg.rounds,
            row["clients"],
            _fmt(row.get("acc_after_training_mean")),
            entry.bytes_up / MIB,  # the whole round's, in the unit of the summary's per-client figures
            entry.bytes_down / MIB,
            entry.wall_seconds,
            self.progress.line(),
            "".join(f"  |  {text}" for text in measured),
        )

    def summary(self, wall_seconds: float, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """summary.json's content: the rounds so far summarised, plus the strategy's own entries."""
        summary = summarise(self.cfg, self.rows, wall_seconds)
        summary["config_hash"] = self.config_hash
        summary.update(extra or {})
        return summary

    def on_finish(self, summary: Mapping[str, Any], artifacts: list[Artifact]) -> None:
        """Write summary.json, accuracy.png and every artefact (a failing figure never loses the results)."""
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        title = self.cfg.resolved_run_name()
        self._draw(
            "accuracy.png",
            lambda path: plots.plot_accuracy(self.rows, path, title=title, method=self.cfg.strategy.name),
        )
        for a in artifacts:
            if a.kind == "table":
                write_csv(self.dir / f"{a.name}.csv", a.data)
            elif a.kind == "json":
                (self.dir / f"{a.name}.json").write_text(json.dumps(a.data, indent=1, default=float))
            elif a.kind == "heatmaps":
                self._draw(f"{a.name}.png", lambda path, panels=a.data: plots.plot_heatmaps(panels, path))
            elif a.kind == "clusters":
                self._draw(f"{a.name}.png", lambda path, kw=a.data: plots.plot_clusters(path=path, **kw))
        log.info("results written to %s", self.dir)

    def _draw(self, filename: str, draw: Any) -> None:
        """draw(path) into the run folder; a failing figure is logged and never loses the results."""
        try:
            draw(self.dir / filename)
        except Exception as exc:  # noqa: BLE001 - a figure never costs the results
            log.warning("could not draw %s: %s", filename, exc)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else "-"


def summarise(cfg: ExperimentConfig, rows: Sequence[Mapping[str, Any]], wall_seconds: float) -> dict[str, Any]:
    """summary.json content: the headline (``accuracy_mean`` / ``accuracy_weighted``: the DEPLOYED models after
    the last measured round, never the best round) with its fairness across clients (``accuracy_worst10``,
    ``accuracy_std``), the after-training accuracy of that round (the same four), totals, and the best round as
    a labelled extra.

    The reported numbers come from the last round whose deployed models were measured (``final_round``; the
    last round's always are, by the evaluation-only message, unless no client answered it); when the run's last
    round got no usable training reply, ``final_round_had_no_replies`` is true. Skipped rounds (fewer usable
    replies than ``strategy.min_clients``: nothing aggregated) are listed in ``skipped_rounds``; their deployed
    models are those of the round before, measured and filed under them like any other round's."""
    scored = [r for r in rows if isinstance(r.get("acc_mean"), float)]
    final = scored[-1] if scored else {}
    last = scored[-5:]
    clients = cfg.data.num_clients
    rounds = len(rows)
    up = sum(int(r["bytes_up"]) for r in rows)
    down = sum(int(r["bytes_down"]) for r in rows)
    summary: dict[str, Any] = {
        "run_name": cfg.resolved_run_name(),
        "strategy": cfg.strategy.name,
        "dataset": cfg.data.source,
        "partition": cfg.data.partition,
        # which split every accuracy here was measured on: "test", or "validation" (a tuning run; never a test number)
        "evaluated_on": cfg.data.evaluate_on,
        "model": cfg.model.name if not cfg.model.per_client else "+".join(cfg.model.per_client),
        "num_clients": clients,
        "seed": cfg.seed,
        "rounds": rounds,
        "final_round": final.get("round"),
        "final_round_had_no_replies": bool(rows) and int(rows[-1]["clients"]) == 0,
        "skipped_rounds": [r["round"] for r in rows if r.get("skipped")],
        "protocol": PROTOCOL,
        "accuracy_mean": final.get("acc_mean"),
        "accuracy_weighted": final.get("acc_weighted"),
        # fairness across clients, same models and clients: mean of the worst 10 %, population std
        "accuracy_worst10": _number(final.get("acc_worst10")),
        "accuracy_std": _number(final.get("acc_std")),
        "final_round_measured_clients": final.get("measured_clients"),
        "accuracy_after_training_mean": _number(final.get("acc_after_training_mean")),
        "accuracy_after_training_weighted": _number(final.get("acc_after_training_weighted")),
        "accuracy_after_training_worst10": _number(final.get("acc_after_training_worst10")),
        "accuracy_after_training_std": _number(final.get("acc_after_training_std")),
        # the last 5 MEASURED rounds (with evaluate_every k > 1 they span 5k rounds)
        "accuracy_mean_last5": sum(r["acc_mean"] for r in last) / len(last) if last else None,
        "bytes_up": up,
        "bytes_down": down,
        "eval_bytes_up": sum(int(r["eval_bytes_up"]) for r in rows),
        "bytes_up_rejected": sum(int(r.get("bytes_up_rejected") or 0) for r in rows),
        "eval_bytes_down": sum(int(r["eval_bytes_down"]) for r in rows),
        "bytes_up_per_client_round": up / max(1, sum(int(r["clients"]) for r in rows)),
        "bytes_down_per_client_round": down / max(1, sum(int(r["clients"]) for r in rows)),
        "wall_seconds": round(wall_seconds, 2),
    }
    for key in final:
        if key.endswith("_acc_mean") or key.endswith("_acc_weighted"):
            summary[f"final_{key}"] = final[key]
    if cfg.privacy.mode != "off":
        summary["privacy"] = privacy_summary(cfg, rows)
    if scored:
        best = max(scored, key=lambda r: r["acc_mean"])
        summary[f"best_round_on_{cfg.data.evaluate_on}_set_NOT_the_result"] = {
            "round": best["round"],
            "accuracy_mean": best["acc_mean"],
        }
    return summary


REJECTIONS = "rejections.csv"
REJECTION_COLUMNS = ("round", "phase", "node_id", "client_id", "reason")


def append_rejections(path: Path, rejections: Iterable[Any]) -> None:
    """Append rejected replies (objects with ``row()``: round, phase, node, client id, reason) to rejections.csv;
    the file exists (header only) from the first round on, so an empty one says that nothing was rejected."""
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=REJECTION_COLUMNS, restval="")
        if new:
            w.writeheader()
        for r in rejections:
            w.writerow({k: v for k, v in r.row().items() if k in REJECTION_COLUMNS})


def trim_rejections(path: Path, last_round: int) -> None:
    """Keep the rows of rejections.csv up to round ``last_round`` (a resumed run runs the later rounds again)."""
    if not path.is_file():
        return
    with path.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if not r.get("round", "").isdigit() or int(r["round"]) <= last_round]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=REJECTION_COLUMNS, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rows with possibly different keys -> one CSV whose header is the union (in first-seen order)."""
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, restval="")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def read_csv(path: Path) -> list[dict[str, Any]]:
    """rounds.csv back as dicts with numbers parsed."""

    def parse(v: str) -> Any:
        if v == "":
            return None
        try:
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        except ValueError:
            return v

    with Path(path).open() as fh:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(fh)]
