"""Compact transport (``strategy.transport``): float16 model arrays both ways for the parameter-sharing
strategies. Round trips equal float16 rounding and keep integer buffers exact; the bytes of a model halve; the
server keeps float32; every parameter-sharing strategy sends and receives float16; config errors name the key."""

from __future__ import annotations

import csv
import dataclasses
import logging

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

import server_app
from conftest import run_in_process
from fedapps.client.worker import model_arrays, received_state
from fedapps.config import ConfigError, config_hash, load_config, without_later_defaults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from fedapps.server.evaluation import EvaluationProtocol
from fedapps.server.transport import with_transport
from fedapps.wire import protocol
from fedapps.wire.validation import ReplyValidator
from strategies import STRATEGIES, resolve

InProcessGrid(1)  # Message() needs a task identity outside Flower's runtime


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(0.0, 3.0, (40, 30)).astype(np.float32),
        "b": np.array([1e-3, -7.25, 300.1, 65504.0], np.float32),
        "d": rng.normal(size=(5,)),  # float64 (a server-side state may be)
        "n": np.array(17, np.int64),  # a 0-d BatchNorm counter
        "h": np.array([0.5, 2.0], np.float16),
    }


def wire_of(record) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def nbytes(record) -> int:
    return protocol.record_nbytes(RecordDict({protocol.ARRAYS: record}))


# --------------------------------------------------------------------------- encoding and decoding


def test_float16_round_trip_is_float16_rounding_and_integers_are_exact():
    arrays = sample_arrays()
    wire = wire_of(protocol.arrays_record(arrays, "float16"))
    assert {k: str(v.dtype) for k, v in wire.items()} == {
        "w": "float16",
        "b": "float16",
        "d": "float16",
        "n": "int64",
        "h": "float16",
    }
    assert wire["n"].shape == () and int(wire["n"]) == 17
    back = {k: protocol.from_wire(wire[k], arrays[k].dtype) for k in arrays}  # the server's decoding
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape, k
        expected = a.astype(np.float16).astype(a.dtype) if a.dtype.kind == "f" else a
        np.testing.assert_array_equal(back[k], expected)
    # a rounding, not the identity: relative error within half a float16 ulp (2^-11) for normal values
    w, bw = arrays["w"].astype(np.float64), back["w"].astype(np.float64)
    assert not np.array_equal(bw, w)
    normal = np.abs(w) > 1e-4
    assert (np.abs(bw - w)[normal] / np.abs(w)[normal]).max() <= 2.0**-11
    assert float(back["b"][3]) == 65504.0  # float16's largest value travels as it is

    # the client's decoding: float32 tensors (the zoo's dtype), integer buffers as they came
    state = received_state(protocol.arrays_record(arrays, "float16"))
    assert state["w"].dtype == torch.float32 and state["n"].dtype == torch.int64 and int(state["n"]) == 17
    np.testing.assert_array_equal(state["w"].numpy(), arrays["w"].astype(np.float16).astype(np.float32))


def test_float32_transport_is_the_arrays_as_they_are():
    arrays = sample_arrays()
    plain, f32 = protocol.arrays_record(arrays), protocol.arrays_record(arrays, "float32")
    assert [v.data for v in plain.values()] == [v.data for v in f32.values()]
    assert {k: v.dtype for k, v in wire_of(f32).items()} == {k: v.dtype for k, v in arrays.items()}
    model = build_model("mlp", 10, (1, 8, 8), seed=0)
    assert [v.data for v in model_arrays(model, "state").values()] == [
        v.data for v in model_arrays(model, "state", "float32").values()
    ]


