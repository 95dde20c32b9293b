"""pFedCK: the mutual-distillation losses by hand (values, which model each term trains, the reduction), the
clustering of model updates on a planted case, the per-cluster average, a short run and one real `flwr run`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedapps.client import ops
from fedapps.client.worker import STATE_MODEL, Worker, data_spec
from fedapps.config import ConfigError, OptimSettings, load_config
from fedapps.data import get_federation
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.reporting.results import read_csv
from fedapps.seeds import derive_seed
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies import resolve
from strategies.comet import kmeans, kmeans_plus_plus
from strategies.pfedck import (
    ALPHA,
    BETA,
    FEATURE_MSE,
    FEATURE_WEIGHT,
    KL_INTERACTIVE,
    KL_PERSONAL,
    SECTION,
    TEMPERATURE,
    TRAIN_OP,
    ModelPair,
    cluster_updates,
    feature_losses,
    mutual_losses,
    unit_rows,
)
from test_ops_worker import worker_message

PATHOLOGICAL = {"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 4}
Z_P = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
Z_I = [[0.0, 1.0, 0.0], [2.0, -1.0, 1.0]]
Y = [0, 1]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# --------------------------------------------------------------------------- the losses


def test_each_kl_term_value_by_hand():
    """KL(q‖p) = Σ_c q_c (log q_c − log p_c), q the OTHER model's softened output, averaged over the batch, × T²."""
    t, alpha, beta = 2.0, 0.5, 3.0
    zp, zi = np.array(Z_P), np.array(Z_I)
    p, q = softmax(zp / t), softmax(zi / t)
    kl_p = np.mean(np.sum(q * (np.log(q) - np.log(p)), axis=1)) * t * t  # trains the personal model
    kl_i = np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=1)) * t * t  # trains the interactive model
    ce = lambda z: -np.mean(np.log(softmax(z))[np.arange(2), Y])  # noqa: E731
    total, got_p, got_i = mutual_losses(torch.tensor(Z_P), torch.tensor(Z_I), torch.tensor(Y), alpha, beta, t)
    assert got_p.item() == pytest.approx(kl_p, rel=1e-6) and got_i.item() == pytest.approx(kl_i, rel=1e-6)
    assert kl_p != pytest.approx(kl_i)  # the two directions differ: a swapped direction fails above
    assert total.item() == pytest.approx(ce(zp) + alpha * kl_p + ce(zi) + beta * kl_i, rel=1e-6)


def test_reduction_is_a_sum_over_classes_and_a_mean_over_the_batch():
    zp, zi, y = torch.tensor(Z_P), torch.tensor(Z_I), torch.tensor(Y)
    _, kl_p, kl_i = mutual_losses(zp, zi, y, 1.0, 1.0, 1.0)
    _, kl_p2, kl_i2 = mutual_losses(torch.cat([zp, zp]), torch.cat([zi, zi]), torch.cat([y, y]), 1.0, 1.0, 1.0)
    assert kl_p2.item() == pytest.approx(kl_p.item()) and kl_i2.item() == pytest.approx(kl_i.item())  # not a sum
    one = mutual_losses(zp[:1], zi[:1], y[:1], 1.0, 1.0, 1.0)[1].item()
    q, p = F.softmax(zi[0], -1), F.softmax(zp[0], -1)
    assert one == pytest.approx(float((q * (q.log() - p.log())).sum()), rel=1e-6)  # summed over the classes


