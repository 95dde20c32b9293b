"""FedAMP, Ditto, IFCA and FedPer: their maths by hand, the client operations they add, and short runs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import server_app
from deployed_toy import evaluate, finetuned, private, tensors
from fedapps.client.worker import STATE_MODEL, ProtocolError, Worker, model_arrays, split_models
from fedapps.config import ConfigError, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.wire import protocol
from fedapps.wire.protocol import ARRAYS, METRICS, ClientReply, pack_models
from strategies import resolve
from strategies.fedamp import (
    attention_weights,
    coupled_mu,
    flatten,
    median_nonzero,
    relative_attention_weights,
    squared_distances,
    unflatten,
)
from strategies.fedbabu import FINETUNE
from strategies.fedfomo import WEIGHTS
from strategies.fedprox import PROX_MU
from strategies.ifca import CHOICE, LOSSES, average_per_cluster
from test_ops_worker import train_settings, worker_message

RETURN = protocol.Return(arrays=True)  # the private model goes back

PATHOLOGICAL = {"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 2}


def run(cfg_path, tmp_path, grid=None):
    cfg = load_config(cfg_path, "")
    grid = grid or InProcessGrid(cfg.data.num_clients, record=True)
    return server_app.run_experiment(grid, str(cfg_path), "", str(tmp_path / "out")), grid


def mlp_state(seed: int) -> dict[str, np.ndarray]:
    model = build_model("mlp", 10, (1, 8, 8), seed=seed)
    return {k: v.numpy() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- FedAMP


def test_attention_weights_by_hand() -> None:
    d2 = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, 9.0], [4.0, 9.0, 0.0]])
    xi = attention_weights(d2, alpha_k=0.1, sigma=2.0)
    off = lambda d: 0.1 * np.exp(-d / 2.0) / 2.0  # noqa: E731
    assert xi[0, 1] == pytest.approx(off(1.0)) and xi[1, 2] == pytest.approx(off(9.0))
    assert xi[0, 0] == pytest.approx(1 - off(1.0) - off(4.0))
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    np.testing.assert_allclose(xi, xi.T)  # symmetric distances, symmetric attention
    # identical models: every other client gets α_K/σ
    np.testing.assert_allclose(attention_weights(np.zeros((3, 3)), 0.1, 2.0)[0], [0.9, 0.05, 0.05])


def test_relative_attention_weights_by_hand() -> None:
    # three models: squared distances 1, 4, 9; their median 4, so κ = 0.5 gives σ_r = 2; share 0.6 over n − 1 = 2
    d2 = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, 9.0], [4.0, 9.0, 0.0]])
    xi, sigma, alpha = relative_attention_weights(d2, kappa=0.5, share=0.6)
    assert sigma == pytest.approx(2.0) and alpha == pytest.approx(0.6 * 2.0 / 2)
    off = lambda d: 0.3 * np.exp(-d / 2.0)  # noqa: E731
    assert xi[0, 1] == pytest.approx(off(1.0)) and xi[1, 2] == pytest.approx(off(9.0))
    assert xi[0, 0] == pytest.approx(1 - off(1.0) - off(4.0))
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    assert (np.diagonal(xi) >= 1 - 0.6).all()  # the self-weight never drops below 1 − share
    # the same as the paper's formula with α = share·σ_r/(n − 1): a relative σ with a relative step
    np.testing.assert_allclose(xi, attention_weights(d2, alpha_k=0.6 * 2.0 / 2, sigma=2.0))
    # scale-free: distances 100× larger give the same weights (a fixed σ would give every neighbour ~0)
    np.testing.assert_allclose(relative_attention_weights(100 * d2, 0.5, 0.6)[0], xi)
    assert attention_weights(100 * d2, 0.3, 2.0)[0, 0] == pytest.approx(1.0)
    # zero distances do not count in the median; with none non-zero every other model gets share/(n − 1)
    d2z = np.array([[0.0, 0.0, 4.0], [0.0, 0.0, 4.0], [4.0, 4.0, 0.0]])
    assert median_nonzero(d2z) == 4.0 and relative_attention_weights(d2z, 1.0, 0.6)[1] == 4.0
    xi0, sigma0, alpha0 = relative_attention_weights(np.zeros((3, 3)), 1.0, 0.6)
    assert sigma0 == 0.0 and alpha0 == 0.0
    np.testing.assert_allclose(xi0[0], [0.4, 0.3, 0.3])


def test_fedamp_relative_sigma_logs_what_it_used(tiny_config) -> None:
    from strategies.fedamp import FedAMP

    cfg = load_config(
        tiny_config(
            strategy={
                "name": "fedamp",
                "params": {"fedamp": {"alpha_k": 1.0, "sigma": 1.0, "lam": 0.01, "kappa": 2.0, "share": 0.8}},
            }
        ),
        "",
    )
    resolve(cfg)  # (n − 1)·α_K/σ > 1 is refused only for a fixed σ
    strategy = FedAMP(cfg)
    n = len(strategy.initial)
    strategy.models = {0: np.zeros(n, np.float32), 1: np.full(n, 1e-2, np.float32), 2: np.full(n, 3e-2, np.float32)}
    u = strategy.anchors([0, 1, 2])
    pool = np.stack([strategy.models[c] for c in (0, 1, 2)])
    d2 = squared_distances(pool)
    xi, sigma, alpha = relative_attention_weights(d2, 2.0, 0.8)
    np.testing.assert_allclose(u[1], xi[1] @ pool, atol=1e-7)
    out = strategy.aggregate(1, [])
    assert out["attention_sigma"] == pytest.approx(sigma) and sigma == pytest.approx(
        2 * np.median(d2[np.triu_indices(3, 1)])
    )
    assert out["model_distance_sq_median"] == pytest.approx(median_nonzero(d2))
    assert out["attention_self_mean"] == pytest.approx(np.diagonal(xi).mean())
    assert out["attention_self_min"] == pytest.approx(np.diagonal(xi).min())
    assert out["attention_self_max"] == pytest.approx(np.diagonal(xi).max())
    assert out["attention_alpha"] == pytest.approx(alpha) and out["prox_mu"] == pytest.approx(0.01 / alpha)


def test_coupled_mu_is_lambda_over_the_rounds_step_capped_below_one_sgd_step() -> None:
    """μ = λ/α for the round's α (here 0.5 → μ = 0.2 at λ 0.1); 0 with no step (α = 0: every model alike); with SGD
    at lr 0.05, λ 1 and α 0.02 the product lr·λ/α = 2.5 is capped at the largest passing λ (0.399: 0.9975)."""
    assert coupled_mu(0.1, 0.5, 0.05) == (pytest.approx(0.2), False)
    assert coupled_mu(0.1, 0.0, 0.05) == (0.0, False)
    mu, capped = coupled_mu(1.0, 0.02, 0.05)
    assert capped and mu == pytest.approx(0.399 / 0.02) and 0.05 * mu < 1.0
    assert coupled_mu(1.0, 0.02, None) == (pytest.approx(50.0), False)  # no lr given (Adam, the drop-in): no cap


def test_fedamp_data_relative_sends_lambda_over_the_rounds_alpha_each_round(tiny_config) -> None:
    """κ > 0: round 1 (every model the initial one) has no step and sends μ = 0; a round whose pool has squared
    distances 1, 4 and 9 sends μ = λ/α_r with α_r = share·κ·median(d²)/(n − 1) = 0.6·0.5·4/2 = 0.6, so μ = 0.02/0.6.
    Fails if the proximal weight stays λ/α_K (= 2), is inverted (α_r/λ) or uses another round's step."""
    from strategies.fedamp import FedAMP

    lam, kappa, share = 0.02, 0.5, 0.6
    cfg = load_config(
        tiny_config(
            data={"num_clients": 3},
            strategy={"name": "fedamp", "params": {"fedamp": {"lam": lam, "kappa": kappa, "share": share}}},
        ),
        "",
    )
    InProcessGrid(cfg.data.num_clients)  # gives Message() the run identity it needs outside Flower's runtime
    strategy = FedAMP(cfg)
    strategy.nodes.node_to_client.update({10: 0, 11: 1, 12: 2})
    mu_of = lambda draft: draft.request.training.section(protocol.TRAIN).extra[PROX_MU]  # noqa: E731
    assert [mu_of(m) for m in strategy.round_messages(1, [10, 11, 12])] == [0.0, 0.0, 0.0]
    n = len(strategy.initial)
    # every entry 0, 1/√n and 3/√n: squared distances 1 (0–1), 9 (0–2) and 4 (1–2), median 4, σ_r = 2, α_r = 0.6
    strategy.models = {
        0: np.zeros(n, np.float32),
        1: np.full(n, 1 / np.sqrt(n), np.float32),
        2: np.full(n, 3 / np.sqrt(n), np.float32),
    }
    mus = [mu_of(m) for m in strategy.round_messages(2, [10, 11, 12])]
    alpha_r = share * kappa * 4.0 / 2
    np.testing.assert_allclose(mus, [lam / alpha_r] * 3, rtol=1e-4)
    assert strategy.aggregate(2, [])["prox_mu_capped"] == 0.0