def test_out_of_range_or_non_finite_arrays_travel_in_their_own_dtype_with_a_warning(caplog):
    arrays = {
        "ok": np.array([1.0, -65504.0], np.float32),
        "big": np.array([65520.0, 1.0], np.float32),
        "nan": np.array([np.nan], np.float32),
        "huge": np.array([1e6], np.float64),
    }
    with caplog.at_level(logging.WARNING, logger="fedapps"):
        wire = wire_of(protocol.arrays_record(arrays, "float16"))
    assert wire["ok"].dtype == np.float16
    assert wire["big"].dtype == np.float32 and wire["nan"].dtype == np.float32 and wire["huge"].dtype == np.float64
    np.testing.assert_array_equal(wire["big"], arrays["big"])  # 65520 rounds to inf in float16: kept exact
    message = " ".join(r.getMessage() for r in caplog.records)
    assert message.endswith("own dtype: big, nan, huge")  # the arrays kept wide, named; "ok" is not among them


def test_unknown_transport_is_refused_on_both_sides():
    with pytest.raises(ValueError, match="strategy.transport"):
        protocol.arrays_record(sample_arrays(), "int8")
    request = protocol.Request(ops=(), round=1)
    assert protocol.Request.decode(request.encode()).array_transport == "float32"
    f16 = dataclasses.replace(request, transport="float16")
    assert protocol.Request.decode(f16.encode()).array_transport == "float16"
    with pytest.raises(protocol.MessageError, match=f"unknown {protocol.TRANSPORT_KEY} 'bfloat16'"):
        protocol.Request.decode(dataclasses.replace(request, transport="bfloat16").encode())


def test_the_bytes_of_a_model_halve():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)  # the papers' CNN on MNIST
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    payload = sum(a.nbytes for a in state.values())
    f32 = nbytes(protocol.arrays_record(state))
    f16 = nbytes(protocol.arrays_record(state, "float16"))
    header = f32 - payload  # numpy's .npy header per array: the same for float16 and float32
    assert 0 < header <= 128 * len(state)
    assert f16 == payload // 2 + header
    assert 0.5 <= f16 / f32 <= 0.501
    assert nbytes(model_arrays(model, "state", "float16")) == f16  # the client's reply: the same bytes


# regression: exit 0 with wrong or empty results
def test_zero_dim_arrays_keep_their_shape():
    rec = protocol.arrays_record(
        {"num_batches_tracked": np.array(5, dtype=np.int64), "w": np.arange(6, dtype=np.float32).reshape(2, 3).T}
    )
    assert rec["num_batches_tracked"].numpy().shape == ()
    assert int(rec["num_batches_tracked"].numpy()) == 5
    np.testing.assert_array_equal(rec["w"].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3).T)


# --------------------------------------------------------------------------- the server side


# a training message asking for the model back in float16
F16_TRAIN = protocol.Request(ops=("train",), round=1, returns=protocol.Return(arrays=True), transport="float16")


def test_validator_casts_a_float16_reply_back_to_the_models_dtype():
    model = {"w": np.zeros((3, 2), np.float32), "count": np.zeros((), np.int64)}
    v = ReplyValidator(1, [50], [10], model_part=lambda part: model)
    msg = protocol.Draft(100, F16_TRAIN)
    v.expect([msg])
    w = np.array([[0.1, 0.2], [1 / 3, -2.5], [1000.7, 1e-3]], np.float32)
    content = protocol.Reply(
        0, 50, arrays=protocol.arrays_record({"w": w, "count": np.array(3, np.int64)}, "float16")
    ).encode()
    from flwr.app import Message

    out = v.validate_batch(1, [Message(content, reply_to=msg.message())])
    assert not out.rejections
    got = out.accepted[0].arrays
    assert got["w"].dtype == np.float32 and got["count"].dtype == np.int64 and int(got["count"]) == 3
    np.testing.assert_array_equal(got["w"], w.astype(np.float16).astype(np.float32))


def bn_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )
    model(torch.randn(5, 1, 8, 8))  # training mode: running statistics and the counter move off their defaults
    return model


