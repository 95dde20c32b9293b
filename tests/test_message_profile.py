"""Where a client's time on a message goes: the phase clock, the profile every reply carries, its check by the reply
validator, its columns in rounds.csv and the server's steps beside them; and what was cut from each message: the .npy
codec (Flower's own bytes, each header made and read once) and a round's settings record shared by its messages."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, Message, MetricRecord

from fedapps.client import ops, phases
from fedapps.client.phases import PhaseClock, measuring
from fedapps.client.worker import Worker
from fedapps.reporting.results import profile_columns, round_row
from fedapps.server.rounds import RoundLog, StepClock
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply, MessageProfile, ReplyError
from fedapps.wire.validation import ReplyValidator, parse_reply
from test_ops_worker import worker_message


def busy(seconds: float) -> None:
    """Spend ``seconds`` of wall time (sleeping: a phase is wall time, not CPU time)."""
    time.sleep(seconds)


def test_nested_phases_are_timed_exclusively_and_sum_to_at_most_the_wall():
    clock = PhaseClock()
    with clock.phase("train"):
        busy(0.02)
        with clock.phase("model"):  # a model built inside the training: charged to the model only
            busy(0.03)
        busy(0.02)
    busy(0.02)  # in no phase: the wall has it, no phase does
    profile = clock.profile()
    assert 0.03 <= profile.model < 0.03 + 0.02
    assert 0.04 <= profile.train < 0.04 + 0.02
    assert profile.evaluate == profile.decoding == 0.0
    assert sum(profile.phases().values()) <= profile.wall
    assert profile.wall >= 0.09


def test_ops_charge_the_clock_of_the_message_served_on_the_thread_only():
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    clock = PhaseClock()
    with measuring(clock):
        ops.train(model, x, y, ops.OptimSettings(epochs=2, batch_size=8))
        ops.evaluate(model, x, y)  # its forward passes count as evaluation, not as predictions
    profile = clock.profile()
    assert profile.train > 0 and profile.evaluate > 0 and profile.predict == 0.0
    with measuring(clock):
        ops.predict(model, x)
    assert clock.profile().predict > 0
    before = clock.profile()
    ops.train(model, x, y, ops.OptimSettings(epochs=1, batch_size=8))  # no message measured: nothing is charged
    assert clock.profile().train == before.train


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'sleep'"):
        phases.timed("sleep")
    with pytest.raises(ValueError, match="unknown phase"), PhaseClock().phase("sleep"):
        pass


def test_a_reply_carries_non_negative_phases_that_sum_to_at_most_its_wall():
    grid, msg = worker_message(
        ["evaluate", "train", "evaluate:after", "predict"],
        returns=protocol.Return(arrays=True),
        load=protocol.Load(into_model=False),
    )
    before = time.perf_counter()
    reply = Worker(msg, grid.contexts[100]).run()
    outside = time.perf_counter() - before
    profile = parse_reply(reply).profile
    assert profile is not None
    spent = profile.phases()
    assert all(v >= 0 for v in spent.values())
    assert sum(spent.values()) <= profile.wall <= outside
    for phase in ("decoding", "data", "model", "train", "evaluate", "predict", "encoding"):
        assert spent[phase] > 0, phase  # each step of this message was charged to its phase
    assert spent["train"] > spent["decoding"]
    # the reply's t-total (until the reply's arrays) is within the profile's wall
    assert reply.content.metric_records[protocol.METRICS][protocol.TOTAL_TIME] <= profile.wall


def test_the_profile_is_left_out_of_the_byte_counts():
    content = protocol.Reply(1, 10, {"eval-acc": 0.5}).encode()
    without = protocol.record_nbytes(content)
    content[protocol.PROFILE] = MessageProfile(train=1.0, wall=2.0).encode()
    assert protocol.record_nbytes(content) == without


def test_a_profile_survives_encode_and_decode_and_a_malformed_one_is_refused():
    sent = MessageProfile(decoding=0.1, data=0.2, model=0.3, train=1.5, keep=0.05, encoding=0.01, wall=2.5)
    assert MessageProfile.decode(sent.encode()) == sent
    assert MessageProfile.decode(MetricRecord({})) == MessageProfile()  # phases not reported: none spent
    for record, named in (
        ({protocol.PROFILE_FIELDS["train"]: -1.0}, protocol.PROFILE_FIELDS["train"]),
        ({"sleep-seconds": 1.0}, "unknown entry"),
        ({protocol.PROFILE_FIELDS["wall"]: [1.0, 2.0]}, protocol.PROFILE_FIELDS["wall"]),
    ):
        with pytest.raises(protocol.MessageError, match=named):
            MessageProfile.decode(MetricRecord(record))


def reply_with_profile(msg: Message, profile: MetricRecord | None) -> Message:
    content = protocol.Reply(0, 40, {"train-loss": 0.5}).encode()
    if profile is not None:
        content[protocol.PROFILE] = profile
    return Message(content, reply_to=msg)


def test_the_validator_accepts_a_profile_and_rejects_a_malformed_one():
    validator = ReplyValidator(2, (50, 60), (10, 12), model_part=lambda part: {}, public_size=4, num_classes=3)
    msg = protocol.Draft(100, protocol.Request(ops=("train",), round=1))
    good = MessageProfile(train=0.5, wall=0.75)
    for profile, accepted in (
        (good.encode(), good),
        (None, None),
        (MetricRecord({protocol.PROFILE_FIELDS["train"]: 1e9}), "outside"),
        (MetricRecord({protocol.PROFILE_FIELDS["train"]: -0.5}), "must be a finite number of seconds"),
    ):
        validator.expect([msg])
        out = validator.validate_batch(1, [reply_with_profile(msg.message(), profile)])
        if isinstance(accepted, str):
            assert not out.accepted and accepted in out.rejections[0].reason, out.rejections
        else:
            assert [r.profile for r in out.accepted] == [accepted]
    with pytest.raises(ReplyError, match="must be a MetricRecord"):
        content = protocol.Reply(0, 40).encode()
        content[protocol.PROFILE] = protocol.ReplyInfo("mlp").encode()
        protocol.profile_of(content)


def test_rounds_csv_sums_the_replies_profiles_per_phase():
    profiles = [MessageProfile(train=1.0, model=0.25, wall=2.0), MessageProfile(train=0.5, encoding=0.125, wall=1.0)]
    replies = [
        ClientReply(node_id=i, client_id=i, num_examples=5, metrics={}, profile=p) for i, p in enumerate(profiles)
    ]
    replies.append(ClientReply(node_id=9, client_id=2, num_examples=5, metrics={}))  # no profile: adds nothing
    row = round_row(RoundLog(1, replies, 0, 0), num_clients=3)
    assert row["client_train_seconds"] == 1.5
    assert row["client_model_seconds"] == 0.25
    assert row["client_encoding_seconds"] == 0.125
    assert row["client_wall_seconds"] == 3.0
    assert row["client_predict_seconds"] == 0.0
    columns = [k for k in row if k.startswith("client_") and k != "client_seconds"]
    assert columns == [f"client_{f.name}_seconds" for f in dataclasses.fields(MessageProfile)]
    assert profile_columns([]) == dict.fromkeys(columns, 0.0)


# --------------------------------------------------------------------------- the .npy codec


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.float16(1.5) * np.ones((2, 2, 1), np.float16),
    np.array(7, np.int64),  # 0-d: BatchNorm's num_batches_tracked
    np.zeros((0, 5), np.float32),
    np.arange(6, dtype=">f4").reshape(2, 3),  # another byte order: its own header
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),  # F order: sent in C order
    np.arange(10, dtype=np.uint8)[::2],  # a strided view
]


@pytest.mark.parametrize("values", ARRAYS, ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_npy_arrays_are_flowers_own_bytes_and_read_back_as_flower_reads_them(values):
    for _ in range(2):  # the first call takes the header from np.save, the second from the cache
        ours, flowers = protocol.npy_array(values), Array(np.ascontiguousarray(values) if values.ndim else values)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (
            flowers.dtype,
            flowers.shape,
            flowers.stype,
            flowers.data,
        )
        got, expected = protocol.npy_values(ours), flowers.numpy()
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.flags.writeable
        np.testing.assert_array_equal(got, expected)


def test_npy_values_leaves_what_it_does_not_read_to_flower():
    fortran = Array(np.asfortranarray(np.arange(6.0).reshape(2, 3)))  # Flower's own F-order bytes
    np.testing.assert_array_equal(protocol.npy_values(fortran), np.arange(6.0).reshape(2, 3))
    truncated = protocol.npy_array(np.ones(4, np.float32)).data[:-4]
    short = Array(dtype="float32", shape=(4,), stype=protocol.NPY_STYPE, data=truncated)
    with pytest.raises(ValueError):  # numpy's own refusal of a truncated body
        protocol.npy_values(short)
    with pytest.raises(ValueError, match="do not start with an .npy header"):
        protocol.npy_header(b"not an array at all")


def test_the_servers_steps_of_a_round_are_timed_one_after_another_into_rounds_csv():
    clock = StepClock()
    time.sleep(0.02)
    clock.done("messages")
    time.sleep(0.03)
    clock.done("exchange")
    clock.done("replies")
    assert list(clock.seconds) == ["messages", "exchange", "replies"]
    assert 0.02 <= clock.seconds["messages"] < 0.03 + 0.02 and 0.03 <= clock.seconds["exchange"] < 0.05
    assert clock.seconds["replies"] < 0.01
    row = round_row(RoundLog(2, [], 0, 0, steps={"messages": 0.25, "exchange": 1.5}), num_clients=1)
    assert (row["round_messages_seconds"], row["round_exchange_seconds"]) == (0.25, 1.5)


# --------------------------------------------------------------------------- a round's shared settings


def test_a_batchs_shared_request_and_arrays_are_encoded_once():
    """build_messages: drafts sharing a request (or arrays) share one encoded record; equal settings in another
    object are encoded apart; a built message is never rewritten."""
    request = protocol.Request(ops=("train",), round=3)
    arrays = {"w": np.ones(3, np.float32)}
    other = protocol.Request(ops=("train",), round=3)  # equal settings, another object
    first, second, third = protocol.build_messages(
        [
            protocol.Draft(100, request, arrays=arrays),
            protocol.Draft(101, request, arrays=arrays),
            protocol.Draft(102, other),
        ]
    )
    assert first.content[protocol.CONFIG] is second.content[protocol.CONFIG]  # one record for the round's messages
    assert first.content[protocol.ARRAYS] is second.content[protocol.ARRAYS]
    assert third.content[protocol.CONFIG] is not first.content[protocol.CONFIG]
    assert protocol.request_of(third) == protocol.request_of(first) == request
