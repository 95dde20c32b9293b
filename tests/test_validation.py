"""Reply validation (fedapps.wire.validation) and robust aggregation (fedapps.server.robust): hand-computed cases,
Flower's own FedMedian / FedTrimmedAvg on the same inputs, and a property test over arbitrary reply contents."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedapps.config import ConfigError, load_config, smallest_trim, trimmed_per_side
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.aggregation import average_matching
from fedapps.server.robust import (
    AggregationRule,
    cap_weights,
    clip_update,
    combine,
    coordinate_median,
    trimmed_mean,
    update_norm,
)
from fedapps.wire import protocol, validation
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import LOGIT_BOUND, ArraySpec, Expectation, PredictionSpec, ReplyValidator
from strategies import resolve

InProcessGrid(1)  # Message() needs a task identity outside Flower's runtime

# --------------------------------------------------------------------------- robust aggregation, by hand


def test_cap_weights_by_hand():
    assert np.allclose(cap_weights([8, 1, 1], 0.5), [0.5, 0.25, 0.25])
    assert np.allclose(cap_weights([6, 3, 1], 0.5), [0.5, 0.375, 0.125])
    # rescaling the rest pushes the second above the cap too: both capped, the third gets what is left
    assert np.allclose(cap_weights([0.6, 0.35, 0.05], 0.4), [0.4, 0.4, 0.2])
    assert np.allclose(cap_weights([1, 1, 2], 1.0), [0.25, 0.25, 0.5])  # 1.0: no cap
    assert np.allclose(cap_weights([9, 1], 0.5), [0.5, 0.5])  # k·cap = 1: equal
    assert np.allclose(cap_weights([9, 1, 0], 0.3), [1 / 3] * 3)  # k·cap < 1: no weights satisfy it; equal
    with pytest.raises(ValueError):
        cap_weights([1, -1], 0.5)


def test_median_and_trimmed_mean_by_hand():
    stack = np.array([[1.0, 10.0], [2.0, -5.0], [100.0, 0.0], [3.0, 1.0], [4.0, 2.0]])
    assert np.allclose(coordinate_median(stack), [3.0, 1.0])
    # 5 clients, 0.2: one lowest and one highest dropped per coordinate: mean of {2,3,4} and {0,1,2}
    assert np.allclose(trimmed_mean(stack, 0.2), [3.0, 1.0])
    assert np.allclose(trimmed_mean(stack, 0.1), stack.mean(axis=0))  # floor(0.5) = 0 dropped
    assert np.allclose(coordinate_median(stack[:4]), [2.5, 0.5])  # even count: mean of the middle two
    with pytest.raises(ValueError):
        trimmed_mean(stack, 0.5)


def test_capped_mean_by_hand():
    stack = np.array([[0.0], [10.0], [20.0]])
    # weights 8:1:1 capped at 0.5 -> 0.5, 0.25, 0.25
    assert np.allclose(combine(stack, [8, 1, 1], AggregationRule("mean", max_weight_share=0.5)), [7.5])
    assert np.allclose(combine(stack, [8, 1, 1], AggregationRule("mean")), [3.0])


def _reply_message(node: int, arrays: dict[str, np.ndarray], n: int) -> Message:
    msg = protocol.Draft(node, protocol.Request(ops=("train",), round=1)).message()
    content = RecordDict({"arrays": protocol.arrays_record(arrays), "metrics": MetricRecord({"num-examples": n})})
    return Message(content, reply_to=msg)


@pytest.mark.parametrize(
    "method,flower", [("median", lambda: FedMedian()), ("trimmed-mean", lambda: FedTrimmedAvg(beta=0.2))]
)
def test_robust_rules_agree_with_flowers_strategies(method, flower):
    rng = np.random.default_rng(3)
    clients = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
        for _ in range(5)
    ]
    clients[2]["w"][0, 0] = 1e6  # an outlier
    replies = [ClientReply(100 + i, i, 10 * (i + 1), {}, arrays=a) for i, a in enumerate(clients)]
    ours = average_matching(replies, clients[0], AggregationRule(method, trim_fraction=0.2))
    theirs, _ = flower().aggregate_train(1, [_reply_message(100 + i, a, 10 * (i + 1)) for i, a in enumerate(clients)])
    for k in ("w", "b"):
        np.testing.assert_allclose(ours[k], theirs[k].numpy(), rtol=1e-6, atol=1e-6)
    assert abs(float(ours["w"][0, 0])) < 10  # the outlier does not move it


def test_aggregation_settings_are_validated_and_refused_where_they_do_not_apply():
    with pytest.raises(ConfigError, match="strategy.aggregation"):
        load_config(None, ["strategy.aggregation=mode"])
    with pytest.raises(ConfigError, match="strategy.trim_fraction"):
        load_config(None, ["strategy.trim_fraction=0.5"])
    with pytest.raises(ConfigError, match="strategy.max_weight_share"):
        load_config(None, ["strategy.max_weight_share=0"])
    base = ["data.source=digits", "data.num_clients=4", "model.name=mlp"]
    resolve(load_config(None, [*base, "strategy.name=ifca", "strategy.aggregation=median"]))
    with pytest.raises(ConfigError, match="strategy.aggregation"):
        resolve(load_config(None, [*base, "strategy.name=fedamp", "strategy.aggregation=median"]))


def test_fedavg_with_median_shrugs_off_a_plausible_but_huge_update(tmp_path):
    """A client sending finite, well-shaped but enormous weights passes validation; the median keeps it out."""
    from strategies.fedavg import FedAvg

    cfg = load_config(
        None,
        [
            "data.source=digits",
            "data.num_clients=3",
            "model.name=mlp",
            "rounds=1",
            "strategy.aggregation=median",
            "client.epochs=1",
        ],
    )
    s = FedAvg(cfg)
    good = [{k: v + 0.01 * i for k, v in s.global_arrays.items()} for i in range(2)]
    bad = {k: v + 1e6 for k, v in s.global_arrays.items()}
    replies = [ClientReply(100 + i, i, 100, {}, arrays=a) for i, a in enumerate([*good, bad])]
    s.aggregate(1, replies)
    assert max(float(np.abs(v).max()) for v in s.global_arrays.values()) < 100


# ------------------------------------------------------------------- robust aggregation: edges (found by `make mutate`)


def test_cap_weights_refuses_bad_weights_and_shares() -> None:
    """Each refusal on its own (the conditions are or-ed: a mutant that drops one must be caught by one case)."""
    for bad in ([2.0, -1.0], [1.0, np.nan], [np.inf, 1.0], [0.0, 0.0], [], [[1.0, 2.0]]):
        with pytest.raises(ValueError):
            cap_weights(bad, 0.5)
    with pytest.raises(ValueError):
        cap_weights([1.0, 1.0], 0.0)
    np.testing.assert_array_equal(cap_weights([5.0], 0.5), [1.0])  # one client: all the weight, cap or not
    assert cap_weights(np.array([1, 3], np.float32), 0.6).dtype == np.float64


def test_robust_rules_return_float64_and_trim_zero_is_the_mean() -> None:
    stack = np.array([[1.0, 4.0], [2.0, 0.0], [6.0, 5.0]], np.float32)
    assert coordinate_median(stack).dtype == np.float64 and trimmed_mean(stack, 0.2).dtype == np.float64
    assert combine(stack, [1, 1, 1], AggregationRule("median")).dtype == np.float64
    np.testing.assert_allclose(trimmed_mean(stack, 0.0), stack.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(combine(stack, [1, 1, 2], AggregationRule("mean")), [3.75, 3.5], rtol=1e-6)


def test_cap_weights_spreads_the_excess_over_zero_weight_clients():
    out = cap_weights([1.0, 0.0, 0.0], 0.5)
    np.testing.assert_allclose(out, [0.5, 0.25, 0.25])
    out = cap_weights([3.0, 1.0, 0.0, 0.0], 0.4)  # 0.75 capped to 0.4; 0.25 scaled to 0.6 -> capped; zeros share 0.2
    np.testing.assert_allclose(out, [0.4, 0.4, 0.1, 0.1])


# --------------------------------------------------------------------------- the validator, by hand


MODEL = {"w": np.zeros((3, 2), np.float32), "count": np.zeros((), np.int64)}


def validator(train=(50, 60), test=(10, 12)) -> ReplyValidator:
    return ReplyValidator(2, train, test, model_part=lambda part: MODEL, public_size=4, num_classes=3)


def request(node: int, ops=("train", "evaluate"), **config) -> protocol.Draft:
    """A round-1 message (its draft) to ``node`` whose settings are ``config``, spelled as the wire spells them
    (decoded into the request the server would have built)."""
    return protocol.Draft(node, protocol.Request.decode({"ops": list(ops), "round": 1, **config}))


def answer(to: protocol.Draft, cid: int, n: int = 50, metrics: dict | None = None, **records) -> Message:
    m = {"client-id": cid, "num-examples": n, "eval-acc": 0.5, "eval-loss": 1.0, "eval-n": 10, "eval-correct": 5}
    m.update(metrics or {})
    content = RecordDict({"metrics": MetricRecord({k: v for k, v in m.items() if v is not None})})
    for k, v in records.items():
        content[k] = v
    return Message(content, reply_to=to.message())


def test_identity_is_bound_to_the_node():
    v = validator()
    a, b = request(100), request(101)
    v.expect([a, b])
    out = v.validate_batch(1, [answer(a, 0), answer(b, 1, n=60)])
    assert [r.client_id for r in out.accepted] == [0, 1] and not out.rejections
    v.expect([a, b])
    out = v.validate_batch(1, [answer(a, 1, n=60), answer(b, 1, n=60)])  # node 100 claims node 101's client
    assert [r.node_id for r in out.accepted] == [101]
    assert "bound to client 0" in out.rejections[0].reason and out.rejections[0].client_id == 0


def test_duplicates_unsolicited_and_missing_replies():
    v = validator()
    a, b = request(100), request(101)
    v.expect([a, b])
    reply = answer(a, 0)
    out = v.validate_batch(1, [reply, reply, answer(request(102), 1)])
    assert len(out.accepted) == 1 and out.missing == 1
    assert ["duplicate" in r.reason for r in out.rejections] == [True, False]
    assert "no 'train' message was sent to node 102" in out.rejections[1].reason


def test_num_examples_is_bound_on_first_report_when_sizes_are_unknown():
    v = validator(train=None, test=None)
    a = request(100)
    v.expect([a])
    assert v.validate_batch(1, [answer(a, 0, n=10**6)]).accepted  # deployment: no bound known, the first value binds
    v.expect([a])
    out = v.validate_batch(2, [answer(a, 0, n=10**6 + 1)])
    assert not out.accepted and "differs from the 1000000" in out.rejections[0].reason


def eval_metrics(n: int, correct: int, tag: str = "eval") -> dict:
    return {f"{tag}-acc": correct / n if n else 0.0, f"{tag}-loss": 1.0, f"{tag}-n": n, f"{tag}-correct": correct}


def test_deployment_evaluation_sizes_must_equal_the_described_split():
    """data.source nodes: the describe phase binds each client's evaluation-split size (bind_accepted); a later
    <tag>-n that differs, in either direction, is rejected, however consistent its counts."""
    v = ReplyValidator(2, model_part=lambda part: MODEL, public_size=4, num_classes=3, eval_share=0.25)
    v.bound_examples.update({0: 50, 1: 60})
    v.bound_tests.update({0: 16, 1: 20})
    a = request(100)
    for n, correct, ok in [(16, 8, True), (10**12, 10**12, False), (15, 15, False), (17, 9, False)]:
        v.expect([a])
        out = v.validate_batch(1, [answer(a, 0, metrics=eval_metrics(n, correct))])
        assert bool(out.accepted) == ok, (n, out.rejections)
        if not ok:
            assert f"metric 'eval-n' = {n} differs from the 16 evaluation samples client 0 is bound to" in (
                out.rejections[0].reason
            )
    both = request(101, ops=("evaluate:deployed", "train", "evaluate:after"))  # a second tag must agree too
    v.expect([both])
    out = v.validate_batch(1, [answer(both, 1, 60, two_evaluations(20, 21))])
    assert not out.accepted and "'after-n' = 21 differs from the 20" in out.rejections[0].reason


def two_evaluations(deployed: int, after: int) -> dict:
    """Metrics of a reply with the deployed and after-training evaluations (and not answer()'s 'eval')."""
    return {
        **dict.fromkeys(eval_metrics(1, 0)),
        **eval_metrics(deployed, 5, "deployed"),
        **eval_metrics(after, 5, "after"),
    }


def test_an_undescribed_clients_evaluation_size_is_capped_by_the_split_then_bound():
    """A client the describe phase never saw: its first <tag>-n may not exceed what the split gives beside its
    num-examples (max_eval_count), then binds like num-examples."""
    v = ReplyValidator(2, model_part=lambda part: MODEL, public_size=4, num_classes=3, eval_share=0.25)
    a = request(100)
    cap = validation.max_eval_count(30, 0.25)
    assert cap == 10  # (0.25 · 30 + 0.5) / 0.75
    v.expect([a])
    out = v.validate_batch(1, [answer(a, 0, n=30, metrics=eval_metrics(cap + 1, 0))])
    assert not out.accepted and "'eval-n' = 11 exceeds the 10 evaluation samples the data split allows client 0" in (
        out.rejections[0].reason
    )
    v.expect([a])
    assert v.validate_batch(1, [answer(a, 0, n=30, metrics=eval_metrics(9, 3))]).accepted
    assert v.bound_tests == {0: 9} and v.bound_examples == {0: 30}
    v.expect([a])
    out = v.validate_batch(2, [answer(a, 0, n=30, metrics=eval_metrics(10, 3))])
    assert not out.accepted and "differs from the 9 evaluation samples" in out.rejections[0].reason
    both = request(101, ops=("evaluate:deployed", "train", "evaluate:after"))  # unbound: its evaluations must agree
    v.expect([both])
    out = v.validate_batch(1, [answer(both, 1, 30, two_evaluations(8, 9))])
    assert not out.accepted and "evaluations of one reply count different samples" in out.rejections[0].reason
    v.expect([both])
    assert v.validate_batch(1, [answer(both, 1, 30, two_evaluations(8, 8))]).accepted and v.bound_tests[1] == 8


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("evaluate_on", ["test", "validation"])
def test_max_eval_count_bounds_what_a_nodes_split_gives_and_is_reached(share, evaluate_on):
    """The cap against the split rule itself (fedapps.data.federation.split_node), for every node size up to 200 and
    skewed labels: never exceeded, and reached (the bound is the split's, not a looser one)."""
    from fedapps.data.federation import split_node

    test_fraction, validation_fraction = (share, 0.25) if evaluate_on == "test" else (0.25, share)
    reached = False
    for size in range(1, 201):
        y = np.arange(size) % 3 * (np.arange(size) % 7 > 1)
        train, held = split_node(y, test_fraction, validation_fraction, evaluate_on, seed=1, client_id=size)
        cap = validation.max_eval_count(train.size, share)
        assert held.size <= cap, (size, train.size, held.size, cap)
        reached |= held.size == cap
    assert reached


def test_bind_accepted_binds_the_described_evaluation_sizes_and_refuses_a_split_that_cannot_be():
    from fedapps.flower.describe import Description, NodeReport, bind_accepted, report_of

    def describe_reply(train: list[int], evaluation: list[int]) -> ClientReply:
        metrics = {
            "data-shape": [1, 8, 8],
            "data-classes": 3,
            "data-max-label": 2,
            "data-train-counts": train,
            "data-eval-counts": evaluation,
        }
        return ClientReply(node_id=100, client_id=0, num_examples=sum(train), metrics=metrics)

    report = report_of(describe_reply([10, 10, 10], [3, 3, 4]), eval_share=0.25)  # 10 of 40: the split's own
    with pytest.raises(ValueError, match="11 evaluation samples beside 30 training samples.*gives at most 10"):
        report_of(describe_reply([10, 10, 10], [3, 3, 5]), eval_share=0.25)
    source = ReplyValidator(2)
    source.bound_examples[0] = 30
    target = ReplyValidator(2, eval_share=0.25)
    bind_accepted(source, target, Description(3, (1, 8, 8), [report]))
    assert (target.node_client, target.bound_examples, target.bound_tests) == ({100: 0}, {0: 30}, {0: 10})
    simulation = ReplyValidator(2, train_sizes=[30, 30], test_sizes=[10, 10])  # the server's own sizes stay
    bind_accepted(source, simulation, Description(3, (1, 8, 8), [report]))
    assert simulation.bound_tests == {} and simulation.bound_examples == {}
    assert isinstance(report, NodeReport)


def test_arrays_and_predictions_are_checked_against_the_request():
    v = validator()
    a = request(
        100,
        ("train", "evaluate", "predict"),
        **{"return-arrays": True, "arrays.keys": "state", "predict.output": "logits", "public.fingerprint": "abc"},
    )
    exp = v.expect([a]) or v.expected["train"][100]
    assert exp.arrays == {"w": ArraySpec((3, 2), np.dtype(np.float32)), "count": ArraySpec((), np.dtype(np.int64))}
    assert exp.predictions == PredictionSpec(4, 3, "logits", "float32") and exp.fingerprint == "abc"
    arrays = protocol.arrays_record(MODEL)
    preds = protocol.arrays_record({"predictions": np.zeros((4, 3), np.float32)})
    info = ConfigRecord({"fingerprint": "abc"})
    assert v.validate_batch(1, [answer(a, 0, arrays=arrays, predictions=preds, info=info)]).accepted
    bad = [
        (
            dict(
                arrays=protocol.arrays_record({"w": np.zeros((2, 3), np.float32), "count": MODEL["count"]}),
                predictions=preds,
                info=info,
            ),
            "has shape",
        ),
        (
            dict(
                arrays=protocol.arrays_record({"w": MODEL["w"], "count": np.zeros((), np.float32)}),
                predictions=preds,
                info=info,
            ),
            "expected int64",
        ),
        (
            dict(
                arrays=arrays,
                predictions=protocol.arrays_record({"predictions": np.full((4, 3), 2e4, np.float32)}),
                info=info,
            ),
            "logits beyond",
        ),
        (dict(arrays=arrays, predictions=preds, info=ConfigRecord({"fingerprint": "abd"})), "public set mismatch"),
        (dict(arrays=arrays, predictions=preds), "public set mismatch"),
        (dict(predictions=preds, info=info), "lacks the model arrays"),
    ]
    for records, reason in bad:
        v.expect([a])
        out = v.validate_batch(1, [answer(a, 0, **records)])
        assert not out.accepted and reason in out.rejections[0].reason, (reason, out.rejections)


def test_undecodable_array_is_a_rejection_not_a_crash():
    v = validator()
    a = request(100, ("train", "evaluate"), **{"return-arrays": True})
    v.expect([a])
    garbage = ArrayRecord(
        {"w": Array(dtype="float32", shape=(3, 2), stype="numpy.ndarray", data=b"xx"), "count": Array(MODEL["count"])}
    )
    out = v.validate_batch(1, [answer(a, 0, arrays=garbage)])
    assert not out.accepted and "cannot be decoded" in out.rejections[0].reason


# --------------------------------------------------------------------------- property: never raises; bounds hold

numbers = st.one_of(st.integers(-(10**13), 10**13), st.floats(allow_nan=True, allow_infinity=True, width=64))
metric_values = st.one_of(numbers, st.lists(numbers, max_size=3))
metric_keys = st.sampled_from(
    [
        "client-id",
        "num-examples",
        "eval-acc",
        "eval-loss",
        "eval-n",
        "eval-correct",
        "after-acc",
        "x-acc",
        "train-loss",
        "junk",
    ]
)
dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.uint8, np.int32])
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def arrays_st(draw, names):
    out = {}
    for name in draw(st.lists(names, max_size=3, unique=True)):
        dtype, shape = draw(dtypes), draw(shapes)
        fill = draw(st.sampled_from([0.0, 1.0, -1.0, 0.25, 1e30, float("nan"), float("inf"), 5e4]))
        with np.errstate(all="ignore"):
            out[name] = np.full(shape, fill).astype(dtype)
    return out