def test_a_batchnorm_model_round_trips_through_client_and_validator():
    model = bn_model(0)
    own = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    assert own["1.num_batches_tracked"].dtype == np.int64 and int(own["1.num_batches_tracked"]) == 1
    record = model_arrays(model, "state", "float16")  # the client's reply
    v = ReplyValidator(1, [50], [10], model_part=lambda part: own)
    msg = protocol.Draft(100, F16_TRAIN)
    v.expect([msg])
    from flwr.app import Message

    content = protocol.Reply(0, 50, arrays=record).encode()
    out = v.validate_batch(1, [Message(content, reply_to=msg.message())])
    assert not out.rejections, out.rejections
    got = out.accepted[0].arrays
    for k, a in own.items():
        assert got[k].dtype == a.dtype, k
        expected = a.astype(np.float16).astype(a.dtype) if a.dtype.kind == "f" else a
        np.testing.assert_array_equal(got[k], expected)
    # the server's model back to a client: it loads strictly into the same architecture
    fresh = bn_model(1)
    fresh.load_state_dict(received_state(protocol.arrays_record(got, "float16")), strict=True)
    for k, a in fresh.state_dict().items():  # float16 rounding is idempotent: the same values arrive again
        assert a.dtype == model.state_dict()[k].dtype, k
        np.testing.assert_array_equal(a.numpy(), got[k])


def fedavg(transport: str, **extra):
    cfg = load_config(
        None,
        [
            "data.source=digits",
            "data.num_clients=3",
            "model.name=mlp",
            "rounds=1",
            f"strategy.transport={transport}",
            *[f"{k}={v}" for k, v in extra.items()],
        ],
    )
    resolved = resolve(cfg)
    return resolved.cls(cfg, resolved.params)


def test_messages_carry_float16_arrays_encoded_once_and_ask_for_float16_back():
    s = fedavg("float16")
    messages = protocol.build_messages(EvaluationProtocol(s).round_drafts(1, [100, 101, 102]))
    records = {id(m.content[protocol.ARRAYS]) for m in messages}
    assert len(records) == 1  # the one global model, encoded once for all
    for m in messages:
        assert m.content[protocol.CONFIG][protocol.TRANSPORT_KEY] == "float16"
        assert {str(a.dtype) for a in wire_of(m.content[protocol.ARRAYS]).values()} == {"float16"}
    assert all(a.dtype == np.float32 for a in s.global_arrays.values())  # the server's state is untouched
    # a model sent for evaluation only travels the same way; a message without arrays gets no key
    eval_draft = protocol.Draft(100, protocol.Request(ops=("evaluate-received",), round=2), eval_arrays=s.global_arrays)
    bare_draft = protocol.Draft(101, protocol.Request(ops=("evaluate",), round=2))
    eval_msg, bare = protocol.build_messages(with_transport([eval_draft, bare_draft], s.cfg.strategy.transport))
    assert {str(a.dtype) for a in wire_of(eval_msg.content[protocol.EVAL_ARRAYS]).values()} == {"float16"}
    assert protocol.TRANSPORT_KEY not in bare.content[protocol.CONFIG]

    plain = protocol.build_messages(EvaluationProtocol(fedavg("float32")).round_drafts(1, [100]))[0]
    assert protocol.TRANSPORT_KEY not in plain.content[protocol.CONFIG]
    assert {str(a.dtype) for a in wire_of(plain.content[protocol.ARRAYS]).values()} == {"float32"}


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="strategy.transport"):
        load_config(None, ["strategy.transport=float64"])
    for name, extra in (("local", []), ("fedmd", ["data.public_fraction=0.2"])):
        cfg = load_config(None, [f"strategy.name={name}", "strategy.transport=float16", "data.source=digits", *extra])
        with pytest.raises(ConfigError, match="strategy.transport"):
            resolve(cfg)
        resolve(load_config(None, [f"strategy.name={name}", "data.source=digits", *extra]))  # float32: accepted


def test_float32_keeps_the_config_hash_it_had_before_the_key_existed():
    plain, f16 = load_config(None, []), load_config(None, ["strategy.transport=float16"])
    assert "transport" not in without_later_defaults(plain.to_dict())["strategy"]  # what config_hash hashes
    assert "transport" in without_later_defaults(f16.to_dict())["strategy"]
    assert config_hash(plain) != config_hash(f16)  # a float16 run is never taken for a float32 one (compare, resume)


