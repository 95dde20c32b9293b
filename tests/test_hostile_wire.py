"""Hostile replies on the wire: arrays of a type the message did not ask for, out-of-range train-loss and timing
metrics, huge list metrics. Each case runs a strategy in-process (digits, MLP, 2 clients, 2 rounds; the helpers of
test_faults.py) with the fault on the LOWEST client id (whose reply comes first: the one an average takes its dtype
from) and checks that the reply is rejected with its reason and that the server's state equals that of the run
where the reply never arrived."""

from __future__ import annotations

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


def test_every_round_is_recorded():
    got = run("fedavg", "")
    assert [x.round for x in got.logs] == list(range(1, ROUNDS + 1))