def test_squared_distances_and_flattening() -> None:
    v = np.random.default_rng(0).normal(size=(5, 40)).astype(np.float32)
    brute = ((v[:, None, :] - v[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(v), brute, rtol=1e-4, atol=1e-3)
    state = mlp_state(0)
    keys = list(state)
    back = unflatten(flatten(state, keys), state, keys)
    assert all(np.array_equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in keys)


def test_fedamp_anchor_is_the_attention_mix_of_known_models(tiny_config) -> None:
    from strategies.fedamp import FedAMP

    cfg = load_config(
        tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {"alpha_k": 0.1, "sigma": 1.0}}}), ""
    )
    strategy = FedAMP(cfg)
    n = len(strategy.initial)
    strategy.models = {0: np.zeros(n, np.float32), 1: np.full(n, 1e-3, np.float32)}
    u = strategy.anchors([0, 7])  # client 7 has not replied yet: it counts with the initial model
    pool = np.stack([np.zeros(n), np.full(n, 1e-3), strategy.initial]).astype(np.float32)
    xi = attention_weights(squared_distances(pool), 0.1, 1.0)
    np.testing.assert_allclose(u[0], xi[0] @ pool, atol=1e-6)
    np.testing.assert_allclose(u[7], xi[2] @ pool, atol=1e-6)


