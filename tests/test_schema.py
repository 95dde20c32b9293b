"""The message schema (fedapps/wire/protocol.py): the wire format pinned key by key, every dataclass through encode
and decode, and decode refusing malformed messages with an error that names the key.

This module spells the wire's keys as literals on purpose (tests/test_architecture.py rule (f) exempts it): a
constant of the schema that changed its value would change the wire, and a client of another version would no
longer understand the server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedapps.config import OptimSettings, PrivacyConfig
from fedapps.flower.inprocess import InProcessGrid
from fedapps.wire import protocol
from fedapps.wire.protocol import (
    Bookkeeping,
    Evaluation,
    Keep,
    Load,
    MessageError,
    MessageProfile,
    ModelSpec,
    Privacy,
    PublicSet,
    Reply,
    ReplyInfo,
    Request,
    Return,
    Section,
    Setup,
    Targets,
    Training,
)
from fedapps.wire.validation import parse_reply

# a request with every part set (and an algorithm's own section), and the config record it must be on the wire
FULL = Request(
    ops=("select-model", "evaluate:deployed", "train", "predict", "evaluate:after"),
    round=3,
    setup=Setup(
        data={"source": "digits", "num_clients": 4, "synthetic_shape": [3, 32, 32]},
        model=ModelSpec("mlp", 7, ("mlp", "cnn")),
        client={"epochs": 2, "lr": 0.05, "device": "cpu"},
    ),
    load=Load(into_model=False, multi=True),
    keep=Keep(persist=False, save=False),
    returns=Return(arrays=True, part="params"),
    transport="float16",
    evaluation=Evaluation("cnn"),
    training=Training(
        0.2,
        {
            "train": Section(epochs=5, freeze="head", extra={"prox_mu": 0.1}),
            "train:head": Section(lr=0.5, drop_last=False),
            "distill": Section(
                batch_size=32,
                optimizer="adam",
                loss="kl",
                weighting="label-free",
                clip_norm=1.0,
                extra={"rb_lambda": 0.5},
            ),
            "pfedck": Section(extra={"alpha": 1.0}),
        },
    ),
    public=PublicSet("0123abcd", "logits", "hard"),
    bookkeeping=Bookkeeping("/runs/x/client-state", "tok"),
    privacy=Privacy("sample", 1.1, 1.0, 1e-5, 8.0, True),
)
FULL_WIRE = {
    "ops": ["select-model", "evaluate:deployed", "train", "predict", "evaluate:after"],
    "round": 3,
    "data.source": "digits",
    "data.num_clients": 4,
    "data.synthetic_shape": [3, 32, 32],
    "model.name": "mlp",
    "model.seed": 7,
    "model.per_client": ["mlp", "cnn"],
    "client.epochs": 2,
    "client.lr": 0.05,
    "client.device": "cpu",
    "state-dir": "/runs/x/client-state",
    "state-run": "tok",
    "load-arrays": False,
    "arrays.multi": True,
    "return-arrays": True,
    "arrays.keys": "params",
    "persist-model": False,
    "save-model": False,
    "arrays.transport": "float16",
    "holdout-fraction": 0.2,
    "received.model": "cnn",
    "public.fingerprint": "0123abcd",
    "predict.output": "logits",
    "predict.encoding": "hard",
    "train.epochs": 5,
    "train.freeze": "head",
    "train.prox_mu": 0.1,
    "train:head.lr": 0.5,
    "train:head.drop_last": False,
    "distill.batch_size": 32,
    "distill.optimizer": "adam",
    "distill.clip_norm": 1.0,
    "distill.loss": "kl",
    "distill.weighting": "label-free",
    "distill.rb_lambda": 0.5,
    "pfedck.alpha": 1.0,
    "privacy.mode": "sample",
    "privacy.noise_multiplier": 1.1,
    "privacy.max_grad_norm": 1.0,
    "privacy.delta": 1e-5,
    "privacy.epsilon_budget": 8.0,
    "privacy.reproducible_noise": True,
}


@pytest.fixture(autouse=True)
def _flower_identity() -> None:
    """Message() needs a task identity outside Flower's runtime; the in-process grid sets one."""
    InProcessGrid(1)


# --------------------------------------------------------------------------- the wire format, pinned


def test_a_full_request_is_on_the_wire_key_by_key():
    assert dict(FULL.encode()) == FULL_WIRE
    assert Request.decode(ConfigRecord(FULL_WIRE)) == FULL