PARAMETER_SHARING = sorted(n for n, c in STRATEGIES.items() if not c.model_agnostic)
EXTRA = {
    "fedamp": ["client.lr=0.01", "strategy.params.fedamp.lam=0.5"],  # lr·λ/α_K = 0.5 (< 1: FedAMP.check)
    "fedrep": ["strategy.params.fedrep.head_epochs=1"],
    "fedbabu": ["strategy.params.fedbabu.finetune_epochs=1"],
}


def test_the_parameter_sharing_strategies_are_the_expected_ones():
    assert set(PARAMETER_SHARING) >= {
        "fedavg",
        "fedprox",
        "cwfedavg",
        "ditto",
        "fedamp",
        "fedfomo",
        "ifca",
        "cfl",
        "fedper",
        "fedrep",
        "fedbabu",
        "feduv",
        "fednh",
        "pfedhn",
        "fedselect",
        "pfedck",
    }
    assert not {"local", "cosmos", "fedmd", "fedct", "comet"} & set(PARAMETER_SHARING)


@pytest.mark.parametrize("name", PARAMETER_SHARING)
def test_every_parameter_sharing_strategy_sends_and_receives_float16(name):
    cfg = load_config(
        None,
        [
            f"strategy.name={name}",
            "strategy.transport=float16",
            "data.source=digits",
            "data.num_clients=3",
            "model.name=mlp",
            "rounds=1",
            "client.epochs=1",
            *EXTRA.get(name, []),
        ],
    )
    resolved = resolve(cfg)
    s = resolved.cls(cfg, resolved.params)
    grid = InProcessGrid(3, record=True)
    entry = RoundDriver(s).run_round(grid, 1, 600.0, last=True)  # the training phase and the evaluation-only one
    assert entry.replies_rejected == 0 and entry.replies_ok == 6, entry.rejections
    with_arrays = [m for m in grid.sent + grid.replies if protocol.ARRAYS in m.content]
    assert with_arrays, f"{name} sent no arrays"
    for m in with_arrays:
        floats = {str(a.dtype) for a in wire_of(m.content[protocol.ARRAYS]).values() if a.dtype.kind == "f"}
        assert floats == {"float16"}, (name, floats)
    final = s.final_arrays()  # the server's own model (where the strategy has one) stays as wide as it was
    assert final is None or all(a.dtype != np.float16 for a in final.values())


# --------------------------------------------------------------------------- end to end


def rows(run_dir) -> list[dict[str, str]]:
    with open(run_dir / "rounds.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_fedavg_run_float16_halves_the_bytes_and_keeps_the_accuracy(tiny_config, tmp_path):
    out = {}
    for transport in ("float32", "float16"):
        cfg = tiny_config(rounds=2, strategy={"name": "fedavg", "transport": transport})
        summary = server_app.run_experiment(InProcessGrid(4), str(cfg), "", str(tmp_path / transport))
        out[transport] = (summary, rows(tmp_path / transport / "fedavg-digits-iid-s0"))
    (s32, r32), (s16, r16) = out["float32"], out["float16"]
    for a, b in zip(r32, r16):  # per round, both directions: half, up to headers, metrics and config
        for col in ("bytes_up", "bytes_down"):
            assert 0.5 <= int(b[col]) / int(a[col]) <= 0.51, (col, a[col], b[col])
    for key in ("bytes_up_per_client_round", "bytes_down_per_client_round"):
        assert 0.5 <= s16[key] / s32[key] <= 0.51
    assert abs(s16["accuracy_mean"] - s32["accuracy_mean"]) <= 0.03


# 8×8 images: what these regressions are about (BatchNorm buffers in the exchange, the server model's evaluation)
# does not depend on the input size, and 32×32 costs ~5× the time
SYNTH = {
    "source": "synthetic",
    "partition": "iid",
    "num_clients": 2,
    "synthetic_samples": 120,
    "synthetic_classes": 4,
    "synthetic_shape": [3, 8, 8],
}


# regression: exit 0 with wrong or empty results
@pytest.mark.parametrize("strategy", ["fedavg", "fedper"])
@pytest.mark.heavy
def test_batchnorm_model_exchanges_parameters(strategy, tiny_config, tmp_path):
    cfg = tiny_config(
        rounds=2,
        strategy={"name": strategy},
        data=SYNTH,
        model={"name": "resnet18"},
        client={"epochs": 1, "batch_size": 16, "lr": 0.01},
    )
    grid = InProcessGrid(2, record=True)
    summary, out = run_in_process(cfg, tmp_path / "out", grid)
    logged = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in logged] == [2, 2]
    assert all(not m.has_error() for m in grid.replies)
    assert isinstance(summary["accuracy_mean"], float)