def test_fedamp_refuses_a_config_with_possibly_negative_self_weight(tiny_config) -> None:
    with pytest.raises(ConfigError, match=r"alpha_k.*at most 0\.333"):
        resolve(
            load_config(
                tiny_config(strategy={"name": "fedamp", "params": {"fedamp": {"alpha_k": 1.0, "sigma": 1.0}}}), ""
            )
        )


def test_anchor_arrays_are_not_loaded_and_pull_the_model(tmp_path) -> None:
    """load-arrays false + train.prox_mu: the private model trains from where it was, towards the anchor."""
    anchor = {k: np.zeros_like(v) for k, v in mlp_state(0).items()}
    distances = {}
    for mu in (0.0, 10.0):
        grid, msg = worker_message(
            ["train"],
            load=protocol.Load(into_model=False),
            training=train_settings(extra={PROX_MU: mu}),
            returns=protocol.Return(arrays=True, part="params"),
            arrays=anchor,
        )
        reply = Worker(msg, grid.contexts[100]).run()
        sent = {k: v.numpy() for k, v in reply.content[ARRAYS].items()}
        assert set(sent) == {n for n, _ in build_model("mlp", 10, (1, 8, 8)).named_parameters()}
        distances[mu] = sum(float((v**2).sum()) for v in sent.values())  # ‖w − 0‖²
    initial = sum(float((v**2).sum()) for k, v in mlp_state(0).items())
    assert distances[0.0] > 0.5 * initial  # not loaded: training started from the client's own model
    assert distances[10.0] < 0.5 * distances[0.0]  # the proximal term carries gradient towards the anchor