def valid_reply(cid: int, output: str, want_arrays: bool) -> tuple[dict, dict]:
    """A reply that answers the request of :func:`property_request` (the starting point of the mutations)."""
    metrics = {
        "client-id": cid,
        "num-examples": 40,
        "eval-acc": 0.5,
        "eval-loss": 1.0,
        "eval-n": 10,
        "eval-correct": 5,
        "train-loss": 0.3,
        "t-train": 0.01,
    }
    if output == "hard":
        preds = np.array([0, 2, 1, 1], np.uint8)
    elif output == "logits":
        preds = np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3)
    else:
        preds = np.full((4, 3), 1 / 3, np.float32)
    records = {
        "predictions": protocol.arrays_record({"predictions": preds}),
        "info": ConfigRecord({"fingerprint": "abc"}),
    }
    if want_arrays:
        records["arrays"] = protocol.arrays_record({"w": np.ones((3, 2), np.float32), "count": np.array(3, np.int64)})
    return metrics, records


def property_request(output: str, want_arrays: bool) -> Message:
    return request(
        100,
        ("train", "evaluate", "predict"),
        **{
            "predict.output": "probs" if output == "hard" else output,
            "predict.encoding": "hard" if output == "hard" else "float32",
            "public.fingerprint": "abc",
            "return-arrays": want_arrays,
        },
    )