def test_unset_fields_are_not_sent_and_explicit_ones_are():
    assert dict(Request(ops=(), round=1).encode()) == {"ops": [], "round": 1}
    said = Request(
        ops=("train",), round=2, load=Load(into_model=False), returns=Return(arrays=False), keep=Keep(persist=True)
    )
    assert dict(said.encode()) == {
        "ops": ["train"],
        "round": 2,
        "load-arrays": False,
        "return-arrays": False,
        "persist-model": True,
    }


def test_the_targets_record_and_a_reply_are_on_the_wire_name_by_name():
    values, rows = np.zeros((2, 3), np.float32), np.array([4, 9], np.uint8)
    assert list(Targets(values, rows, rows).encode().keys()) == ["targets", "distill-indices", "predict-indices"]
    assert list(Targets(None, rows, rows).encode().keys()) == ["predict-indices"]  # no targets: no distill rows
    assert Targets().encode() is None
    content = Reply(
        3,
        40,
        {"eval-acc": 0.5},
        arrays=ArrayRecord(),
        predictions=np.zeros(2, np.uint8),
        info=ReplyInfo("mlp", "0123abcd"),
        profile=MessageProfile(decoding=0.5, train=2.0, wall=4.0),
    ).encode()
    assert list(content.keys()) == ["predictions", "arrays", "metrics", "info", "profile"]
    assert list(content["predictions"].keys()) == ["predictions"]
    assert dict(content["metrics"]) == {"client-id": 3, "num-examples": 40, "eval-acc": 0.5}
    assert dict(content["info"]) == {"arch": "mlp", "fingerprint": "0123abcd"}
    assert dict(content["profile"]) == {  # where the client's time went, every phase in seconds
        "decoding-seconds": 0.5,
        "data-seconds": 0.0,
        "model-seconds": 0.0,
        "train-seconds": 2.0,
        "evaluate-seconds": 0.0,
        "predict-seconds": 0.0,
        "other-seconds": 0.0,
        "keep-seconds": 0.0,
        "encoding-seconds": 0.0,
        "wall-seconds": 4.0,
    }
    assert protocol.PRIVACY_EPSILON == "privacy-epsilon"  # the metric of a private client's ε


def test_privacy_settings_are_the_configs_and_sent_only_while_on():
    # every key of the config's section but the server's own C of privacy.mode client (the clients never see it)
    server_only = {"clip_norm"}
    assert [f.name for f in dataclasses.fields(Privacy)] == [
        f.name for f in dataclasses.fields(PrivacyConfig) if f.name not in server_only
    ]
    off = dict(dataclasses.replace(FULL, privacy=None).encode())
    assert off == {k: v for k, v in FULL_WIRE.items() if not k.startswith("privacy.")}
    assert Request.decode(ConfigRecord(off)).privacy is None
    minimal = {
        "ops": [],
        "round": 1,
        "privacy.mode": "sample",
        "privacy.noise_multiplier": 2.0,
        "privacy.max_grad_norm": 0.5,
        "privacy.delta": 1e-6,
    }
    assert Request.decode(ConfigRecord(minimal)).privacy == Privacy("sample", 2.0, 0.5, 1e-6, 0.0, False)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "request_",
    [
        Request(ops=(), round=0),
        Request(
            ops=("describe",),
            round=0,
            setup=Setup(data={"source": "nodes"}, model=ModelSpec("cnn", 0)),
            keep=Keep(persist=False, save=False),
            public=PublicSet(fingerprint="ab"),
        ),
        Request(ops=("train",), round=1, load=Load(into_model=True), returns=Return(arrays=True, part="state")),
        Request(ops=("evaluate-received:deployed",), round=2, evaluation=Evaluation("vgg16"), keep=Keep(save=False)),
        Request(ops=("fomo-mix", "train"), round=4, training=Training(holdout_fraction=0.25), load=Load(multi=True)),
        Request(ops=("train",), round=5, transport="float32", bookkeeping=Bookkeeping(state_run="r1")),
        Request(ops=("train",), round=6, privacy=Privacy("sample", 0.8, 2.0, 1e-6)),
        FULL,
    ],
    ids=[
        "bare",
        "describe",
        "load-return",
        "evaluate-received",
        "holdout-multi",
        "transport-bookkeeping",
        "privacy",
        "full",
    ],
)
def test_every_request_survives_encode_and_decode(request_):
    assert Request.decode(request_.encode()) == request_


