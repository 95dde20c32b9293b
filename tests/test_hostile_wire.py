"""Hostile replies on the wire: arrays of a type the message did not ask for, out-of-range train-loss and timing
metrics, huge list metrics. Each case runs a strategy in-process (digits, MLP, 2 clients, 2 rounds; the helpers of
test_faults.py) with the fault on the LOWEST client id (whose reply comes first: the one an average takes its dtype
from) and checks that the reply is rejected with its reason and that the server's state equals that of the run
where the reply never arrived."""

from __future__ import annotations

import csv

import pytest

from fedapps import faults
from test_faults import ARRAYS, PREDICTIONS, ROUNDS, assert_same_state, baseline, run

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
}


def wire_cases() -> list[tuple[str, str]]:
    """Every strategy that exchanges model arrays × every wire fault; every pseudo-label strategy × pred-dtype."""
    return [(s, k) for s in ARRAYS for k in faults.WIRE_FAULTS] + [(s, "pred-dtype") for s in PREDICTIONS]


def assert_rejected_as_if_dropped(strategy: str, kind: str, reason: str, rnd: int = 1) -> None:
    got = run(strategy, f"{kind}@{HOSTILE}/{rnd}", faulty=HOSTILE)
    rejected = [r for log in got.logs if log.round == rnd for r in log.rejections]
    assert len(rejected) == 1, [r.reason for r in rejected]
    assert reason in rejected[0].reason, rejected[0].reason
    assert rejected[0].node_id == 100 + HOSTILE
    assert [x.replies_rejected for x in got.logs] == [int(x.round == rnd) for x in got.logs]
    want = baseline(strategy, f"drop@{HOSTILE}/{rnd}", HOSTILE)
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


def test_a_reply_a_strategy_cannot_use_is_recorded_in_rejections_csv(tmp_path):
    """A reply the validator accepts but the algorithm leaves out (IFCA: a cluster choice outside [0, K)) is a row
    of rejections.csv (phase 'aggregate', the strategy's reason), not only a log line."""
    from flwr.app import MetricRecord

    import server_app
    from fedapps import protocol
    from fedapps.inprocess import InProcessGrid
    from strategies.ifca import CHOICE

    def bad_choice(msg, context, call_next):
        reply = call_next(msg, context)
        if context.node_config["partition-id"] == 0 and int(msg.content["config"]["round"]) == 1 \
                and not reply.has_error() and CHOICE in reply.content[protocol.METRICS]:
            reply.content[protocol.METRICS] = MetricRecord({**dict(reply.content[protocol.METRICS]), CHOICE: 99})
        return reply

    args = ["strategy.name=ifca", "rounds=2", "data.source=digits", "data.num_clients=3", "model.name=mlp",
            "client.epochs=1", "strategy.params.ifca.clusters=2", "run_name=skip"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    summary = server_app.run_experiment(InProcessGrid(3, mods=[bad_choice]), str(cfg), " ".join(args),
                                        str(tmp_path / "out"))
    with (tmp_path / "out" / "skip" / "rejections.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["phase"], r["node_id"], r["client_id"]) for r in rows] == [("1", "aggregate", "100", "0")]
    assert rows[0]["reason"] == "ifca: no valid model or cluster choice"
    assert summary["problems"] == []  # a skipped reply is no rejection: replies_rejected stays 0