def test_each_term_trains_only_its_own_model_and_pulls_it_towards_the_other():
    """d(KL_p)/dz_p = T·(p − q)/B (softmax at temperature T, the T² factor applied), d(KL_p)/dz_i = 0; the same
    with the roles swapped for KL_i; a gradient step on a term brings its model's output closer to the other's."""
    t = 2.0
    zp = torch.tensor(Z_P, requires_grad=True)
    zi = torch.tensor(Z_I, requires_grad=True)
    _, kl_p, kl_i = mutual_losses(zp, zi, torch.tensor(Y), 1.0, 1.0, t)
    gp_p, gi_p = torch.autograd.grad(kl_p, [zp, zi], allow_unused=True, retain_graph=True)
    gp_i, gi_i = torch.autograd.grad(kl_i, [zp, zi], allow_unused=True)
    p, q = softmax(np.array(Z_P) / t), softmax(np.array(Z_I) / t)
    np.testing.assert_allclose(gp_p.numpy(), t * (p - q) / 2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gi_i.numpy(), t * (q - p) / 2, rtol=1e-5, atol=1e-7)
    assert gi_p is None or not gi_p.any()  # the interactive logits are detached in the personal model's term
    assert gp_i is None or not gp_i.any()
    with torch.no_grad():
        closer = mutual_losses(zp - 1.0 * gp_p, zi, torch.tensor(Y), 1.0, 1.0, t)[1]
    assert closer.item() < kl_p.item()


def test_total_gradient_is_each_models_own_loss():
    zp = torch.tensor(Z_P, requires_grad=True)
    zi = torch.tensor(Z_I, requires_grad=True)
    y = torch.tensor(Y)
    total, _, _ = mutual_losses(zp, zi, y, 0.5, 3.0, 2.0)
    gp, gi = torch.autograd.grad(total, [zp, zi])
    onehot = np.eye(3)[Y]
    p, q = softmax(np.array(Z_P) / 2.0), softmax(np.array(Z_I) / 2.0)
    np.testing.assert_allclose(gp.numpy(), (softmax(np.array(Z_P)) - onehot) / 2 + 0.5 * 2.0 * (p - q) / 2, rtol=1e-5)
    np.testing.assert_allclose(gi.numpy(), (softmax(np.array(Z_I)) - onehot) / 2 + 3.0 * 2.0 * (q - p) / 2, rtol=1e-5)


H_P = [[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]]
H_I = [[0.0, 1.0, 0.5], [2.0, -1.0, 0.0]]


def test_feature_terms_by_hand_each_trains_only_its_own_model():
    """MSE(h_own, h_other) = mean over the batch and the entries of (h_own − h_other)²: here (1 + 9 + 0 + 4 + 16 +
    1)/6 = 31/6 for both directions. d(MSE_p)/dh_p = 2(h_p − h_i)/6 and d(MSE_p)/dh_i = 0 (the other model
    detached), the roles swapped for MSE_i: the total's gradient on h_p is 2(h_p − h_i)/6 once, not twice (which
    it would be with nothing detached) and not 0 (detached on the wrong side); a step on it brings h_p towards h_i."""
    hp = torch.tensor(H_P, requires_grad=True)
    hi = torch.tensor(H_I, requires_grad=True)
    mse_p, mse_i = feature_losses(hp, hi)
    assert mse_p.item() == pytest.approx(31 / 6) and mse_i.item() == pytest.approx(31 / 6)
    gp_p, gi_p = torch.autograd.grad(mse_p, [hp, hi], allow_unused=True, retain_graph=True)
    gp_i, gi_i = torch.autograd.grad(mse_i, [hp, hi], allow_unused=True, retain_graph=True)
    diff = np.array(H_P) - np.array(H_I)
    np.testing.assert_allclose(gp_p.numpy(), 2 * diff / 6, rtol=1e-6)
    np.testing.assert_allclose(gi_i.numpy(), -2 * diff / 6, rtol=1e-6)
    assert gi_p is None or not gi_p.any()
    assert gp_i is None or not gp_i.any()
    g_total = torch.autograd.grad(mse_p + mse_i, hp)[0]
    np.testing.assert_allclose(g_total.numpy(), 2 * diff / 6, rtol=1e-6)
    with torch.no_grad():
        assert feature_losses(hp - 0.5 * gp_p, hi)[0].item() < mse_p.item()


def test_feature_terms_refuse_features_of_different_sizes():
    with pytest.raises(ConfigError, match="strategy.params.pfedck.feature_weight"):
        feature_losses(torch.zeros(2, 3), torch.zeros(2, 4))


# --------------------------------------------------------------------------- the clustering