@st.composite
def replies_st(draw):
    """(output, want_arrays, metrics, records): a valid reply, then 0-3 random mutations of its contents."""
    output, want_arrays = draw(st.sampled_from(["probs", "logits", "hard"])), draw(st.booleans())
    metrics, records = valid_reply(draw(st.integers(0, 1)), output, want_arrays)
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["set", "drop", "arrays", "predictions", "info", "drop-record"]))
        if what == "set":
            metrics[draw(metric_keys)] = draw(metric_values)
        elif what == "drop" and metrics:
            metrics.pop(draw(st.sampled_from(sorted(metrics))))
        elif what == "arrays":
            records["arrays"] = protocol.arrays_record(draw(arrays_st(st.sampled_from(["w", "count", "z"]))))
        elif what == "predictions":
            records["predictions"] = protocol.arrays_record(draw(arrays_st(st.sampled_from(["predictions", "p"]))))
        elif what == "info":
            records["info"] = ConfigRecord({"fingerprint": draw(st.sampled_from(["abc", "zzz", ""]))})
        elif records:
            records.pop(draw(st.sampled_from(sorted(records))))
    return output, want_arrays, metrics, records


def _metric_record(metrics: dict) -> MetricRecord | None:
    clean = {}
    for k, v in metrics.items():
        if isinstance(v, list) and len({type(x) for x in v}) > 1:
            v = [float(x) for x in v]
        clean[k] = v
    try:
        return MetricRecord(clean)
    except Exception:  # noqa: BLE001 - Flower refuses some lists itself (e.g. ints beyond 64 bits): not a reply that can arrive
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies_st(), st.booleans())
@pytest.mark.heavy
def test_validator_never_raises_and_accepted_replies_respect_every_bound(reply, known_sizes):
    output, want_arrays, metrics, records = reply
    record = _metric_record(metrics)
    v = validator() if known_sizes else validator(train=None, test=None)
    msg = property_request(output, want_arrays)
    v.expect([msg])
    content = RecordDict({} if record is None else {"metrics": record})
    for k, r in records.items():
        content[k] = r
    out = v.validate_batch(1, [Message(content, reply_to=msg.message())])  # must not raise
    assert len(out.accepted) + len(out.rejections) == 1
    for r in out.accepted:
        m = r.metrics
        assert isinstance(r.client_id, int) and 0 <= r.client_id < 2
        assert isinstance(r.num_examples, int) and 0 < r.num_examples
        if known_sizes:
            assert r.num_examples <= (50, 60)[r.client_id] and m["eval-n"] <= (10, 12)[r.client_id]
        for value in m.values():
            assert all(math.isfinite(float(x)) for x in (value if isinstance(value, list) else [value]))
        assert 0.0 <= m["eval-acc"] <= 1.0 and 0 <= m["eval-correct"] <= m["eval-n"] and m["eval-loss"] >= 0
        assert not any(k.endswith("-acc") and k != "eval-acc" for k in m)
        assert r.info.get("fingerprint") == "abc"
        if want_arrays:
            assert set(r.arrays) == set(MODEL)
            # strict wire types: exactly the model's shapes and dtypes, whatever was sent
            assert all(r.arrays[k].shape == MODEL[k].shape and r.arrays[k].dtype == MODEL[k].dtype for k in MODEL)
            assert all(np.all(np.isfinite(a)) for a in r.arrays.values() if a.dtype.kind == "f")
        else:
            assert r.arrays is None
        p = r.predictions["predictions"]
        if output == "hard":
            assert p.shape == (4,) and p.dtype == np.uint8 and (p.size == 0 or p.max() < 3)
        else:
            assert p.shape == (4, 3) and p.dtype == np.float32 and np.all(np.isfinite(p))
            if output == "logits":
                assert np.abs(p).max() <= LOGIT_BOUND
            else:
                assert p.min() >= -1e-3 and np.allclose(p.sum(axis=1), 1, atol=1e-2)