# found by `make mutate`
def test_attention_weights_are_float64_and_their_rows_sum_to_one() -> None:
    xi = attention_weights(np.zeros((3, 3), np.float32), 0.1, 1.0)
    assert xi.dtype == np.float64
    np.testing.assert_allclose(xi.sum(axis=1), 1.0, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- Ditto


def test_train_received_sends_back_the_trained_copy_and_keeps_the_personal_model() -> None:
    global_state = mlp_state(3)
    grid, msg = worker_message(
        ["train-received", "train"],
        load=protocol.Load(into_model=False),
        training=train_settings(extra={PROX_MU: 0.1}),
        returns=RETURN,
        arrays=global_state,
    )
    ctx = grid.contexts[100]
    reply = Worker(msg, ctx).run()
    sent = {k: v.numpy() for k, v in reply.content[ARRAYS].items()}
    personal = {k: v.numpy() for k, v in ctx.state[STATE_MODEL].items()}
    assert "train-received-loss" in reply.content[METRICS]
    key = "fc.weight"
    assert not np.allclose(sent[key], global_state[key])  # the copy was trained
    assert not np.allclose(sent[key], personal[key])  # and it is not the personal model


def test_without_train_received_the_private_model_goes_back() -> None:
    grid, msg = worker_message(["train"], returns=RETURN)
    ctx = grid.contexts[100]
    reply = Worker(msg, ctx).run()
    sent = {k: v.numpy() for k, v in reply.content[ARRAYS].items()}
    personal = {k: v.numpy() for k, v in ctx.state[STATE_MODEL].items()}
    assert all(np.array_equal(sent[k], personal[k]) for k in sent)


# --------------------------------------------------------------------------- IFCA


def test_packed_models_split_back_and_bad_keys_are_refused() -> None:
    models = [mlp_state(0), mlp_state(1)]
    back = split_models(protocol.arrays_record(pack_models(models)))
    assert len(back) == 2 and all(np.array_equal(back[1][k].numpy(), models[1][k]) for k in models[1])
    with pytest.raises(ProtocolError, match="m<k>"):
        split_models(protocol.arrays_record({"weight": np.zeros(2)}))


def test_select_model_picks_the_lowest_training_loss() -> None:
    # a model trained on this client's data against an untrained one, in either order
    grid, msg = worker_message(["train"], client={"epochs": 5}, returns=RETURN)
    trained = {k: v.numpy() for k, v in Worker(msg, grid.contexts[100]).run().content[ARRAYS].items()}
    for order, expected in (([mlp_state(5), trained], 1), ([trained, mlp_state(5)], 0)):
        grid, msg = worker_message(
            ["select-model"],
            load=protocol.Load(into_model=False, multi=True),
            arrays=pack_models(order),
        )
        metrics = Worker(msg, grid.contexts[100]).run().content[METRICS]
        assert metrics[CHOICE] == expected
        losses = metrics[LOSSES]
        assert losses[expected] == min(losses) and len(losses) == 2


def test_average_per_cluster_by_hand() -> None:
    models = [{"w": np.zeros(2, np.float32)}, {"w": np.ones(2, np.float32)}, {"w": np.full(2, 7, np.float32)}]
    replies = [
        ClientReply(0, 0, 10, {CHOICE: 0}, {"w": np.array([1.0, 2.0], np.float32)}),
        ClientReply(1, 1, 30, {CHOICE: 0}, {"w": np.array([5.0, 6.0], np.float32)}),
        ClientReply(2, 2, 5, {CHOICE: 1}, {"w": np.array([9.0, 9.0], np.float32)}),
    ]
    new, sizes = average_per_cluster(models, replies)
    np.testing.assert_allclose(new[0]["w"], [4.0, 5.0])  # (10·1 + 30·5)/40, (10·2 + 30·6)/40
    np.testing.assert_allclose(new[1]["w"], [9.0, 9.0])
    np.testing.assert_allclose(new[2]["w"], [7.0, 7.0])  # nobody chose it: unchanged
    assert sizes == [2, 1, 0]


# --------------------------------------------------------------------------- FedPer


def test_body_selection_leaves_the_head_out() -> None:
    model = build_model("cnn", 10, (1, 28, 28))
    body = model_arrays(model, "body")
    assert set(body) == {k for k in model.state_dict() if not k.startswith("fc.")}  # `fc` is the CNN's head
    with pytest.raises(ProtocolError, match=protocol.ARRAYS_KEYS):
        model_arrays(model, "head")


# --------------------------------------------------------------------------- CFL


def test_cosine_similarity_and_split_criterion_by_hand() -> None:
    from strategies.cfl import cosine_similarities, should_split

    u = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]])
    sim = cosine_similarities(u)
    assert sim[0, 1] == pytest.approx(0.0) and sim[0, 2] == pytest.approx(-1.0)
    assert sim[3, 0] == 0.0 and sim[3, 3] == 1.0  # a zero update is similar to nothing but itself
    # mean of (1, 0) and (-3, 0) weighted 3:1 is (0, 0): converged as a whole, while one client pulls with norm 3
    split, mean_norm, max_norm = should_split(u[[0, 2]], np.array([3.0, 1.0]), eps1=0.1, eps2=2.0)
    assert split and mean_norm == pytest.approx(0.0) and max_norm == pytest.approx(3.0)
    assert not should_split(u[[0, 2]], np.array([3.0, 1.0]), eps1=0.1, eps2=3.5)[0]  # nobody pulls hard enough
    assert not should_split(u[[0, 1]], np.array([1.0, 1.0]), eps1=0.1, eps2=0.5)[0]  # not converged: mean ≈ 1.1