def test_each_part_is_read_back_into_its_own_field():
    back = Request.decode(FULL.encode())
    assert back.setup.model == ModelSpec("mlp", 7, ("mlp", "cnn"))
    assert back.load == Load(False, True) and back.keep == Keep(False, False) and back.returns == Return(True, "params")
    assert back.array_transport == "float16" and back.evaluation.received_model == "cnn"
    assert back.training.section("train").extra == {"prox_mu": 0.1} and back.training.section("train").freeze == "head"
    assert back.training.section("distill").weighting == "label-free"
    assert back.training.section("finetune") == Section()  # absent: empty
    assert back.public.predict_output == "logits" and back.bookkeeping.state_dir == "/runs/x/client-state"


def test_defaults_of_what_is_not_sent():
    bare = Request.decode(Request(ops=(), round=1).encode())
    assert bare.array_transport == "float32" and bare.returns.which == "state" and not bare.returns.arrays
    assert bare.keep.persists and bare.keep.saves and not bare.load.into_model and not bare.load.multi
    assert bare.public.predict_output == "probs" and bare.public.predict_encoding == "float32"
    assert not Keep(persist=False).saves  # a model not kept is not written either


def test_the_message_carries_the_request_and_its_records():
    arrays = {"w": np.ones(2, np.float32)}
    targets = Targets(np.zeros((2, 3), np.float32)).encode()
    draft = protocol.Draft(42, FULL, arrays=arrays, targets=targets, eval_arrays=arrays, message_type="evaluate")
    msg = draft.message()
    assert protocol.request_of(msg) == FULL and msg.metadata.group_id == "3" and msg.metadata.dst_node_id == 42
    assert msg.metadata.message_type == protocol.EVAL_MESSAGE_TYPE
    assert list(msg.content.keys()) == ["config", "arrays", "targets", "eval-arrays"]
    assert msg.content[protocol.TARGETS] is targets  # the targets record as the strategy encoded it
    # the arrays encoded as FULL's transport (float16) says, once for both records
    assert msg.content[protocol.ARRAYS] is msg.content[protocol.EVAL_ARRAYS]
    assert msg.content[protocol.ARRAYS]["w"].dtype == "float16"


def test_every_key_of_the_wire_is_declared_once_and_pinned():
    """The keys the schema declares (records, arrays, metrics, info and profile entries, the fixed settings): a new
    key is its declaration and its line here."""
    assert protocol.KEYS == [
        *("config", "arrays", "targets", "metrics", "predictions", "info", "eval-arrays", "profile"),
        *("distill-indices", "predict-indices", "client-id", "num-examples", "t-total", "privacy-epsilon"),
        *("model.name", "model.seed", "model.per_client", "load-arrays", "arrays.multi", "persist-model"),
        *("save-model", "return-arrays", "arrays.keys", "received.model", "holdout-fraction", "public.fingerprint"),
        *("predict.output", "predict.encoding", "state-dir", "state-run", "privacy.mode", "privacy.noise_multiplier"),
        *("privacy.max_grad_norm", "privacy.delta", "privacy.epsilon_budget", "privacy.reproducible_noise"),
        *("ops", "round", "arrays.transport", "arch", "fingerprint"),
        *("decoding-seconds", "data-seconds", "model-seconds", "train-seconds", "evaluate-seconds"),
        *("predict-seconds", "other-seconds", "keep-seconds", "encoding-seconds", "wall-seconds"),
    ]
    # the fixed settings of a message, derived from the fields: every key of FULL_WIRE but the sections'
    assert set(protocol.SETTINGS) == {k for k in FULL_WIRE if k.partition(".")[0] not in {"data", "client"}} - {
        k for k in FULL_WIRE if k.startswith(("train", "distill", "pfedck"))
    }
    assert protocol.RESERVED_PREFIXES == {"model", "arrays", "public", "received", "predict", "privacy"}


def test_targets_survive_encode_and_decode():
    values, rows = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 5], np.uint16)
    for targets in (Targets(values), Targets(values, rows), Targets(None, None, rows), Targets(values, rows, rows)):
        back = Targets.decode(targets.encode())
        for f in ("values", "distill_rows", "predict_rows"):
            want, got = getattr(targets, f), getattr(back, f)
            assert (got is None) if want is None else (np.array_equal(got, want) and got.dtype == want.dtype), f


