"""Hostile replies on the wire: arrays of a type the message did not ask for, out-of-range train-loss and timing
metrics, huge list metrics, predictions just outside the one prediction check's bounds. Each case runs a strategy
in-process (digits, MLP, 2 clients, 2 rounds; the helpers of test_faults.py) with the fault on the LOWEST client id
(whose reply comes first: the one an average takes its dtype from) and checks that the reply is rejected with its
reason and that the server's state equals that of the run where the reply never arrived."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from fedapps.flower import faults
from fedapps.wire import protocol
from test_faults import ARRAYS, PREDICTIONS, Run, assert_same_state, baseline, run

HOSTILE = 0  # the lowest client id: first in every sum over replies (sorted by client id)

WIRE_REASON = {
    "f64-huge": "has dtype float64, expected float32",
    "longdouble": "has dtype float128, expected float32",
    "big-endian": "has dtype >f4, expected float32",
    "dtype-lie": "cannot be decoded",
    "trailing-bytes": "cannot be decoded",
    "pred-dtype": "has dtype",
}
METRIC_REASON = {
    "loss-huge": "train-loss",
    "time-huge": "t-",
    "list-huge": "'junk-list' is a list of 100000 values",
    "metric-flood": "metric values",  # lists of 4,096 floats up to 1,024 metrics: refused on its total
}


def wire_cases() -> list[tuple[str, str]]:
    """Every strategy that exchanges model arrays × every wire fault; every pseudo-label strategy × pred-dtype."""
    return [(s, k) for s in ARRAYS for k in faults.WIRE_FAULTS] + [(s, "pred-dtype") for s in PREDICTIONS]


def assert_rejected_as_if_dropped(strategy: str, kind: str, reason: str, rnd: int = 1) -> None:
    got = run(strategy, f"{kind}@{HOSTILE}/{rnd}", faulty=HOSTILE)
    assert_as_if_dropped(got, baseline(strategy, f"drop@{HOSTILE}/{rnd}", HOSTILE), reason, rnd)


def assert_as_if_dropped(got: Run, want: Run, reason: str, rnd: int = 1) -> None:
    """The hostile client's reply of round ``rnd`` is the one rejection, for ``reason``, and the run ends in the
    state of ``want``, the run where that reply never arrived."""
    rejected = [r for log in got.logs if log.round == rnd for r in log.rejections]
    assert len(rejected) == 1, [r.reason for r in rejected]
    assert reason in rejected[0].reason, rejected[0].reason
    assert rejected[0].node_id == 100 + HOSTILE
    assert [x.replies_rejected for x in got.logs] == [int(x.round == rnd) for x in got.logs]
    assert_same_state(got, want)
    # the bytes of the rejected reply are counted apart, never as traffic of the algorithm
    assert got.logs[rnd - 1].bytes_up_rejected > 0 and got.logs[rnd - 1].bytes_up == want.logs[rnd - 1].bytes_up
    assert all(x.bytes_up_rejected == 0 for x in got.logs if x.round != rnd)


@pytest.mark.parametrize("strategy,kind", wire_cases())
def test_a_reply_of_the_wrong_wire_type_is_rejected_and_changes_nothing(strategy, kind):
    assert_rejected_as_if_dropped(strategy, kind, WIRE_REASON[kind])


@pytest.mark.parametrize("kind", sorted(METRIC_REASON))
@pytest.mark.parametrize("strategy", ["fedavg", "fedmd"])
def test_train_loss_timing_and_list_metrics_are_range_checked(strategy, kind):
    assert_rejected_as_if_dropped(strategy, kind, METRIC_REASON[kind])


# predictions just outside the one prediction check (fedapps.wire.validation.prediction_problem), per pseudo-label
# strategy in the form its message asks for: hard labels (FedCT; COSMOS with uplink_encoding hard) with one label
# equal to the number of classes (the abstain marker, which only the server may send); logits (FedMD) one step
# beyond LOGIT_BOUND; probabilities (COMET) with one row summing to 1 + 1.1 × PROB_TOLERANCE
NUM_CLASSES = 10  # digits


def beyond_the_bound(wire: np.ndarray, output: str) -> np.ndarray:
    """A copy of ``wire`` with its first row just outside the prediction check's bound for its kind (hard labels by
    their dtype, else the message's ``predict.output``)."""
    from fedapps.wire.validation import LOGIT_BOUND, PROB_TOLERANCE

    out = wire.copy()
    if out.dtype.kind == "u":
        out[0] = NUM_CLASSES
    elif output == "logits":
        out[0, 0] = np.nextafter(np.float32(LOGIT_BOUND), np.float32(np.inf))
    else:
        out[0, 0] += np.float32(PROB_TOLERANCE * 1.1)
    return out