def test_bipartition_separates_opposite_updates() -> None:
    from strategies.cfl import bipartition, cosine_similarities

    rng = np.random.default_rng(0)
    v = rng.normal(size=50)
    updates = np.stack(
        [v + 0.1 * rng.normal(size=50) for _ in range(3)] + [-v + 0.1 * rng.normal(size=50) for _ in range(3)]
    )
    order = [3, 0, 4, 1, 5, 2]  # interleaved: rows 1, 3, 5 go with -v
    first, second = bipartition(cosine_similarities(updates[order]))
    assert first == [0, 2, 4] and second == [1, 3, 5]  # the group holding row 0 comes first


def test_cfl_splits_a_converged_cluster_with_disagreeing_clients(tiny_config) -> None:
    from strategies.cfl import CFL

    cfg = load_config(
        tiny_config(strategy={"name": "cfl", "params": {"cfl": {"eps1": 0.5, "eps2": 1.0, "warmup_rounds": 0}}}), ""
    )
    strategy = CFL(cfg)
    sent = strategy.models[0]
    key = strategy.parameter_keys[0]

    def reply(client: int, sign: float) -> ClientReply:
        arrays = {k: v.copy() for k, v in sent.items()}
        arrays[key] = arrays[key] + sign * 0.5  # a large update, opposite for the two groups
        return ClientReply(client, client, 10, {}, arrays)

    extra = strategy.aggregate(1, [reply(0, 1.0), reply(1, -1.0), reply(2, 1.0), reply(3, -1.0)])
    assert extra["clusters"] == 2 and strategy.cluster_of == {0: 0, 1: 1, 2: 0, 3: 1}
    # the mean of the opposite updates is zero: both halves start from the unchanged cluster model
    assert all(np.allclose(strategy.models[1][k], sent[k], atol=1e-6) for k in sent)
    messages = protocol.build_messages(strategy.round_messages(2, [10, 11]))  # unknown nodes go to cluster 0
    assert len(messages) == 2 and strategy.splits == [(1, 0, 1)]