def test_a_reply_is_parsed_back_into_what_the_client_sent():
    arrays = protocol.arrays_record({"w": np.full((2, 2), 0.5, np.float32)})
    wire = np.array([[0.25, 0.75]], np.float32)
    sent = Reply(
        7,
        30,
        {"train-loss": 1.5, "t-train": 0.1},
        arrays=arrays,
        predictions=wire,
        info=ReplyInfo("cnn", "ffee"),
        profile=MessageProfile(train=0.1, wall=0.2),
    )
    msg = protocol.Draft(100, Request(ops=("train",), round=1)).message()
    from flwr.app import Message

    got = parse_reply(Message(sent.encode(), reply_to=msg), expect_arrays=True, expect_predictions=True)
    assert (got.client_id, got.num_examples) == (7, 30)
    assert got.metrics == {protocol.CLIENT_ID: 7, protocol.NUM_EXAMPLES: 30, "train-loss": 1.5, "t-train": 0.1}
    np.testing.assert_array_equal(got.arrays["w"], np.full((2, 2), 0.5, np.float32))
    np.testing.assert_array_equal(got.predictions[protocol.PREDICTION_ARRAY], wire)
    assert ReplyInfo.decode(got.info) == ReplyInfo("cnn", "ffee")
    assert got.profile == MessageProfile(train=0.1, wall=0.2)
    assert ReplyInfo.decode(ReplyInfo().encode()) == ReplyInfo()


# --------------------------------------------------------------------------- sections


def test_a_tagged_section_is_read_over_the_base_one():
    base = Section(epochs=1, lr=0.1, freeze="head", extra={"a": 1, "b": 2})
    tagged = Section(epochs=5, freeze="body", extra={"b": 3})
    assert tagged.over(base) == Section(epochs=5, lr=0.1, freeze="body", extra={"a": 1, "b": 3})
    assert Section().over(base) == base
    assert tagged.over(Section()).optimiser() == {"epochs": 5}  # freeze is no optimiser setting


def test_a_sections_optimiser_fields_are_the_configs():
    assert protocol.OPTIMISER_FIELDS == tuple(f.name for f in dataclasses.fields(OptimSettings))
    assert set(protocol.OPTIMISER_FIELDS) <= {f.name for f in dataclasses.fields(Section)}


@pytest.mark.parametrize("name", ["model", "arrays", "public", "received", "predict", "privacy", "", "a.b"])
def test_a_section_may_not_take_a_reserved_or_dotted_name(name):
    with pytest.raises(ValueError, match="cannot name a settings section"):
        Request(ops=(), round=1, training=Training(sections={name: Section(epochs=1)})).encode()


# --------------------------------------------------------------------------- malformed messages

PRIVATE = {k: v for k, v in FULL_WIRE.items() if k.startswith("privacy.")}  # valid privacy settings