def predictions_beyond_the_bound(msg, context, call_next):
    """Client mod: the hostile client's round-1 predictions moved just outside the bound (beyond_the_bound)."""
    reply = call_next(msg, context)
    if (
        int(context.node_config["partition-id"]) == HOSTILE
        and protocol.request_of(msg).round == 1
        and not reply.has_error()
        and protocol.PREDICTIONS in reply.content
    ):
        wire = reply.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy()
        output = protocol.request_of(msg).public.predict_output
        reply.content[protocol.PREDICTIONS] = protocol.arrays_record(
            {protocol.PREDICTION_ARRAY: beyond_the_bound(wire, output)}
        )
    return reply


HARD_REASON = f"hard label {NUM_CLASSES} out of range [0, {NUM_CLASSES})"
BOUND_CASES = {  # strategy -> (extra overrides, the rejection's reason)
    "fedct": ((), HARD_REASON),
    "cosmos": (("strategy.params.cosmos.uplink_encoding=hard",), HARD_REASON),
    "fedmd": ((), "logits beyond ±10000"),
    "comet": ((), "not probability vectors"),
}


def test_every_pseudo_label_strategy_has_a_bound_case():
    assert sorted(BOUND_CASES) == sorted(PREDICTIONS)


@pytest.mark.parametrize("strategy", sorted(BOUND_CASES))
def test_predictions_just_outside_the_one_check_are_rejected_and_change_nothing(strategy):
    """Each pseudo-label strategy's replies are checked once, by the validator, with the one prediction check: a
    hard label equal to the number of classes (or logits / probabilities just outside their bound) is rejected
    with its reason, and the state equals that of the run where the reply never arrived."""
    extra, reason = BOUND_CASES[strategy]
    got = run(strategy, extra=extra, faulty=HOSTILE, mods=(predictions_beyond_the_bound,))
    want = run(strategy, f"drop@{HOSTILE}/1", extra=extra, faulty=HOSTILE)
    assert_as_if_dropped(got, want, f"predictions unusable: {reason}")


def test_a_hard_label_equal_to_the_classes_is_a_row_of_rejections_csv(tmp_path):
    """Through the server app: FedCT's rejected reply is written to rejections.csv with the check's reason."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    args = [
        "strategy.name=fedct",
        "rounds=1",
        "data.source=digits",
        "data.num_clients=3",
        "strategy.min_clients=2",
        "model.name=mlp",
        "client.epochs=1",
        "data.public_fraction=0.2",
        "strategy.params.fedct.pretrain_epochs=1",
        "strategy.params.fedct.distill_epochs=1",
        "run_name=bound",
    ]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    server_app.run_experiment(
        InProcessGrid(3, mods=[predictions_beyond_the_bound]), str(cfg), " ".join(args), str(tmp_path / "out")
    )
    with (tmp_path / "out" / "bound" / "rejections.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["phase"], r["node_id"], r["client_id"]) for r in rows] == [("1", "train", "100", "0")]
    assert HARD_REASON in rows[0]["reason"]


def test_a_reply_a_strategy_cannot_use_is_recorded_in_rejections_csv(tmp_path):
    """A reply the validator accepts but the algorithm leaves out (IFCA: a cluster choice outside [0, K)) is a row
    of rejections.csv (phase 'aggregate', the strategy's reason), not only a log line."""
    from flwr.app import MetricRecord

    import server_app
    from fedapps.flower.inprocess import InProcessGrid
    from fedapps.wire import protocol
    from strategies.ifca import CHOICE

    def bad_choice(msg, context, call_next):
        reply = call_next(msg, context)
        if (
            context.node_config["partition-id"] == 0
            and protocol.request_of(msg).round == 1
            and not reply.has_error()
            and CHOICE in reply.content[protocol.METRICS]
        ):
            reply.content[protocol.METRICS] = MetricRecord({**dict(reply.content[protocol.METRICS]), CHOICE: 99})
        return reply

    args = [
        "strategy.name=ifca",
        "rounds=2",
        "data.source=digits",
        "data.num_clients=3",
        "model.name=mlp",
        "client.epochs=1",
        "strategy.params.ifca.clusters=2",
        "run_name=skip",
    ]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    summary = server_app.run_experiment(
        InProcessGrid(3, mods=[bad_choice]), str(cfg), " ".join(args), str(tmp_path / "out")
    )
    with (tmp_path / "out" / "skip" / "rejections.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["phase"], r["node_id"], r["client_id"]) for r in rows] == [("1", "aggregate", "100", "0")]
    assert rows[0]["reason"] == "ifca: no valid model or cluster choice"
    assert summary["problems"] == []  # a skipped reply is no rejection: replies_rejected stays 0