# --------------------------------------------------------------------------- FedFomo


def test_fomo_weights_and_mixing_by_hand() -> None:
    from strategies.fedfomo import fomo_weights, mix_towards, state_distance

    # own loss 1.0; candidate 0 helps (loss 0.5 at distance 2), candidate 1 hurts, candidate 2 helps (0.8 at 0.2)
    w = fomo_weights(1.0, [0.5, 1.5, 0.8], [2.0, 1.0, 0.2])
    raw = [0.25, 0.0, 1.0]
    assert w == pytest.approx([r / sum(raw) for r in raw])
    assert fomo_weights(1.0, [1.2, 1.0], [1.0, 1.0]) == [0.0, 0.0]  # nobody helps: keep the own model
    own = {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(3)}
    cands = [
        {"w": torch.tensor([4.0, 0.0]), "n": torch.tensor(9)},
        {"w": torch.tensor([0.0, 8.0]), "n": torch.tensor(9)},
    ]
    mixed = mix_towards(own, cands, [0.25, 0.75])
    assert torch.allclose(mixed["w"], torch.tensor([1.0, 6.0])) and int(mixed["n"]) == 3  # integer buffer kept
    assert state_distance(own, cands[0]) == pytest.approx(4.0)


def test_candidates_follow_affinity_and_exploration_keeps_them_distinct() -> None:
    from strategies.fedfomo import choose_candidates

    aff = {3: 0.9, 1: 0.5, 7: 0.5, 2: 0.0}
    rng = np.random.default_rng(0)
    assert choose_candidates(aff, [1, 2, 3, 7], 3, 0.0, rng) == [3, 1, 7]  # ties: lower id
    assert choose_candidates(aff, [1, 2, 3, 7], 9, 0.0, rng) == [3, 1, 7, 2]
    for _ in range(200):
        picked = choose_candidates(aff, [1, 2, 3, 7], 3, 1.0, rng)
        assert len(picked) == 3 and len(set(picked)) == 3 and set(picked) <= {1, 2, 3, 7}
    assert choose_candidates({}, [], 5, 0.5, rng) == []


def test_holdout_split_is_fixed_and_disjoint() -> None:
    from fedapps.client.worker import holdout_split

    fit, held = holdout_split(50, 0.2, seed=4)
    assert len(held) == 10 and len(fit) == 40 and not set(fit.tolist()) & set(held.tolist())
    again_fit, again_held = holdout_split(50, 0.2, seed=4)
    assert torch.equal(held, again_held) and torch.equal(fit, again_fit)
    with pytest.raises(ProtocolError, match=protocol.HOLDOUT_FRACTION):
        holdout_split(50, 1.0, seed=4)


def test_fomo_mix_moves_towards_a_better_model_and_reports_weights() -> None:
    grid, msg = worker_message(["train"], client={"epochs": 5}, returns=RETURN)
    trained = {k: v.numpy() for k, v in Worker(msg, grid.contexts[100]).run().content[ARRAYS].items()}
    grid, msg = worker_message(
        ["fomo-mix", "evaluate"],
        load=protocol.Load(multi=True),
        training=protocol.Training(holdout_fraction=0.2),
        arrays=pack_models([mlp_state(7), trained]),
    )
    metrics = Worker(msg, grid.contexts[100]).run().content[METRICS]
    weights = metrics[WEIGHTS]
    # the trained model takes (nearly) all the weight; another untrained one can at best be marginally better
    assert sum(weights) == pytest.approx(1.0) and weights[1] > 0.95
    assert metrics["eval-acc"] > 0.5  # the untrained own model moved (almost) all the way to the trained one


# --------------------------------------------------------------------------- FedRep, FedBABU: frozen parts