@pytest.mark.parametrize("output", ["probs", "logits", "hard"])
@pytest.mark.parametrize("want_arrays", [False, True])
def test_the_unmutated_reply_of_the_property_test_is_accepted(output, want_arrays):
    v = validator()
    msg = property_request(output, want_arrays)
    v.expect([msg])
    metrics, records = valid_reply(1, output, want_arrays)
    content = RecordDict({"metrics": MetricRecord(metrics), **records})
    out = v.validate_batch(1, [Message(content, reply_to=msg.message())])
    assert len(out.accepted) == 1, out.rejections


def test_expectation_defaults_ask_for_nothing():
    exp = Expectation(node_id=1)
    assert exp.arrays is None and exp.predictions is None and exp.fingerprint is None and exp.eval_tags == ()


# --------------------------------------------------------------------------- strict wire types, by hand


def _wire(a: np.ndarray, **label) -> Array:
    """An Array of ``a``'s bytes under its own label, or under ``label`` (dtype / shape / stype / data) instead."""
    real = Array(protocol.contiguous(a))
    fields = {"dtype": real.dtype, "shape": tuple(real.shape), "stype": real.stype, "data": real.data, **label}
    return Array(**fields)


def arrays_reply(records: dict, transport: str | None = None) -> tuple[ReplyValidator, Message]:
    v = validator()
    config = {"return-arrays": True, **({protocol.TRANSPORT_KEY: transport} if transport else {})}
    a = request(100, ("train", "evaluate"), **config)
    v.expect([a])
    return v, answer(a, 0, arrays=ArrayRecord(records))