@pytest.mark.parametrize("transport", ["float32", "float16"])
@pytest.mark.parametrize("name", ["fedavg", "cwfedavg"])
def test_every_message_of_a_round_is_built_once(monkeypatch, name, transport):
    """A round's messages (the training ones, which also measure the previous round's deployed models, and the
    evaluation-only ones after the last round) are each built once, from their draft, right before they are sent:
    one Flower Message per message sent, one config record per distinct request, one arrays record per distinct
    model (the global model once for all; float16 encoded straight from the server's arrays), and no settings
    decoded on the server (each message's request is decoded once, by its client)."""
    from fedapps.wire import message as wire_message

    built: list[object] = []
    encodes: list[object] = []  # the requests themselves: kept alive, their ids cannot be reused by later objects
    arrays_encodes: list[str] = []
    decodes: list[int] = []
    real_message, real_encode, real_record = wire_message.Message, protocol.Request.encode, wire_message.arrays_record
    real_decode = protocol.Request.decode.__func__

    def message(*args, **kwargs):
        msg = real_message(*args, **kwargs)
        built.append(msg)
        return msg

    def encode(self):
        encodes.append(self)
        return real_encode(self)

    def arrays_record(arrays, transport="float32"):
        arrays_encodes.append(transport)
        return real_record(arrays, transport)

    def decode(cls, config):
        decodes.append(1)
        return real_decode(cls, config)

    monkeypatch.setattr(wire_message, "Message", message)
    monkeypatch.setattr(wire_message, "arrays_record", arrays_record)
    monkeypatch.setattr(protocol.Request, "encode", encode)
    monkeypatch.setattr(protocol.Request, "decode", classmethod(decode))
    cfg = load_config(
        None,
        [
            "data.source=digits",
            "data.num_clients=3",
            "model.name=mlp",
            "rounds=2",
            f"strategy.name={name}",
            f"strategy.transport={transport}",
        ],
    )
    resolved = resolve(cfg)
    strategy = resolved.cls(cfg, resolved.params)
    grid = InProcessGrid(3, record=True)
    RoundDriver(strategy).start(grid)
    sent = [m for m in grid.sent if m.metadata.message_type != protocol.QUERY_MESSAGE_TYPE]
    queries = len(grid.sent) - len(sent)
    assert len(sent) == 3 + 3 + 3  # two rounds of three, then the evaluation-only message to each client
    # every message sent was built once (the identify queries before round 1 included), none rebuilt or rewritten
    assert len(built) == len(grid.sent) and {id(m) for m in built} == {id(m) for m in grid.sent}
    configs = {id(m.content[protocol.CONFIG]) for m in grid.sent}
    assert len(encodes) == len(configs) == len({id(r) for r in encodes})  # one encode per request, its record shared
    records = {id(m.content[n]) for m in sent for n in (protocol.ARRAYS, protocol.EVAL_ARRAYS) if n in m.content}
    assert len(arrays_encodes) == len(records) and set(arrays_encodes) == {transport}
    if name == "fedavg":  # the global model: one record per phase (rounds 1, 2, the final evaluation) for three
        assert len(records) == 3
    else:  # a personalised model per client in round 2 and in the final evaluation (round 1: the initial one)
        assert len(records) >= 3 * 2
    for m in sent:
        if protocol.ARRAYS in m.content:
            assert {str(a.dtype) for a in m.content[protocol.ARRAYS].values()} == {transport}
    assert len(decodes) == len(sent) + queries  # each message's settings decoded once, by its client