def changed_parts(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    """Which of head ('fc.*') and body moved."""
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    return {"head" if k.startswith("fc.") else "body" for k in moved}


@pytest.mark.parametrize(
    "ops_list,sections,expected",
    [
        (["train"], {protocol.TRAIN: protocol.Section(freeze="head")}, {"body"}),
        (["train"], {protocol.TRAIN: protocol.Section(freeze="body")}, {"head"}),
        (["train"], {}, {"head", "body"}),
        (
            ["train:head"],
            {
                protocol.train_section("head"): protocol.Section(freeze="body"),
                protocol.TRAIN: protocol.Section(freeze="head"),
            },
            {"head"},
        ),  # the tagged section wins
    ],
)
def test_freeze_keeps_a_part_fixed(ops_list, sections, expected) -> None:
    grid, msg = worker_message(ops_list, returns=RETURN, training=protocol.Training(sections=sections))
    after = {k: v.numpy() for k, v in Worker(msg, grid.contexts[100]).run().content[ARRAYS].items()}
    assert changed_parts(mlp_state(0), after) == expected


def test_unknown_part_to_freeze_is_an_error() -> None:
    grid, msg = worker_message(["train"], training=train_settings(freeze="tail"))
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error() and "allowed: none, head, body" in reply.error.reason


def test_evaluate_finetuned_trains_a_copy_of_the_head_only() -> None:
    grid, msg = worker_message(
        ["evaluate:plain", "evaluate-finetuned"],
        training=protocol.Training(sections={FINETUNE: protocol.Section(epochs=5)}),
    )
    ctx = grid.contexts[100]
    metrics = Worker(msg, ctx).run().content[METRICS]
    kept = {k: v.numpy() for k, v in ctx.state[STATE_MODEL].items()}
    assert changed_parts(mlp_state(0), kept) == set()  # the model itself did not move
    assert metrics["eval-acc"] > metrics["plain-acc"] + 0.2  # a trained head on the random body beats none


@pytest.mark.parametrize("part,moved", [("full", {"head", "body"}), ("head", {"head"})])
def test_fedbabu_finetune_part_decides_what_the_evaluated_copy_changes(tiny_config, monkeypatch, part, moved) -> None:
    """FedBABU's own finetune.* section (built by the strategy from ``finetune_part``) through the client operation:
    the copy it evaluates moved in body and head (full) or in the head alone (head); the model itself in neither."""
    from strategies.fedbabu import FedBABU

    cfg = load_config(tiny_config(strategy={"name": "fedbabu", "params": {"fedbabu": {"finetune_part": part}}}), "")
    finetune = FedBABU(cfg).client_settings()[FINETUNE]
    assert (finetune.lr, finetune.momentum, finetune.epochs) == (1e-3, 0.9, 5)  # the authors' evaluation
    evaluated: list[dict[str, np.ndarray]] = []

    def keep(_self, model, _tag) -> None:
        evaluated.append({k: v.numpy() for k, v in model.state_dict().items()})

    monkeypatch.setattr(Worker, "evaluate", keep)  # the copy the operation evaluates
    grid, msg = worker_message(["evaluate-finetuned"], training=protocol.Training(sections={FINETUNE: finetune}))
    ctx = grid.contexts[100]
    Worker(msg, ctx).run()
    assert changed_parts(mlp_state(0), evaluated[0]) == moved
    assert changed_parts(mlp_state(0), {k: v.numpy() for k, v in ctx.state[STATE_MODEL].items()}) == set()


# --------------------------------------------------------------------------- end to end


# FedAMP with λ/α_K = 1: the coupling this test had before the coefficient became λ/(2α_K)
@pytest.mark.parametrize(
    "name,params",
    [
        ("fedamp", {"alpha_k": 0.05, "lam": 0.05}),
        ("ditto", {"lam": 0.1}),
        ("ifca", {"clusters": 2}),
        ("fedper", None),
        ("fedrep", {"head_epochs": 2}),
        ("fedbabu", {"finetune_epochs": 2}),
        ("cfl", {"warmup_rounds": 1}),
        ("fedfomo", {"candidates": 2}),
    ],
)
def test_short_runs_learn_and_send_what_they_should(tiny_config, tmp_path, name, params) -> None:
    strategy = {"name": name} if params is None else {"name": name, "params": {name: params}}
    summary, grid = run(tiny_config(rounds=3, strategy=strategy, data=PATHOLOGICAL), tmp_path)
    assert summary["strategy"] == name and summary["accuracy_mean"] > 0.6
    sent = [m for m in grid.sent if m.metadata.group_id == "2"]
    replies = [m for m in grid.replies if not m.has_error() and m.metadata.message_type == "train"]
    assert len(sent) == 4 and all(ARRAYS in m.content for m in sent + replies)
    if name == "fedfomo":  # round 2: two other clients' models each, and weights back for both
        assert all(len(m.content[ARRAYS]) == 2 * len(build_model("mlp", 10, (1, 8, 8)).state_dict()) for m in sent)
        assert all(len(m.content[METRICS][WEIGHTS]) == 2 for m in replies if m.metadata.group_id == "2")
    model_keys = set(build_model("mlp", 10, (1, 8, 8)).state_dict())
    head = {"fc.weight", "fc.bias"}  # the MLP's classifier
    if name in ("ifca", "cfl"):
        assert sorted(summary["cluster_assignment"]) == ["0", "1", "2", "3"]
    if name == "ifca":
        assert len(sent[0].content[ARRAYS]) == 2 * len(model_keys)  # both cluster models go to every client
    if name in ("fedper", "fedrep", "fedbabu"):  # the personal head never travels
        for m in sent + replies:
            assert not set(m.content[ARRAYS]) & head
    if name == "fedbabu":  # the head is never trained: every client still has the initial one
        for ctx in grid.contexts.values():
            assert changed_parts(mlp_state(0), {k: v.numpy() for k, v in ctx.state[STATE_MODEL].items()}) <= {"body"}
    if name == "fedamp":  # anchors differ per client once models differ
        a, b = (m.content[ARRAYS] for m in sent[:2])
        key = next(iter(a))
        assert not np.allclose(a[key].numpy(), b[key].numpy())


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def ifca_by_hand(s, grid, cid, data, rnd):
    """IFCA: of the K cluster models, the one of lowest loss on the client's training split (ties: lower k)."""
    train = SimpleNamespace(test_x=data.train_x, test_y=data.train_y)
    losses = [evaluate(tensors(m), train)["loss"] for m in s.models]
    return evaluate(tensors(s.models[int(np.argmin(losses))]), data)


def cfl_by_hand(s, grid, cid, data, rnd):
    """CFL: the model of the client's cluster after that round's splits."""
    return evaluate(tensors(s.models[s.cluster_of.get(cid, 0)]), data)


def body_by_hand(s, grid, cid, data, rnd):
    """FedPer, FedRep: that round's aggregated body under the client's own head."""
    return evaluate({**private(grid, cid), **tensors(s.body)}, data)


def fedbabu_by_hand(s, grid, cid, data, rnd):
    """FedBABU: that round's body under the client's frozen head, fine-tuned on its train split as round rnd+1's
    message does it: the whole model (finetune_part full, its own SGD lr and momentum) or the head alone (head)."""
    p = s.params
    section = protocol.Section(
        epochs=p.finetune_epochs, lr=p.finetune_lr, momentum=p.finetune_momentum, optimizer="sgd"
    )
    keep = "none" if p.finetune_part == "full" else "body"
    return finetuned(s, {**private(grid, cid), **tensors(s.body)}, data, rnd, cid, section, keep)


DEPLOYED_BY_HAND = {
    "ifca": ifca_by_hand,
    "cfl": cfl_by_hand,
    "fedper": body_by_hand,
    "fedrep": body_by_hand,
    "fedbabu": fedbabu_by_hand,
}