W = np.arange(6, dtype=np.float32).reshape(3, 2)


@pytest.mark.parametrize(
    "w, reason",
    [
        (W.astype(np.float64), "array 'w' has dtype float64, expected float32"),
        (W.astype(np.longdouble), f"array 'w' has dtype {np.dtype(np.longdouble)}, expected float32"),
        (W.astype(np.dtype(np.float32).newbyteorder(">")), "array 'w' has dtype >f4, expected float32"),
        (W.astype(np.float16), "array 'w' has dtype float16, expected float32"),  # no float16 transport asked for
        (np.full((3, 2), 1e300), "has dtype float64"),  # finite in float64, inf in float32: never decoded
        (W.astype(np.int32), "has dtype int32, expected float32"),
    ],
)
def test_an_array_of_another_dtype_is_rejected_before_decoding(w, reason):
    v, reply = arrays_reply({"w": _wire(w), "count": _wire(MODEL["count"])})
    out = v.validate_batch(1, [reply])
    assert not out.accepted and reason in out.rejections[0].reason, out.rejections


def test_the_label_and_the_bytes_must_agree():
    count = _wire(MODEL["count"])
    f64 = Array(W.astype(np.float64))
    cases = [
        (_wire(W, dtype="float32", data=f64.data), "cannot be decoded"),  # float64 bytes labelled float32
        (_wire(W, data=Array(W.T.copy()).data), "cannot be decoded"),  # (2, 3) bytes labelled (3, 2)
        (_wire(W, data=Array(W).data + b"\0" * 4096), "cannot be decoded"),  # trailing bytes
        (_wire(W, data=Array(W).data[:-4]), "cannot be decoded"),  # a value short
        (_wire(W, data=Array(np.asfortranarray(np.ones((3, 2), np.float32))).data), "Fortran order"),
        (_wire(W, stype="torch.Tensor"), "serialisation torch.Tensor"),
        (_wire(W, shape=(6,)), "has shape (6,), expected (3, 2)"),
    ]
    for w, reason in cases:
        v, reply = arrays_reply({"w": w, "count": count})
        out = v.validate_batch(1, [reply])
        assert not out.accepted and reason in out.rejections[0].reason, (reason, out.rejections)