def test_clustering_recovers_planted_groups_whatever_the_update_size():
    """Two planted update directions, members of each with sizes spread over 100×: the unit-length rows group by
    direction; K-means on the raw rows would group by size instead."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    scales = [0.1, 10.0, 0.2, 8.0, 0.15, 12.0]
    updates = np.stack([s * (d + 0.1 * rng.standard_normal(50)) for s, d in zip(scales, [a, a, a, b, b, b])])
    labels, centroids = cluster_updates(updates, 2, None, np.random.default_rng(0))
    assert len(set(labels[:3])) == 1 and len(set(labels[3:])) == 1 and labels[0] != labels[3]
    assert centroids.shape == (2, 50)
    np.testing.assert_allclose(np.linalg.norm(unit_rows(updates), axis=1), 1.0)
    raw, _ = kmeans(updates, kmeans_plus_plus(updates, 2, np.random.default_rng(0)))
    assert not (len(set(raw[:3])) == 1 and len(set(raw[3:])) == 1)  # on the raw rows the sizes decide instead
    # warm start keeps the cluster ids; k is capped at the number of clients
    again, _ = cluster_updates(updates, 2, centroids, np.random.default_rng(99))
    np.testing.assert_array_equal(again, labels)
    one, _ = cluster_updates(updates[:1], 3, None, np.random.default_rng(0))
    assert one.tolist() == [0]


def test_server_clusters_by_update_and_averages_within_each_cluster(tiny_config):
    cfg = load_config(tiny_config(data={"num_clients": 5}, strategy={"name": "pfedck"}))
    s = resolve(cfg).build(cfg)
    sent = s.initial
    rng = np.random.default_rng(0)
    directions = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in sent.items()} for _ in range(2)]
    replies, trained = [], {}
    for cid, (group, scale, n) in enumerate([(0, 0.01, 10), (0, 0.5, 30), (1, 0.02, 20), (1, 0.3, 40)]):
        trained[cid] = {k: v + scale * directions[group][k] for k, v in sent.items()}
        replies.append(ClientReply(100 + cid, cid, n, {KL_PERSONAL: 0.1 * cid, KL_INTERACTIVE: 0.2}, trained[cid]))
    extra = s.aggregate(1, replies)
    assert extra["clusters"] == 2 and extra["cluster_sizes"] == "2 2"
    assert extra["pfedck_kl_personal"] == pytest.approx(0.15) and extra["pfedck_kl_interactive"] == pytest.approx(0.2)
    assert s.model_of[0] == s.model_of[1] != s.model_of[2] == s.model_of[3] and 4 not in s.model_of
    for members, weights in (((0, 1), (10, 30)), ((2, 3), (20, 40))):
        got = s.interactive_of(members[0])
        for k in sent:
            want = sum(w * trained[c][k] for c, w in zip(members, weights)) / sum(weights)
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7)
    assert s.interactive_of(4) is s.initial  # never heard from: the initial model
    # next round: client 1 alone replies; it forms its own cluster and the old model of 0 and 1 is kept for 0
    before = dict(s.models)
    s.aggregate(2, [ClientReply(101, 1, 30, {}, {k: v + 1.0 for k, v in s.interactive_of(1).items()})])
    assert s.model_of[0] in before and s.model_of[1] not in before and len(s.models) == 3


# --------------------------------------------------------------------------- the client


def test_client_trains_both_models_and_sends_the_interactive_one():
    grid, msg = worker_message([])
    ctx = grid.contexts[100]
    Worker(msg, ctx).run()
    start = {k: v.clone() for k, v in ctx.state[STATE_MODEL].to_torch_state_dict().items()}
    rng = np.random.default_rng(1)
    interactive = {k: (v.numpy() + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()}

    def settings(**own):
        own = {ALPHA: 0.0, BETA: 0.0, TEMPERATURE: 1.0, **own}
        return dict(
            returns=protocol.Return(arrays=True),
            training=protocol.Training(sections={SECTION: protocol.Section(extra=own)}),
        )

    _, msg = worker_message([TRAIN_OP], arrays=interactive, **settings())
    reply = Worker(msg, ctx).run()
    personal = ctx.state[STATE_MODEL].to_torch_state_dict()
    sent_back = {k: v.numpy() for k, v in reply.content[protocol.ARRAYS].items()}
    # α = β = 0: each model is trained by its own cross-entropy alone, on the same batches
    alone = {"p": start, "i": {k: torch.from_numpy(v) for k, v in interactive.items()}}
    fed = get_federation(data_spec(protocol.request_of(msg)))
    data = fed.client(0)
    for key, result in (("p", {k: v.numpy() for k, v in personal.items()}), ("i", sent_back)):
        model = build_model("mlp", 10, (1, 8, 8))
        model.load_state_dict(alone[key])
        gen = torch.Generator().manual_seed(derive_seed(0, "client-batches", 1, 0))
        ops.train(model, data.train_x, data.train_y, OptimSettings(epochs=1, batch_size=16, lr=0.05), None, gen)
        for k, v in model.state_dict().items():
            np.testing.assert_allclose(result[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{key}:{k}")
    assert reply.content[protocol.METRICS][KL_PERSONAL] > 0 and reply.content[protocol.METRICS][KL_INTERACTIVE] > 0
    # with distillation on, the personalised model ends elsewhere
    ctx2 = worker_message([])[0].contexts[100]
    Worker(worker_message([])[1], ctx2).run()
    _, msg = worker_message([TRAIN_OP], arrays=interactive, **settings(**{ALPHA: 1.0}))
    Worker(msg, ctx2).run()
    distilled = ctx2.state[STATE_MODEL].to_torch_state_dict()
    assert not torch.allclose(distilled["fc.weight"], personal["fc.weight"])


def test_client_feature_term_trains_each_model_towards_the_others_features():
    """α = β = 0, γ = 0.7: each model's trained state equals training on CE + γ·mean((h_own − h_other)²) with h the
    MLP's fc2 output (what its classifier reads), the other model's features constant — computed here by its
    layers, not through the strategy's hook. Removing the term, flipping its sign or detaching the wrong side
    gives other weights."""
    gamma = 0.7
    grid, msg = worker_message([])
    ctx = grid.contexts[100]
    Worker(msg, ctx).run()
    start = {k: v.clone() for k, v in ctx.state[STATE_MODEL].to_torch_state_dict().items()}
    rng = np.random.default_rng(2)
    interactive = {k: (v.numpy() + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()}
    own = {ALPHA: 0.0, BETA: 0.0, TEMPERATURE: 1.0, FEATURE_WEIGHT: gamma}
    _, msg = worker_message(
        [TRAIN_OP],
        arrays=interactive,
        returns=protocol.Return(arrays=True),
        training=protocol.Training(sections={SECTION: protocol.Section(extra=own)}),
    )
    reply = Worker(msg, ctx).run()
    got = {"p": ctx.state[STATE_MODEL].to_torch_state_dict(), "i": reply.content[protocol.ARRAYS]}
    assert reply.content[protocol.METRICS][FEATURE_MSE] > 0

    def features_and_logits(m, xb):
        h = m.fc2(m.fc1(xb.flatten(1)))
        return h, m.fc(h)

    def reference_loss(pair, xb, yb, _w):
        hp, zp = features_and_logits(pair.personal, xb)
        hi, zi = features_and_logits(pair.interactive, xb)
        own_p = F.cross_entropy(zp, yb) + gamma * ((hp - hi.detach()) ** 2).mean()
        own_i = F.cross_entropy(zi, yb) + gamma * ((hi - hp.detach()) ** 2).mean()
        return own_p + own_i

    fed = get_federation(data_spec(protocol.request_of(msg)))
    data = fed.client(0)
    pair = ModelPair(build_model("mlp", 10, (1, 8, 8)), build_model("mlp", 10, (1, 8, 8)))
    pair.personal.load_state_dict(start)
    pair.interactive.load_state_dict({k: torch.from_numpy(v) for k, v in interactive.items()})
    gen = torch.Generator().manual_seed(derive_seed(0, "client-batches", 1, 0))
    settings = OptimSettings(epochs=1, batch_size=16, lr=0.05)
    ops.run_epochs(pair, data.train_x, data.train_y, reference_loss, settings, generator=gen)
    for key, model in (("p", pair.personal), ("i", pair.interactive)):
        for k, v in model.state_dict().items():
            np.testing.assert_allclose(np.asarray(got[key][k].numpy()), v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    # and the term matters: without it the personalised model ends elsewhere
    plain = build_model("mlp", 10, (1, 8, 8))
    plain.load_state_dict(start)
    gen = torch.Generator().manual_seed(derive_seed(0, "client-batches", 1, 0))
    ops.train(plain, data.train_x, data.train_y, settings, None, gen)
    assert not torch.allclose(plain.state_dict()["fc1.0.weight"], got["p"]["fc1.0.weight"], atol=1e-6)


# --------------------------------------------------------------------------- the strategy


def test_params_are_declared_and_checked(tiny_config):
    params = resolve(load_config(tiny_config(strategy={"name": "pfedck"}))).params
    assert (params.clusters, params.alpha, params.beta, params.temperature, params.feature_weight) == (
        2,
        1.0,
        1.0,
        1.0,
        1.0,
    )
    for bad in ({"clusters": 0}, {"alpha": -1.0}, {"temperature": 0.0}, {"feature_weight": -1.0}):
        with pytest.raises(ConfigError, match=f"strategy.params.pfedck.{next(iter(bad))}"):
            resolve(load_config(tiny_config(strategy={"name": "pfedck", "params": {"pfedck": bad}})))
    with pytest.raises(ConfigError, match="data.num_clients"):
        resolve(load_config(tiny_config(strategy={"name": "pfedck", "params": {"pfedck": {"clusters": 9}}})))


@pytest.mark.heavy
def test_short_run_sends_one_model_each_way_and_personalises(tiny_config, tmp_path):
    import server_app

    cfg = tiny_config(rounds=3, data=PATHOLOGICAL, strategy={"name": "pfedck"})
    summaries, rows = [], []
    for i in (0, 1):
        summaries.append(server_app.run_experiment(InProcessGrid(4), str(cfg), "", str(tmp_path / str(i))))
        (run,) = [d for d in (tmp_path / str(i)).iterdir() if d.is_dir()]
        rows.append(
            [
                {k: v for k, v in r.items() if "seconds" not in k and not k.startswith("t_")}
                for r in read_csv(run / "rounds.csv")
            ]
        )
    assert rows[0] == rows[1]  # same seed, same rounds.csv
    initial = resolve(load_config(cfg)).build(load_config(cfg)).initial
    model_bytes = sum(len(a.data) for a in protocol.arrays_record(initial).values())  # one model as it travels
    for r in rows[0]:
        assert r["clusters"] == 2 and 4 * model_bytes < r["bytes_up"] < 4 * model_bytes + 4 * 2000
        assert 4 * model_bytes < r["bytes_down"] < 4 * model_bytes + 4 * 3000
    assert rows[0][-1]["acc_mean"] > rows[0][0]["acc_mean"]
    assert set(summaries[0]["cluster_assignment"]) == {"0", "1", "2", "3"}


@pytest.mark.heavy
def test_end_to_end_through_flowers_wire_format(tmp_path):
    """2 rounds of pFedCK on digits, 3 clients, every message, reply and node Context through Flower's protobuf
    encoding (:func:`conftest.wire_run`; the Ray path itself: test_cli_e2e.py)."""
    from conftest import wire_run

    out = wire_run(
        tmp_path,
        strategy={"name": "pfedck"},
        data={"source": "digits", "partition": "pathological", "num_clients": 3, "classes_per_client": 4},
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "pfedck" and summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [3, 3] and [r["replies_rejected"] for r in rows] == [0, 0]
    assert [r["clusters"] for r in rows] == [2, 2] and rows[1]["pfedck_kl_personal"] > 0
    assert rows[1]["pfedck_feature_mse"] > 0