@pytest.mark.parametrize(
    "config,named",
    [
        ({"round": 1}, "lack 'ops'"),
        ({"ops": ["train"]}, "lack 'round'"),
        ({"ops": "train", "round": 1}, "'ops' must be a list of operation names"),
        ({"ops": [1], "round": 1}, "'ops' must be a list of operation names"),
        ({"ops": [], "round": True}, "'round' must be an integer"),
        ({"ops": [], "round": 1.0}, "'round' must be an integer"),
        ({"ops": [], "round": 1, "load-arrays": 1}, "'load-arrays' must be true or false"),
        ({"ops": [], "round": 1, "return-arrays": "yes"}, "'return-arrays' must be true or false"),
        ({"ops": [], "round": 1, "arrays.keys": 3}, "'arrays.keys' must be a string"),
        ({"ops": [], "round": 1, "holdout-fraction": "0.2"}, "'holdout-fraction' must be a number"),
        ({"ops": [], "round": 1, "holdout-fraction": True}, "'holdout-fraction' must be a number"),
        ({"ops": [], "round": 1, "model.seed": 1.5}, "'model.seed' must be an integer"),
        ({"ops": [], "round": 1, "model.per_client": "mlp"}, "'model.per_client' must be a list of architecture names"),
        ({"ops": [], "round": 1, "arrays.transport": "bfloat16"}, "unknown arrays.transport 'bfloat16'"),
        ({"ops": [], "round": 1, "train.epochs": 1.5}, "'train.epochs' must be an integer"),
        ({"ops": [], "round": 1, "distill.lr": "fast"}, "'distill.lr' must be a number"),
        ({"ops": [], "round": 1, "train:head.drop_last": 0}, "'train:head.drop_last' must be true or false"),
        ({"ops": [], "round": 1, "fold-arrays": True}, "unknown message setting 'fold-arrays'"),
        ({"ops": [], "round": 1, "model.width": 3}, "unknown message setting 'model.width'"),
        ({"ops": [], "round": 1, "predict.temperature": 2.0}, "unknown message setting 'predict.temperature'"),
        ({"ops": [], "round": 1, ".epochs": 2}, "unknown message setting '.epochs'"),
        ({"ops": [], "round": 1, "privacy.sigma": 2.0}, "unknown message setting 'privacy.sigma'"),
        ({"ops": [], "round": 1, "privacy.delta": 1e-5}, "has 'privacy.delta' but no 'privacy.mode'"),
        ({"ops": [], "round": 1, **PRIVATE, "privacy.mode": "off"}, "'privacy.mode' must be one of sample"),
        ({"ops": [], "round": 1, **PRIVATE, "privacy.mode": "client"}, "'privacy.mode' must be one of sample"),
        (
            {"ops": [], "round": 1, "privacy.mode": "sample", "privacy.delta": 1e-5},
            "without 'privacy.noise_multiplier'",
        ),
        ({"ops": [], "round": 1, **PRIVATE, "privacy.delta": 1.0}, "privacy settings are out of range"),
        ({"ops": [], "round": 1, **PRIVATE, "privacy.noise_multiplier": 0.0}, "privacy settings are out of range"),
        ({"ops": [], "round": 1, **PRIVATE, "privacy.epsilon_budget": -1.0}, "privacy settings are out of range"),
        (
            {"ops": [], "round": 1, **PRIVATE, "privacy.noise_multiplier": "1"},
            "'privacy.noise_multiplier' must be a number",
        ),
        (
            {"ops": [], "round": 1, **PRIVATE, "privacy.reproducible_noise": 1},
            "'privacy.reproducible_noise' must be true",
        ),
    ],
)
def test_decode_refuses_a_malformed_request_naming_the_key(config, named):
    with pytest.raises(MessageError, match=named.replace("(", r"\(")):
        Request.decode(ConfigRecord(config))


def test_decode_refuses_a_message_without_settings_or_with_a_bad_record():
    msg = protocol.Draft(1, Request(ops=(), round=1)).message()
    del msg.content[protocol.CONFIG]
    with pytest.raises(MessageError, match="no 'config' record"):
        protocol.request_of(msg)
    with pytest.raises(MessageError, match="must be a ConfigRecord"):
        Request.decode(ArrayRecord())
    values = protocol.arrays_record({"targets": np.zeros((2, 3), np.float32)})
    with pytest.raises(MessageError, match="must be an ArrayRecord"):
        Targets.decode(ConfigRecord())
    with pytest.raises(MessageError, match="unknown array"):
        Targets.decode(protocol.arrays_record({"targets": np.zeros(2), "labels": np.zeros(2)}))
    with pytest.raises(MessageError, match="'distill-indices' but no 'targets'"):
        Targets.decode(protocol.arrays_record({"distill-indices": np.zeros(2, np.uint8)}))
    with pytest.raises(MessageError, match="'predict-indices' must be a vector of row indices"):
        Targets.decode(protocol.arrays_record({"predict-indices": np.zeros(2, np.float32)}))
    assert Targets.decode(values).values.shape == (2, 3)
    with pytest.raises(MessageError, match="'arch' must be a string"):
        ReplyInfo.decode({"arch": 3})


def test_a_reply_without_what_it_was_asked_for_cannot_be_aggregated():
    """ClientReply.required_arrays / required_predictions: a strategy reading a reply that lacks them gets a
    ReplyError naming the client, never None silently."""
    reply = protocol.ClientReply(node_id=7, client_id=3, num_examples=10, metrics={})
    with pytest.raises(protocol.ReplyError, match="client 3's reply carries no model arrays"):
        _ = reply.required_arrays
    with pytest.raises(protocol.ReplyError, match="client 3's reply carries no predictions"):
        _ = reply.required_predictions
    full = protocol.ClientReply(
        node_id=7, client_id=3, num_examples=10, metrics={}, arrays={"w": np.ones(2)}, predictions={"p": np.zeros(3)}
    )
    assert full.required_arrays is full.arrays and full.required_predictions is full.predictions