def test_names_and_count_are_checked_before_any_array_is_decoded(monkeypatch):
    decoded = []
    original = validation.WireArray.decode
    monkeypatch.setattr(validation.WireArray, "decode", lambda self: decoded.append(self.shape) or original(self))
    v, reply = arrays_reply({"w": _wire(W), "count": _wire(MODEL["count"]), "extra": _wire(W)})
    out = v.validate_batch(1, [reply])
    assert not out.accepted and "do not match the request (3 given, 2 expected)" in out.rejections[0].reason
    assert decoded == []
    v, reply = arrays_reply({"w": _wire(W), "count": _wire(MODEL["count"])})  # the same decoding counted
    assert v.validate_batch(1, [reply]).accepted and sorted(decoded) == [(), (3, 2)]


def test_float16_transport_accepts_float16_and_the_models_dtype_only():
    count = _wire(MODEL["count"])
    for w in (W.astype(np.float16), W):  # float16, or float32 for an array beyond float16's range
        v, reply = arrays_reply({"w": _wire(w), "count": count}, transport="float16")
        [r] = v.validate_batch(1, [reply]).accepted
        assert r.arrays["w"].dtype == np.float32 and np.array_equal(r.arrays["w"], W)
    v, reply = arrays_reply({"w": _wire(W.astype(np.float64)), "count": count}, transport="float16")
    assert "expected float16 or float32" in v.validate_batch(1, [reply]).rejections[0].reason


def test_integer_buffers_and_predictions_must_have_their_exact_type():
    v, reply = arrays_reply({"w": _wire(W), "count": _wire(np.array(3, np.int32))})
    assert "array 'count' has dtype int32, expected int64" in v.validate_batch(1, [reply]).rejections[0].reason
    msg = property_request("hard", False)
    for preds, reason in [
        (np.array([0, 2, 1, 1], np.uint16), "has dtype uint16, expected uint8"),
        (np.full((4, 3), 1 / 3), "has dtype float64, expected float32"),
    ]:
        if preds.dtype.kind == "f":
            msg = property_request("probs", False)
        v = validator()
        v.expect([msg])
        metrics, records = valid_reply(0, "hard" if preds.dtype.kind == "u" else "probs", False)
        records["predictions"] = protocol.arrays_record({"predictions": preds})
        out = v.validate_batch(
            1, [Message(RecordDict({"metrics": MetricRecord(metrics), **records}), reply_to=msg.message())]
        )
        assert not out.accepted and reason in out.rejections[0].reason, out.rejections


def test_accepted_arrays_are_writable_copies_in_the_models_dtype():
    v, reply = arrays_reply({"w": _wire(W), "count": _wire(MODEL["count"])})
    [r] = v.validate_batch(1, [reply]).accepted
    assert r.arrays["w"].flags.writeable and r.arrays["w"].dtype == np.float32 and r.arrays["count"].shape == ()
    r.arrays["w"] += 1  # a strategy may update them in place


# --------------------------------------------------------------------------- metric ranges


@pytest.mark.parametrize(
    "key, value, reason",
    [
        ("train-loss", -2e299, "'train-loss' = -2e+299 is outside [-1e+09, 1e+09]"),
        ("train-loss", 2e9, "is outside"),
        ("t-total", -1.0, "'t-total' = -1.0 is outside [0, 604800]"),
        ("t-train", 1e12, "'t-train' = 1000000000000.0 is outside"),
        ("junk", 1e16, "'junk' = 1e+16 is outside"),
        ("junk", [0.5] * 5000, "'junk' is a list of 5000 values; at most 4096"),
    ],
)
def test_losses_timings_and_lists_are_range_checked(key, value, reason):
    v = validator()
    a = request(100)
    v.expect([a])
    out = v.validate_batch(1, [answer(a, 0, metrics={key: value})])
    assert not out.accepted and reason in out.rejections[0].reason, out.rejections
    v.expect([a])
    ok = {"train-loss": 0.7, "t-total": 1.5, "t-train": 0.2, "junk": [0.5] * 10}[key]
    assert v.validate_batch(1, [answer(a, 0, metrics={key: ok})]).accepted


