"""pFedHN: the hypernetwork's update is the chain rule (against torch's Jacobian on a toy target and against the
formulas written out for a trunk of one layer), its sign moves the generated model towards the trained one, the
generated shapes are the target model's parameters, the embeddings move only where a client replied, BatchNorm
buffers stay on the clients, a model too large for the server is refused, and a short run in-process, a resumed
one and one through `flwr run`."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch

from deployed_toy import evaluate, tensors
from fedapps.client.worker import STATE_MODEL
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies import RunContext, resolve
from strategies.pfedhn import (
    HyperNetwork,
    accumulate_delta_gradient,
    embedding_size,
    hypernetwork_size,
    hypernetwork_step,
    make_optimizer,
    target_shapes,
)

TOY = {"w": (2, 3), "b": (2,)}  # a toy target network: one linear layer 3 → 2


def toy_hn(hidden_layers: int = 1, seed: int = 0) -> HyperNetwork:
    torch.manual_seed(seed)
    return HyperNetwork(3, TOY, embed_dim=2, hidden_dim=3, hidden_layers=hidden_layers).double()


def flat_params(hn: HyperNetwork) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in hn.parameters()])


def flat_grad(hn: HyperNetwork) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in hn.parameters()])


def jacobian(hn: HyperNetwork, client: int | None) -> torch.Tensor:
    """∂θ/∂φ (|θ| × |φ|) by torch.autograd.functional.jacobian of θ(φ) = h(v_client; φ), φ flattened."""
    names = [n for n, _ in hn.named_parameters()]
    shapes = [p.shape for p in hn.parameters()]
    sizes = [p.numel() for p in hn.parameters()]

    def theta(flat: torch.Tensor) -> torch.Tensor:
        params = {n: c.view(s) for n, c, s in zip(names, flat.split(sizes), shapes)}
        generated = torch.func.functional_call(hn, params, (client,), strict=True)
        return torch.cat([generated[k].reshape(-1) for k in TOY])

    return torch.autograd.functional.jacobian(theta, flat_params(hn))


# --------------------------------------------------------------------------- the hypernetwork and its gradient


def test_embedding_size_is_the_authors_rule_unless_given():
    assert embedding_size(50, 0) == int(1 + 50 / 4) == 13  # the authors' code: int(1 + num_nodes / 4)
    assert embedding_size(20, 0) == 6 and embedding_size(3, 0) == 1 and embedding_size(20, 8) == 8


def test_generated_shapes_are_the_target_models_parameters_and_the_size_formula_holds():
    for name, shape in (("cnn", (1, 8, 8)), ("mlp", (1, 8, 8)), ("cnn", (3, 32, 32)), ("mlp", (1, 28, 28))):
        model = build_model(name, 10, shape)
        shapes = target_shapes(model)
        hn = HyperNetwork(5, shapes, embed_dim=2, hidden_dim=3, hidden_layers=2)
        generated = hn.generate(1)
        batch = hn.generate_batch([1, None, 4])
        assert list(generated) == list(batch) == [n for n, _ in model.named_parameters()]
        for k, v in generated.items():
            assert batch[k].shape == (3, *v.shape)
            torch.testing.assert_close(batch[k][0], v, rtol=1e-5, atol=1e-6)
        assert {k: tuple(v.shape) for k, v in generated.items()} == {
            k: tuple(p.shape) for k, p in model.named_parameters()
        }
        model.load_state_dict(generated, strict=True)  # these models have no buffers: the whole state
        assert hypernetwork_size(5, shapes, 2, 3, 2) == sum(p.numel() for p in hn.parameters())
    # by hand for the toy: embeddings 3·2, trunk (2·3 + 3) + 1·(3·3 + 3), heads (3·6 + 6) + (3·2 + 2)
    assert hypernetwork_size(3, TOY, 2, 3, 1) == 6 + 9 + 12 + 24 + 8 == sum(p.numel() for p in toy_hn().parameters())


@pytest.mark.parametrize("client", [1, None])
def test_gradient_is_the_transposed_jacobian_times_generated_minus_trained(client):
    hn = toy_hn()
    theta = torch.cat([v.detach().reshape(-1) for v in hn.generate(client).values()])
    trained_flat = theta + torch.tensor([0.3, -0.2, 0.1, 0.5, -0.4, 0.2, -0.1, 0.6], dtype=torch.float64)
    trained = {"w": trained_flat[:6].view(2, 3), "b": trained_flat[6:]}
    J = jacobian(hn, client)
    assert J.shape == (8, sum(p.numel() for p in hn.parameters()))
    [norm] = accumulate_delta_gradient(hn, [client], [trained])
    delta = theta - trained_flat  # generated minus trained
    want = J.T @ delta
    got = flat_grad(hn)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, -want)  # the other sign (trained minus generated) would fail
    assert norm == pytest.approx(float(delta.norm()), rel=1e-12)
    emb = hn.embeddings.weight.grad
    if client is None:  # the mean embedding is a constant: no embedding gets a gradient
        assert emb is None or not emb.any()
    else:  # only the client's own row
        assert emb[client].abs().sum() > 0 and not emb[[0, 2]].any()
    # several clients in one batch: the sum of their chain-rule gradients (the round's gradient)
    hn.zero_grad(set_to_none=True)
    other = {k: v * 0.5 for k, v in trained.items()}
    norms = accumulate_delta_gradient(hn, [client, 2], [trained, other])
    theta2 = torch.cat([v.detach().reshape(-1) for v in hn.generate(2).values()])
    delta2 = theta2 - 0.5 * trained_flat
    torch.testing.assert_close(flat_grad(hn), want + jacobian(hn, 2).T @ delta2, rtol=1e-12, atol=1e-12)
    assert norms == pytest.approx([float(delta.norm()), float(delta2.norm())], rel=1e-12)


def test_the_step_applies_the_gradient_and_pulls_the_generated_model_to_the_trained_one():
    hn = toy_hn()
    trained = {"w": torch.full((2, 3), 0.5, dtype=torch.float64), "b": torch.tensor([-1.0, 1.0], dtype=torch.float64)}

    def distance() -> float:
        g = {k: v.detach() for k, v in hn.generate(0).items()}
        return float(sum(((g[k] - trained[k]) ** 2).sum() for k in TOY))

    before, phi = distance(), flat_params(hn)
    opt = make_optimizer(hn, lr=0.05, embed_lr=0.0, momentum=0.0, weight_decay=0.0)
    accumulate_delta_gradient(hn, [0], [trained])
    grad = flat_grad(hn)
    norm = hypernetwork_step(hn, opt, clip_norm=0.0)
    assert norm == pytest.approx(float(grad.norm()), rel=1e-12)
    torch.testing.assert_close(flat_params(hn), phi - 0.05 * grad, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in hn.parameters())  # freed after the step
    assert distance() < before  # descent on ½‖h(v; φ) − θ̃‖²

    # clipped: the step is lr · c · g / ‖g‖ (torch's clip_grad_norm_, eps 1e-6)
    hn2 = toy_hn()
    opt2 = make_optimizer(hn2, lr=0.05, embed_lr=0.0, momentum=0.0, weight_decay=0.0)
    accumulate_delta_gradient(hn2, [0], [trained])
    hypernetwork_step(hn2, opt2, clip_norm=0.1)
    torch.testing.assert_close(flat_params(hn2), phi - 0.05 * 0.1 * grad / (grad.norm() + 1e-6), rtol=1e-9, atol=1e-12)


# found by `make mutate`
def test_pfedhn_embedding_size_one_and_optimizer_settings() -> None:
    assert embedding_size(20, 1) == 1  # a given size of 1 is kept, not replaced by the rule
    hn = HyperNetwork(3, {"w": (2, 3)}, embed_dim=2, hidden_dim=3, hidden_layers=1)
    rest, emb = make_optimizer(hn, lr=0.1, embed_lr=0.0, momentum=0.7, weight_decay=0.01).param_groups
    assert (rest["lr"], rest["momentum"], rest["weight_decay"]) == (0.1, 0.7, 0.01)
    assert (emb["lr"], emb["momentum"], emb["weight_decay"]) == (0.1, 0.7, 0.01)  # embed_lr 0: the same lr
    assert [id(t) for t in emb["params"]] == [id(hn.embeddings.weight)]
    assert {id(t) for t in rest["params"]} == {id(t) for n, t in hn.named_parameters() if not n.startswith("emb")}
    assert make_optimizer(hn, lr=0.1, embed_lr=0.3, momentum=0.0, weight_decay=0.0).param_groups[1]["lr"] == 0.3


# found by `make mutate`
def test_pfedhn_step_without_a_gradient_reports_zero_and_moves_nothing() -> None:
    hn = HyperNetwork(3, {"w": (2, 3)}, embed_dim=2, hidden_dim=3, hidden_layers=1)
    before = [p.detach().clone() for p in hn.parameters()]
    assert hypernetwork_step(hn, make_optimizer(hn, 0.1, 0.0, 0.9, 0.0), clip_norm=1.0) == 0.0
    assert all(torch.equal(a, p) for a, p in zip(before, hn.parameters()))


# --------------------------------------------------------------------------- the strategy's round, by hand


def hand_config(tiny_config, **params):
    pfedhn = {
        "embed_dim": 2,
        "hidden_dim": 4,
        "hidden_layers": 0,
        "lr": 0.1,
        "embed_lr": 0.3,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "clip_norm": 0.0,
        "server_device": "cpu",
        **params,
    }
    return load_config(tiny_config(data={"num_clients": 3}, strategy={"name": "pfedhn", "params": {"pfedhn": pfedhn}}))


def test_messages_carry_each_clients_generated_parameters_and_the_update_is_the_chain_rule(tiny_config):
    """Trunk of one layer: f = A v + a, θ_k = W_k f + b_k. With δ_i = θ_i − θ̃_i and g_i = Σ_k W_kᵀ δ_ik the
    gradient is W_k: Σ_i δ_ik f_iᵀ, b_k: Σ_i δ_ik, A: Σ_i g_i v_iᵀ, a: Σ_i g_i, v_i: Aᵀ g_i (only for a client whose
    model came from its own embedding)."""
    cfg = hand_config(tiny_config)
    InProcessGrid(3)  # Flower's task identity, to build messages
    s = resolve(cfg).build(cfg)
    hn = s.hn
    names = hn.names
    assert names == [n for n, _ in build_model("mlp", 10, (1, 8, 8)).named_parameters()]
    old = {k: v.detach().clone().double() for k, v in hn.state_dict().items()}
    A, a, V = old["trunk.0.weight"], old["trunk.0.bias"], old["embeddings.weight"]
    W = {k: old[f"heads.{j}.weight"] for j, k in enumerate(names)}
    b = {k: old[f"heads.{j}.bias"] for j, k in enumerate(names)}

    def theta(v):
        f = A @ v + a
        return f, {k: (W[k] @ f + b[k]) for k in names}

    s.nodes.node_to_client = {100: 0, 101: 1}  # node 102 has not replied yet
    messages = protocol.build_messages(s.round_messages(1, [100, 101, 102]))
    sent = {
        int(m.metadata.dst_node_id): {k: v.numpy() for k, v in m.content[protocol.ARRAYS].items()} for m in messages
    }
    assert all(protocol.request_of(m).returns.part == "params" for m in messages)
    shapes = {k: p.shape for k, p in build_model("mlp", 10, (1, 8, 8)).named_parameters()}
    for node, v in ((100, V[0]), (101, V[1]), (102, V.mean(0))):  # the unknown node: the mean embedding
        _, want = theta(v)
        for k in names:
            assert sent[node][k].shape == shapes[k] and sent[node][k].dtype == np.float32
            np.testing.assert_allclose(sent[node][k].reshape(-1), want[k].numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(sent[100]["fc.weight"], sent[101]["fc.weight"])  # personalised

    rng = np.random.default_rng(0)
    deltas = {
        n: {k: (0.01 * rng.standard_normal(sent[n][k].shape)).astype(np.float32) for k in names} for n in (100, 102)
    }
    replies = [
        ClientReply(
            node_id=n, client_id=c, num_examples=10, metrics={}, arrays={k: sent[n][k] - deltas[n][k] for k in names}
        )
        for n, c in ((100, 0), (102, 2))
    ]
    extra = s.aggregate(1, replies)

    grads = {k: torch.zeros_like(v) for k, v in old.items()}
    for n, v, own in ((100, V[0], 0), (102, V.mean(0), None)):
        f, gen = theta(v)
        d = {
            k: torch.as_tensor(sent[n][k].reshape(-1) - (sent[n][k] - deltas[n][k]).reshape(-1)).double() for k in names
        }
        g = sum(W[k].T @ d[k] for k in names)
        for j, k in enumerate(names):
            grads[f"heads.{j}.weight"] += torch.outer(d[k], f)
            grads[f"heads.{j}.bias"] += d[k]
        grads["trunk.0.weight"] += torch.outer(g, v)
        grads["trunk.0.bias"] += g
        if own is not None:
            grads["embeddings.weight"][own] += A.T @ g
    new = {k: v.detach().double() for k, v in hn.state_dict().items()}
    for k in old:
        lr = 0.3 if k == "embeddings.weight" else 0.1
        torch.testing.assert_close(new[k], old[k] - lr * grads[k], rtol=1e-4, atol=1e-6, msg=k)
    assert torch.equal(new["embeddings.weight"][1:], old["embeddings.weight"][1:])  # no reply, or the mean's model
    assert not torch.equal(new["embeddings.weight"][0], old["embeddings.weight"][0])
    want_norms = [
        math.sqrt(sum(float((deltas[n][k].astype(np.float64) ** 2).sum()) for k in names)) for n in (100, 102)
    ]
    assert extra["hn_delta_norm_mean"] == pytest.approx(np.mean(want_norms), rel=1e-4)
    assert extra["hn_from_mean_embedding"] == 1
    # the next message to client 0 is generated from its updated embedding (its deployed model)
    [msg] = protocol.build_messages(s.round_messages(2, [100]))
    np.testing.assert_array_equal(msg.content[protocol.ARRAYS]["fc.bias"].numpy(), s.generated(0)["fc.bias"])


def test_params_are_declared_and_a_model_too_large_for_the_server_is_refused(tiny_config):
    p = resolve(load_config(tiny_config(strategy={"name": "pfedhn"}))).params
    assert (p.embed_dim, p.hidden_dim, p.hidden_layers, p.lr, p.embed_lr, p.momentum, p.weight_decay, p.clip_norm) == (
        0,
        100,
        3,
        1e-2,
        0.0,
        0.9,
        1e-3,
        50.0,
    )
    for bad in ({"hidden_dim": 0}, {"momentum": 1.0}, {"lr": 0.0}, {"server_device": "tpu"}):
        with pytest.raises(ConfigError, match=f"strategy.params.pfedhn.{next(iter(bad))}"):
            resolve(load_config(tiny_config(strategy={"name": "pfedhn", "params": {"pfedhn": bad}})))
    # ResNet-18 (11.2 M parameters) under the default H = 100: ≈ 1.1 G hypernetwork parameters
    with pytest.raises(ConfigError, match="max_hn_params") as exc:
        resolve(load_config(tiny_config(strategy={"name": "pfedhn"}, model={"name": "resnet18"})))
    assert "model.name" in str(exc.value) and "strategy.params.pfedhn.hidden_dim" in str(exc.value)
    small = {"hidden_dim": 2, "hidden_layers": 0}
    resolve(
        load_config(tiny_config(strategy={"name": "pfedhn", "params": {"pfedhn": small}}, model={"name": "resnet18"}))
    )


@pytest.mark.heavy
def test_batchnorm_buffers_stay_on_the_clients(tiny_config):
    """MobileNetV2 (BatchNorm): the messages carry parameters only; each client keeps its own running statistics,
    trained on its data, in its private model between rounds."""
    data = {
        "source": "synthetic",
        "num_clients": 2,
        "synthetic_classes": 4,
        "synthetic_shape": [1, 8, 8],
        "synthetic_samples": 40,
    }
    cfg = load_config(
        tiny_config(
            rounds=2,
            data=data,
            model={"name": "mobilenetv2"},
            strategy={"name": "pfedhn", "params": {"pfedhn": {"hidden_dim": 2, "hidden_layers": 0}}},
        )
    )
    s = resolve(cfg).build(cfg)
    grid = InProcessGrid(2, record=True)
    RoundDriver(s).start(grid)
    assert not [m.error.reason for m in grid.replies if m.has_error()]
    model = build_model("mobilenetv2", 4, (1, 8, 8))
    params = {n for n, _ in model.named_parameters()}
    assert all(
        set(m.content[protocol.ARRAYS].keys()) == params
        for m in grid.sent
        if m.metadata.message_type != protocol.QUERY_MESSAGE_TYPE
    )  # the identify messages carry no model
    means = [
        grid.contexts[100 + c].state[STATE_MODEL].to_torch_state_dict()["features.0.1.running_mean"] for c in (0, 1)
    ]
    assert all(m.abs().sum() > 0 for m in means) and not torch.equal(means[0], means[1])  # each client's own


# --------------------------------------------------------------------------- short runs


def run_inprocess(tiny_config, rounds: int, grid: InProcessGrid | None = None):
    cfg = load_config(
        tiny_config(rounds=rounds, data={"partition": "pathological", "num_clients": 4}, strategy={"name": "pfedhn"})
    )
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    logs: list = []
    s = resolved.build(cfg, RunContext(on_round=logs.append))
    grid = grid if grid is not None else InProcessGrid(4, record=True)
    return s, grid, RoundDriver(s).start(grid), logs, resolved, cfg


def test_short_run_personalises_and_learns(tiny_config):
    # client 1's node never answers the identify message: the server cannot pick its embedding in round 1
    grid = InProcessGrid(4, record=True, drop=lambda rnd, partition: rnd == 0 and partition == 1)
    s, grid, result, logs, resolved, cfg = run_inprocess(tiny_config, 3, grid)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    by_round = {
        r: {
            int(m.metadata.dst_node_id) - 100: m.content[protocol.ARRAYS]["fc.weight"].numpy()
            for m in train
            if protocol.request_of(m).round == r
        }
        for r in (1, 2)
    }
    initial = resolved.build(cfg)  # φ as it was in round 1
    for c in (0, 2, 3):  # identified before round 1: each its own h(v_i)
        np.testing.assert_array_equal(by_round[1][c], initial.generated(c)["fc.weight"])
    np.testing.assert_array_equal(by_round[1][1], initial.generated(None)["fc.weight"])  # the mean embedding's
    assert not np.allclose(by_round[1][0], by_round[1][2]) and not np.allclose(by_round[2][1], by_round[2][0])
    assert [e.extra["hn_from_mean_embedding"] for e in logs] == [1, 0, 0]  # from round 2 client 1 has its own
    acc = {r: result.evaluate_metrics_clientapp[r]["acc_mean"] for r in (1, 2, 3)}
    assert acc[3] > acc[1] + 0.05, acc  # measured: 0.14, 0.18, 0.26; with the step's sign reversed 0.03, 0.003, 0
    summary = s.final_summary()
    assert summary["hypernetwork_parameters"] == sum(p.numel() for p in s.hn.parameters())
    assert summary["hypernetwork_peak_bytes"] == 16 * summary["hypernetwork_parameters"]


def test_a_resumed_run_continues_the_hypernetwork_and_its_momentum(tiny_config):
    straight, _, _, _, resolved, cfg = run_inprocess(tiny_config, 2)
    first = resolved.build(cfg)
    grid = InProcessGrid(4)
    RoundDriver(first).start(grid, num_rounds=1)
    saved = pickle.loads(pickle.dumps(RoundDriver(first).checkpoint_state()))
    resumed = resolved.build(cfg)
    RoundDriver(resumed).load_checkpoint_state(saved)
    RoundDriver(resumed).start(grid, num_rounds=2, first_round=2)
    for k, v in straight.hn.state_dict().items():
        assert torch.equal(v, resumed.hn.state_dict()[k]), k
    a, b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sorted(a) == sorted(b) and all(torch.equal(a[i]["momentum_buffer"], b[i]["momentum_buffer"]) for i in a)


@pytest.mark.heavy
def test_end_to_end_through_flowers_wire_format(tmp_path):
    """2 rounds of pFedHN on digits, 3 clients, every message, reply and node Context through Flower's protobuf
    encoding (:func:`conftest.wire_run`; the Ray path itself: test_cli_e2e.py).

    The SuperNodes are identified before round 1, so no client is sent the mean embedding's model in any round."""
    from conftest import wire_run

    out = wire_run(
        tmp_path,
        strategy={"name": "pfedhn"},
        data={"source": "digits", "partition": "pathological", "num_clients": 3, "classes_per_client": 4},
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "pfedhn" and summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0 and summary["hypernetwork_parameters"] > 0
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [3, 3] and [r["hn_from_mean_embedding"] for r in rows] == [0, 0]
    assert all(isinstance(r["hn_delta_norm_mean"], float) and r["hn_delta_norm_mean"] > 0 for r in rows)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """pFedHN's deployed model after round rnd: what the hypernetwork generates from the client's embedding (the
    MLP has no buffers)."""
    return evaluate(tensors(s.generated(cid)), data)


DEPLOYED_BY_HAND = {"pfedhn": deployed_by_hand}