def test_a_huge_list_is_refused_by_its_length_before_its_values_are_read():
    class Unreadable(list):
        def __iter__(self):
            raise AssertionError("the values of an over-long list were read")

    with pytest.raises(protocol.ReplyError, match="is a list of 100000 values"):
        validation.check_metrics({"x": Unreadable([0.0] * 100000)}, max_list=4096)
    assert validator().max_list == 4096  # 2 clients, 3 classes: the floor
    assert ReplyValidator(10000, num_classes=10).max_list == 10000  # a per-client list fits
    assert ReplyValidator(3).max_list == validation.LIST_UNKNOWN  # classes not known yet (describe phase)


def flood(lists: int, length: int) -> dict:
    """A reply's metrics with ``lists`` extra list metrics of ``length`` floats (answer()'s own 6 metrics beside)."""
    return {f"flood-{i}": [0.5] * length for i in range(lists)}


def test_a_metric_flood_is_refused_before_any_value_is_read(monkeypatch):
    """1,018 lists of 4,096 floats (1,024 metrics with the reply's own: every count and length limit met) cost
    seconds of per-value checks; the reply's budget (1,024 numbers and METRIC_LISTS full lists) refuses it on
    lengths alone: the per-value check, the evaluations and any decoding never run."""
    v = validator()
    a = request(100, ops=("train", "evaluate"))
    called: list[str] = []
    for name in ("check_metrics", "check_evaluations", "check_info"):
        monkeypatch.setattr(validation, name, lambda *args, name=name, **kw: called.append(name))
    monkeypatch.setattr(validation.WireArray, "decode", lambda self: called.append("decode"))
    v.expect([a])
    out = v.validate_batch(1, [answer(a, 0, metrics=flood(1018, 4096))])
    assert not out.accepted and called == []
    budget = validation.MAX_METRICS + validation.METRIC_LISTS * 4096
    assert (
        f"reply carries 4,169,734 metric values (1024 metrics, 1018 of them lists); at most {budget:,} are expected"
        in out.rejections[0].reason
    )
    v.expect([a])  # within the budget: the values are read (and, here, the stubs are called)
    assert v.validate_batch(1, [answer(a, 0, metrics=flood(validation.METRIC_LISTS, 4096))]).accepted
    assert called == ["check_metrics", "check_evaluations"]


def test_the_reply_budget_is_what_the_message_asked_for():
    """reply_budget: the arrays asked for at their widest wire dtype with an .npy header each, predictions of the
    rows and classes asked for, metric and info budgets; check_bytes refuses a reply above it, and a reply of
    unknown prediction rows is bounded by its values only."""
    exp = Expectation(
        node_id=1,
        arrays={"w": ArraySpec((3, 2), np.dtype(np.float32)), "count": ArraySpec((), np.dtype(np.int64))},
        predictions=PredictionSpec(rows=4, classes=3, encoding="float16"),
        transport="float16",
    )
    b = validation.reply_budget(exp, max_list=100)
    values = validation.MAX_METRICS + validation.METRIC_LISTS * 100
    info = 8 * validation.INFO_MAX_KEYS * validation.INFO_MAX_SIZE
    header = validation.NPY_MAX_HEADER
    assert b.values == values
    assert b.nbytes == 8 * values + info + (6 * 4 + header) + (1 * 8 + header) + (4 * 3 * 2 + header)
    assert b.entries["arrays"] == 2 * 2 + validation.ARRAY_SLACK and b.entries["metrics"] == validation.MAX_METRICS
    content = RecordDict({"metrics": MetricRecord({"client-id": 0, "junk": [0.5] * 100})})
    validation.check_bytes(content, b)  # 808 bytes
    with pytest.raises(protocol.ReplyError, match="reply carries 808 bytes; at most 800 are expected"):
        validation.check_bytes(content, validation.ReplyBudget(b.values, 800, b.entries))
    unknown_rows = validation.reply_budget(Expectation(node_id=1, predictions=PredictionSpec(None, 3)), 100)
    assert unknown_rows.nbytes is None and unknown_rows.values == values


def test_a_large_info_record_is_rejected():
    v = validator()
    a = request(100)
    v.expect([a])
    out = v.validate_batch(1, [answer(a, 0, info=ConfigRecord({"arch": "x" * 5000}))])
    assert not out.accepted and "'info' entry 'arch' holds 5000" in out.rejections[0].reason


# --------------------------------------------------------------------------- update-norm clipping, trim check


def test_update_norm_and_clip_by_hand():
    ref = {"w": np.zeros(2, np.float32), "b": np.array([1.0], np.float32), "n": np.array(7, np.int64)}
    # update (3, 0) on w and (4) on b: norm 5 (integer arrays are not part of it)
    got = {"w": np.array([3.0, 0.0], np.float32), "b": np.array([5.0], np.float32), "n": np.array(9, np.int64)}
    assert update_norm(got, ref) == pytest.approx(5.0)
    clipped, norm = clip_update(got, ref, 1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(clipped["w"], [0.6, 0.0], rtol=1e-6)  # ref + (1/5)·update
    np.testing.assert_allclose(clipped["b"], [1.8], rtol=1e-6)
    assert clipped["n"] == 9 and clipped["w"].dtype == np.float32
    assert update_norm(clipped, ref) == pytest.approx(1.0, rel=1e-6)
    same, _ = clip_update(got, ref, 10.0)  # within the norm: unchanged
    assert all(np.array_equal(same[k], got[k]) for k in got)
    off, _ = clip_update(got, ref, 0.0)  # 0 = off
    assert all(np.array_equal(off[k], got[k]) for k in got)


def test_clipped_mean_bounds_one_huge_update_by_hand():
    current = {"w": np.zeros(2, np.float32)}
    replies = [
        ClientReply(100, 0, 10, {}, arrays={"w": np.array([1.0, 0.0], np.float32)}),
        ClientReply(101, 1, 10, {}, arrays={"w": np.array([0.0, 1e6], np.float32)}),
    ]
    plain = average_matching(replies, current)
    assert plain["w"][1] == pytest.approx(5e5)
    # clip 2: the first update (norm 1) stays, the second becomes (0, 2): mean (0.5, 1)
    clipped = average_matching(replies, current, AggregationRule("mean", clip_update_norm=2.0))
    np.testing.assert_allclose(clipped["w"], [0.5, 1.0], rtol=1e-6)
    # with the median (2 clients: the mean of the two) the clipped updates are combined the same way
    np.testing.assert_allclose(
        average_matching(replies, current, AggregationRule("median", clip_update_norm=2.0))["w"], [0.5, 1.0], rtol=1e-6
    )


def test_the_average_keeps_the_models_dtypes():
    current = {"w": np.zeros(2, np.float32), "n": np.array(0, np.int64)}
    replies = [ClientReply(100, 0, 10, {}, arrays={"w": np.ones(2, np.float64), "n": np.array(3, np.int32)})]
    for rule in (None, AggregationRule("median")):
        out = average_matching(replies, current, rule)
        assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64


def test_clip_update_norm_is_validated_and_refused_where_it_does_not_apply():
    with pytest.raises(ConfigError, match="strategy.clip_update_norm"):
        load_config(None, ["strategy.clip_update_norm=-1"])
    base = ["data.source=digits", "data.num_clients=4", "model.name=mlp", "strategy.clip_update_norm=5"]
    assert AggregationRule.from_config(load_config(None, base).strategy).clip_update_norm == 5.0
    resolve(load_config(None, [*base, "strategy.name=fedavg"]))
    with pytest.raises(ConfigError, match="strategy.clip_update_norm"):
        resolve(load_config(None, [*base, "strategy.name=cwfedavg"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.num_clients=5", "strategy.trim_fraction=0.1"],
            (
                "'strategy.trim_fraction: 0.1' trims no client from the cohort of 5 clients per round "
                "(data.num_clients=5, strategy.fraction=1) (floor(0.1·5) = 0: the plain unweighted mean); "
                "set strategy.trim_fraction to at least 0.2"
            ),
        ),
        (["data.num_clients=20", "strategy.fraction=0.3", "strategy.trim_fraction=0.1"], "at least 0.167"),
        (["data.num_clients=2", "strategy.trim_fraction=0.4"], "trimming one at each end needs at least 3 clients"),
    ],
)
def test_a_trimmed_mean_that_trims_nobody_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["strategy.aggregation=trimmed-mean", *overrides])


def test_the_smallest_trim_named_trims_exactly_one_client():
    for k in range(3, 200):
        f = smallest_trim(k)
        assert trimmed_per_side(f, k) == 1 and trimmed_per_side(f - 0.001, k) == 0, k
        assert trimmed_mean(np.arange(k, dtype=float)[:, None], f)[0] == pytest.approx((k - 1) / 2)
    load_config(None, ["strategy.aggregation=trimmed-mean", "data.num_clients=10", "strategy.trim_fraction=0.1"])


def test_the_one_prediction_check_at_its_bounds():
    """validation.prediction_problem is the only check of predictions (every pseudo-label strategy's): hard labels
    in [0, classes) — the abstain marker ``classes`` is the server's only —, logits within ±LOGIT_BOUND,
    probabilities on the simplex within the tolerances, the shape the message asked for."""
    check = validation.prediction_problem
    hard = PredictionSpec(rows=5, classes=10, encoding="hard")
    assert check(np.full(5, 9, np.uint8), hard) is None
    assert check(np.full(5, 10, np.uint8), hard) == "hard label 10 out of range [0, 10)"
    assert "dtype int64" in check(np.zeros(5, np.int64), hard)
    assert "shape (4,)" in check(np.zeros(4, np.uint8), hard)
    assert check(np.zeros(7, np.uint8), PredictionSpec(rows=None, classes=10, encoding="hard")) is None
    logits = PredictionSpec(rows=5, classes=10, output="logits")
    edge = np.zeros((5, 10), np.float32)
    edge[0, 0] = -LOGIT_BOUND
    assert check(edge, logits) is None
    edge[0, 0] = np.nextafter(np.float32(-LOGIT_BOUND), np.float32(-np.inf))
    assert "logits beyond" in check(edge, logits)
    edge[0, 0] = np.nan
    assert check(edge, logits) == "scores contain non-finite values"
    assert "shape (4, 10)" in check(np.zeros((4, 10), np.float32), logits)
    probs = PredictionSpec(rows=5, classes=10, output="probs")
    rows = np.full((5, 10), 0.1, np.float32)
    assert check(rows, probs) is None
    near = rows.copy()
    near[0, 0] += 0.009  # row sum 1.009: within PROB_TOLERANCE
    near[1, :2] = [-0.0009, 0.2009]  # an entry just above -PROB_NEGATIVE
    assert check(near, probs) is None
    for row, values in ((0, {0: 0.1 + 0.011}), (1, {0: -0.0011, 1: 0.2011})):
        bad = rows.copy()
        for col, v in values.items():
            bad[row, col] = v
        assert "not probability vectors" in check(bad, probs), (row, values)
    assert "not probability vectors" in check(np.zeros((5, 10), np.float32), probs)
