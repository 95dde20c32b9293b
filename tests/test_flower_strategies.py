"""The drop-in strategies (fedapps.flower_strategies) with a ClientApp written as Flower's quickstart-pytorch writes
one (tests/apps/quickstart_twin): Flower's own ``Strategy.start`` drives them; each node is sent its personalised
model, checked against the formulas written out here; p̂ from class counts, the bias estimate, partial participation,
bad replies; Flower's DP wrappers and evaluate_fn; and, through `flwr run`, the same personalised models as the app's
own cwFedAvg."""

from __future__ import annotations

import csv
import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Result,
    Strategy,
)

import strategies.cwfedavg as cw
from fedapps import flower_strategies
from fedapps.flower.faults import ReplyDropped
from fedapps.flower.inprocess import InProcessGrid
from fedapps.flower_strategies import CFL, PARTITION_ID, PROXIMAL_MU, CwFedAvg, FedAMP, FedPer, Local, PFedHN
from fedapps.models import build_model, classifier_name
from fedapps.server.dropin import classifier_from_arrays, only_arrays, only_metrics, parameter_keys, reply_problem
from fedapps.wire import protocol

TWIN = Path(__file__).parent / "apps" / "quickstart_twin"
if str(TWIN) not in sys.path:
    sys.path.insert(0, str(TWIN))
from quickstart_twin.client_app import app as twin_client  # noqa: E402
from quickstart_twin.task import load_data  # noqa: E402

from conftest import ACTOR_CPUS, run_in_process  # noqa: E402

RUN_CONFIG = {  # the twin's [tool.flwr.app.config], as the tests run it in-process
    "seed": 0,
    "source": "digits",
    "partition": "pathological",
    "classes-per-client": 2,
    "batch-size": 16,
    "lr": 0.05,
    "local-epochs": 1,
    "send-class-counts": False,
    "send-partition-id": False,
    "keep-model": False,
    "keep-model-phases": "",
    "dump-dir": "",
}


def twin_grid(num_nodes: int = 4, mods=(), **run_config) -> InProcessGrid:
    """An in-process grid whose nodes run the quickstart twin's ClientApp (Flower's large node ids)."""
    served = [*mods, lambda msg, ctx, call_next: twin_client(msg, ctx)]
    grid = InProcessGrid(num_nodes, mods=served, record=True, first_node_id=2**63 + 11)
    for ctx in grid.contexts.values():
        ctx.run_config = {**RUN_CONFIG, **run_config}
    return grid


def initial_arrays(seed: int = 0) -> ArrayRecord:
    return ArrayRecord(build_model("mlp", 10, (1, 8, 8), seed=seed).state_dict())


def values(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def last_round(grid: InProcessGrid, kind: str) -> list[Message]:
    """The messages (kind 'sent') or replies (kind 'replies') of the last training or evaluation exchange."""
    items = grid.sent if kind == "sent" else grid.replies
    return items[-len(grid.contexts) :]


def partition(grid: InProcessGrid, node: int) -> int:
    return int(grid.contexts[node].node_config["partition-id"])


@pytest.fixture(scope="module")
def norm_run():
    """The drop-in with the norm estimator, 4 nodes, 2 rounds: (strategy, grid, result)."""
    grid = twin_grid()
    strategy = CwFedAvg(estimator="norm")
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    return strategy, grid, result


# --------------------------------------------------------------------------- a Flower strategy, driven by Flower


def test_cwfedavg_is_a_flower_strategy_that_flowers_start_drives_to_a_result(norm_run):
    strategy, grid, result = norm_run
    assert isinstance(strategy, Strategy)
    assert isinstance(result, Result)
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2] and sorted(result.train_metrics_clientapp) == [1, 2]
    # per round: a train and an evaluate message to each of the 4 nodes, under Flower's convention
    assert [m.metadata.message_type for m in grid.sent] == (["train"] * 4 + ["evaluate"] * 4) * 2
    assert all(set(m.content.config_records) == {protocol.CONFIG} for m in grid.sent)
    # Result.arrays: the FedAvg model of the last uploads (sample-weighted mean), as Flower's FedAvg would return
    uploads = [(values(only_arrays(r)), only_metrics(r)[protocol.NUM_EXAMPLES]) for r in grid.replies[8:12]]
    n = np.array([float(k) for _, k in uploads])
    for key, got in values(result.arrays).items():
        expected = sum(w * a[key] for (a, _), w in zip(uploads, n / n.sum(), strict=True))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_each_node_is_sent_its_personalised_model_by_the_papers_formulas(norm_run):
    """The round-2 evaluation messages against cwFedAvg written out: p̂_l from the row norms of client l's upload,
    q_lj = n_l p̂_lj / Σ_m n_m p̂_mj, w_j^G = Σ_l q_lj w_l, w_i = Σ_j p̂_ij w_j^G on the classifier; FedAvg elsewhere."""
    strategy, grid, _ = norm_run
    replies = grid.replies[8:12]
    nodes = [r.metadata.src_node_id for r in replies]
    w = [values(only_arrays(r)) for r in replies]
    n = np.array([float(only_metrics(r)[protocol.NUM_EXAMPLES]) for r in replies])
    norms = np.array([[np.sqrt((row.astype(np.float64) ** 2).sum()) for row in a["fc.weight"]] for a in w])
    p = norms / norms.sum(axis=1, keepdims=True)
    q = n[:, None] * p / (n[:, None] * p).sum(axis=0, keepdims=True)
    sent = {m.metadata.dst_node_id: values(m.content[protocol.ARRAYS]) for m in grid.sent[12:16]}
    personal = []
    for i, node in enumerate(nodes):
        for key in w[0]:
            if key.startswith("fc."):  # the classifier: class-wise
                class_models = [sum(q[c, j] * w[c][key] for c in range(4)) for j in range(10)]
                expected = sum(p[i, j] * class_models[j] for j in range(10))
            else:
                expected = sum(n[c] * w[c][key] for c in range(4)) / n.sum()
            np.testing.assert_allclose(sent[node][key], expected, rtol=1e-5, atol=1e-6, err_msg=key)
        personal.append(sent[node]["fc.weight"])
    assert not np.allclose(personal[0], personal[1])  # personalised: not one model for all
    # the strategy's accessor gives what the nodes were sent
    for node in nodes:
        np.testing.assert_array_equal(values(strategy.personalised_arrays(node))["fc.weight"], sent[node]["fc.weight"])


def test_class_counts_sent_by_a_client_are_its_estimate():
    grid = twin_grid(**{"send-class-counts": True})
    strategy = CwFedAvg(estimator="norm")
    strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    for node in grid.contexts:
        _, _, counts = load_data(partition(grid, node), 4, RUN_CONFIG)
        row = strategy.stack.row_of[node]
        np.testing.assert_allclose(strategy.p_hat[row], counts / counts.sum())


def test_the_bias_estimate_finds_each_clients_classes():
    """Without counts or WDR: after one round p̂ is zero exactly on the classes a client does not hold."""
    grid = twin_grid()
    strategy = CwFedAvg()  # the default estimator: bias
    strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    for node in grid.contexts:
        _, _, counts = load_data(partition(grid, node), 4, RUN_CONFIG)
        p_hat = strategy.p_hat[strategy.stack.row_of[node]]
        assert np.all(p_hat[counts == 0] == 0) and p_hat[counts > 0].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("mix", ["latest", "round"])
def test_partial_participation_mixes_as_the_app_does(mix):
    """Two of four nodes a round: `latest` mixes every node heard from, `round` only this round's; a node never heard
    from gets the FedAvg model of that set (what aggregate_train returned)."""
    random.seed(3)  # Flower's sample_nodes draws with `random`
    grid = twin_grid()
    strategy = CwFedAvg(mix=mix, fraction_train=0.5, min_train_nodes=2, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    rounds = [grid.sent[:2], grid.sent[2:4]]
    last = {m.metadata.dst_node_id for m in rounds[1]}
    seen = {m.metadata.dst_node_id for m in rounds[0]} | last
    assert len(grid.sent) == 4 and len(last) == 2
    rows = {node: strategy.stack.row_of[node] for node in seen}
    mixed = {node for node, row in rows.items() if np.any(strategy.q[row] > 0)}
    assert mixed == (seen if mix == "latest" else last)
    unseen = [node for node in grid.contexts if node not in seen]
    if unseen:
        for key, got in values(strategy.personalised_arrays(unseen[0])).items():
            np.testing.assert_allclose(got, result.arrays[key].numpy(), rtol=1e-6, atol=1e-7)


def test_a_malformed_reply_is_left_out_with_its_reason(caplog):
    bad_node = 2**63 + 12

    def corrupt(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        if msg.metadata.dst_node_id == bad_node and msg.metadata.message_type == "train":
            arrays = only_arrays(reply)
            arrays["fc.weight"] = Array(np.zeros((3, 3), np.float32))
        return reply

    grid = twin_grid(mods=[corrupt])
    strategy = CwFedAvg()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert bad_node not in strategy.stack.row_of and len(strategy.stack.row_of) == 3
    assert any(f"node {bad_node} sent arrays that do not match the model" in r.getMessage() for r in caplog.records)


def test_a_reply_without_num_examples_is_left_out():
    msg = Message(RecordDict({protocol.METRICS: MetricRecord({"acc": 0.5})}), dst_node_id=1, message_type="evaluate")
    assert (
        reply_problem(msg, protocol.NUM_EXAMPLES, training=False) == "no positive 'num-examples' in its metrics (None)"
    )
    assert reply_problem(msg, protocol.NUM_EXAMPLES, training=True) == "0 ArrayRecords (expected one)"


# --------------------------------------------------------------------------- the output layer and the arguments


@pytest.mark.parametrize(("name", "shape"), [("mlp", (1, 8, 8)), ("cnn", (1, 28, 28))])
def test_the_output_layer_is_found_in_the_arrays_as_the_app_finds_it(name, shape):
    model = build_model(name, 10, shape, seed=0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert classifier_from_arrays(state) == classifier_name(model)
    with pytest.raises(ValueError, match="classifier='fc'"):
        classifier_from_arrays({"conv.weight": np.zeros((2, 1, 3, 3))})


def test_a_named_classifier_and_bad_arguments():
    grid = twin_grid(2)
    strategy = CwFedAvg(classifier="fc1.0", estimator="norm")  # the first hidden layer as the 'classifier'
    strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    assert strategy.classwise == ["fc1.0.weight", "fc1.0.bias"] and strategy.p_hat.shape[1] == 200
    with pytest.raises(ValueError, match="estimator is 'true'; allowed: bias, norm"):
        CwFedAvg(estimator="true")
    with pytest.raises(ValueError, match="pass model=... with it"):
        CwFedAvg(layers="last-2")
    assert CwFedAvg(model=build_model("mlp", 10, (1, 8, 8)), layers="last-2").model_classwise == [
        "fc2.0.weight",
        "fc2.0.bias",
        "fc.weight",
        "fc.bias",
    ]


def test_the_client_terms_are_the_apps_own():
    assert flower_strategies.wdr_penalty is cw.wdr_penalty  # the function the app's WDR training term calls
    assert flower_strategies.CLASS_COUNTS == cw.CLASS_COUNTS


# --------------------------------------------------------------------------- Flower's DP wrappers and evaluate_fn


def update_norm(sent: Message, reply: Message) -> float:
    """The L2 norm over every array of a node's upload minus the model it was sent."""
    before, after = values(sent.content[protocol.ARRAYS]), values(only_arrays(reply))
    return float(np.sqrt(sum(((after[k].astype(np.float64) - before[k]) ** 2).sum() for k in before)))


@pytest.mark.parametrize("side", ["server", "client"])
def test_flowers_central_dp_noise_never_reaches_the_personalised_models(side):
    """Either central-DP wrapper adds its noise to what aggregate_train returns (Result.arrays): with noise std 250
    there, the models the nodes are sent next are the noise-free personalised ones. (Client side: Flower's
    fixedclipping_mod clips each update against the model that node was sent.)"""
    wrapper = {
        "server": DifferentialPrivacyServerSideFixedClipping,
        "client": DifferentialPrivacyClientSideFixedClipping,
    }[side]
    grid = twin_grid(mods=[fixedclipping_mod] if side == "client" else [])
    strategy = wrapper(CwFedAvg(), noise_multiplier=1000.0, clipping_norm=1.0, num_sampled_clients=4)
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    assert max(float(np.abs(v).max()) for v in values(result.arrays).values()) > 100
    round_two = [values(m.content[protocol.ARRAYS]) for m in grid.sent[8:12]]
    assert max(float(np.abs(v).max()) for a in round_two for v in a.values()) < 5
    if side == "client":
        assert max(update_norm(m, r) for m, r in zip(grid.sent[8:12], grid.replies[8:12], strict=True)) <= 1.0 + 1e-5


def test_flowers_local_dp_mod_clips_against_the_personalised_model():
    """LocalDpMod on the client clips the update against the model that node was sent (its personalised model from
    round 2 on) before noising it: every upload the server mixes is already private, the mixing is post-processing."""
    local_dp = LocalDpMod(clipping_norm=0.5, sensitivity=0.5, epsilon=1e6, delta=1e-5)  # noise ~1e-6: the clip shows
    grid = twin_grid(mods=[local_dp])
    CwFedAvg().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2, timeout=600)
    sent, replies = grid.sent[8:12], grid.replies[8:12]
    assert len({values(m.content[protocol.ARRAYS])["fc.weight"].tobytes() for m in sent}) == 4  # personalised
    norms = [update_norm(m, r) for m, r in zip(sent, replies, strict=True)]
    assert max(norms) == pytest.approx(0.5, abs=1e-3)  # clipped (unclipped updates here are larger than 0.5)


def test_evaluate_fn_sees_the_global_aggregate_and_may_ask_for_each_nodes_model():
    seen: dict[int, tuple[dict[str, np.ndarray], list[np.ndarray]]] = {}
    grid = twin_grid(2)
    strategy = CwFedAvg()

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        personal = [values(strategy.personalised_arrays(n))["fc.weight"] for n in grid.contexts] if server_round else []
        seen[server_round] = (values(arrays), personal)
        return MetricRecord({"checked": 1})

    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2, evaluate_fn=evaluate_fn)
    assert sorted(seen) == [0, 1, 2] and sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    np.testing.assert_array_equal(seen[0][0]["fc.weight"], initial_arrays()["fc.weight"].numpy())
    np.testing.assert_array_equal(seen[2][0]["fc.weight"], result.arrays["fc.weight"].numpy())
    assert not np.allclose(seen[2][1][0], seen[2][1][1])  # each node's own model, asked for inside evaluate_fn


# --------------------------------------------------------------------------- equivalence with the app, through flwr run


APP_TWINS = {  # drop-in name -> the app's strategy section it is compared with
    "cwfedavg": {"name": "cwfedavg", "params": {"cwfedavg": {"wdr_lambda": 0.0, "estimator": "norm"}}},
    "fedper": {"name": "fedper"},
    "local": {"name": "local"},
    # a split in round 1 on any update (eps1 large, eps2 tiny), of the 4 clients only: clusters of 2 split no further
    "cfl": {"name": "cfl", "params": {"cfl": {"eps1": 100.0, "eps2": 1e-6, "warmup_rounds": 1}}},
    "pfedhn": {"name": "pfedhn"},
}
TWIN_SETTINGS = {
    "cfl": "cfl-eps1=100.0 cfl-eps2=1e-6 cfl-warmup-rounds=1",
    "pfedhn": "send-partition-id=true pfedhn-num-nodes=4",
    # FedAMP's clients keep their models (the documented pattern): its own test below reads this run too
    "fedamp": 'keep-model=true keep-model-phases="fedamp" fedamp-lam=0.1 fedamp-kappa=1.0',
}
TWIN_STRATEGIES = sorted([*APP_TWINS, "fedamp"])


def withhold_identify(msg, ctx, call_next):
    """A client mod under which a node does not answer the app's identify message: the app then treats it as the
    drop-in treats every node before its first reply (pFedHN: the mean embedding's model in round 1)."""
    if msg.metadata.message_type == protocol.QUERY_MESSAGE_TYPE:
        raise ReplyDropped("identify withheld")
    return call_next(msg, ctx)


APP_MODS = {"pfedhn": [withhold_identify]}


TWIN_ROUNDS = 3


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory):
    """ONE `flwr run` of the quickstart twin (Ray simulation, 4 SuperNodes, 3 rounds) running every drop-in of
    APP_TWINS and FedAMP (TWIN_STRATEGIES), one after another from the same initial model (each strategy's dumps in a
    folder of its name; each SuperNode sends its partition id, which only pFedHN reads; only under FedAMP do the
    clients keep their models): (the run, the dump folder). One run instead of one per strategy: a `flwr run` costs
    ~15 CPU-seconds before its first round."""
    from fedapps_tools.appruns import run_app

    dump = tmp_path_factory.mktemp("twin-dump")
    settings = " ".join(TWIN_SETTINGS.values())
    run_config = f'num-server-rounds={TWIN_ROUNDS} strategy="{",".join(TWIN_STRATEGIES)}" dump-dir="{dump}" {settings}'
    return run_app(TWIN, run_config, num_supernodes=4, cpus_per_client=int(ACTOR_CPUS)), dump


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(APP_TWINS))
def test_through_flwr_run_the_drop_in_gives_the_apps_personalised_models(name, twin_run, tmp_path, tiny_config):
    """The quickstart twin with the drop-in strategy under `flwr run` (Ray simulation, 4 SuperNodes; :func:`twin_run`)
    and the app's own strategy (cwFedAvg: wdr_lambda 0, estimator norm) on the same partition, seed and initial
    model, 3 rounds. Every round, each client's personalised model is the same to float tolerance where the app sends
    it (cwFedAvg: the whole model; FedPer: the body — its head never leaves the app's client), and each client's
    accuracy is the same (for Local, whose models never leave the app's clients, that is the comparison). pFedHN: the
    twin sends its partition id (the drop-in's embedding of the node) and the app's nodes withhold their identify
    reply, so that both send every node the mean embedding's model in round 1 (a plain Flower client cannot be
    identified before its first reply). The twin's DataLoader draws the app's minibatch order; what remains is float
    rounding (collation, the order replies arrive in)."""
    run, dumps = twin_run
    assert run.completed, run.log[-4000:]
    rounds = TWIN_ROUNDS
    dump = dumps / name

    cfg = tiny_config(
        rounds=rounds,
        strategy=APP_TWINS[name],
        data={"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 2},
    )
    grid = InProcessGrid(4, record=True, mods=APP_MODS.get(name))
    _, run_dir = run_in_process(cfg, tmp_path / "app", grid)
    # the app's model after round r is what its round-(r+1) message carries (after the last round: an evaluation)
    app_models: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for msg in grid.sent:
        if protocol.ARRAYS in msg.content.array_records:
            rnd = protocol.request_of(msg).round - 1
            app_models[(partition(grid, msg.metadata.dst_node_id), rnd)] = protocol.record_values(
                msg.content[protocol.ARRAYS]
            )
    with open(run_dir / "rounds.csv") as f:
        app_rounds = list(csv.DictReader(f))
    compared = 0
    for client in range(4):
        for rnd in range(1, rounds + 1):
            twin = np.load(dump / f"client{client}-round{rnd}.npz")
            for key, value in app_models.get((client, rnd), {}).items():
                np.testing.assert_allclose(twin[key], value, rtol=1e-4, atol=1e-6, err_msg=f"{client} {rnd} {key}")
                compared += 1
            app_acc = float(app_rounds[rnd - 1][f"acc_client_{client}"])  # its deployed model after round rnd
            assert float(twin["acc"]) == pytest.approx(app_acc, abs=1e-9), (client, rnd)
    per_round = {"cwfedavg": 6, "fedper": 4, "local": 0, "cfl": 6, "pfedhn": 6}[name]  # arrays the app sends
    assert compared == 4 * 3 * per_round
    if name == "cfl":  # the split happened in round 1: two clusters, two models
        assert len({np.load(dump / f"client{c}-round2.npz")["fc.weight"].tobytes() for c in range(4)}) == 2


# --------------------------------------------------------------------------- FedPer and Local


def test_fedper_sends_the_averaged_body_under_each_nodes_own_head():
    grid = twin_grid()
    strategy = FedPer()
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    uploads = {r.metadata.src_node_id: values(only_arrays(r)) for r in grid.replies[8:12]}
    n = {r.metadata.src_node_id: float(only_metrics(r)[protocol.NUM_EXAMPLES]) for r in grid.replies[8:12]}
    total = sum(n.values())
    for msg in grid.sent[12:16]:  # round 2's evaluation: what each node would deploy
        sent, node = values(msg.content[protocol.ARRAYS]), msg.metadata.dst_node_id
        for key, value in sent.items():
            if key.startswith("fc."):  # the output layer found in the arrays: the node's own head
                np.testing.assert_array_equal(value, uploads[node][key])
            else:
                expected = sum(n[m] * uploads[m][key] for m in uploads) / total
                np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=key)
    heads = [values(m.content[protocol.ARRAYS])["fc.weight"] for m in grid.sent[12:16]]
    assert not np.allclose(heads[0], heads[1])
    np.testing.assert_allclose(  # Result.arrays: the body under the mean head
        result.arrays["fc.weight"].numpy(), sum(n[m] * uploads[m]["fc.weight"] for m in uploads) / total, atol=1e-7
    )
    # a node never heard from: the body under the initial head
    new = values(strategy.personalised_arrays(1))
    np.testing.assert_array_equal(new["fc.weight"], initial_arrays()["fc.weight"].numpy())
    np.testing.assert_array_equal(new["fc1.0.weight"], values(grid.sent[12].content[protocol.ARRAYS])["fc1.0.weight"])


def test_local_sends_each_node_its_own_last_model_and_nothing_else():
    grid = twin_grid()
    result = Local().start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    round_one = {r.metadata.src_node_id: values(only_arrays(r)) for r in grid.replies[:4]}
    for msg in grid.sent[8:12]:  # round 2's training: each node's own round-1 upload
        for key, value in values(msg.content[protocol.ARRAYS]).items():
            np.testing.assert_array_equal(value, round_one[msg.metadata.dst_node_id][key])
    assert len(result.arrays) == 0  # no global model


def test_cfl_splits_a_cluster_and_each_node_gets_its_clusters_model():
    """eps1 large, eps2 tiny: round 1 splits the one cluster by the cosine similarity of the updates; from then on each
    node is sent its cluster's model: the sample-weighted mean of that cluster's uploads."""
    grid = twin_grid()
    strategy = CFL(eps1=100.0, eps2=1e-6, warmup_rounds=1)
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    assert len(strategy.models) == 2 and set(strategy.cluster_of.values()) == {0, 1}
    uploads = {r.metadata.src_node_id: values(only_arrays(r)) for r in grid.replies[8:12]}
    n = {r.metadata.src_node_id: float(only_metrics(r)[protocol.NUM_EXAMPLES]) for r in grid.replies[8:12]}
    for msg in grid.sent[12:16]:
        node = msg.metadata.dst_node_id
        cluster = [m for m in uploads if strategy.cluster_of[m] == strategy.cluster_of[node]]
        expected = sum(n[m] * uploads[m]["fc.weight"] for m in cluster) / sum(n[m] for m in cluster)
        np.testing.assert_allclose(values(msg.content[protocol.ARRAYS])["fc.weight"], expected, atol=1e-7)
    np.testing.assert_array_equal(result.arrays["fc.weight"].numpy(), strategy.models[0]["fc.weight"])
    # the app's own criterion decides: with its defaults (warm-up 5 rounds) nothing splits in 2 rounds
    unsplit = CFL()
    unsplit.start(grid=twin_grid(), initial_arrays=initial_arrays(), num_rounds=2)
    assert len(unsplit.models) == 1


# --------------------------------------------------------------------------- pFedHN


def test_pfedhn_binds_each_node_to_its_partition_id_and_sends_it_its_generated_model():
    """Round 1: every node is sent the mean embedding's model (no node is bound yet); each reply's "partition-id" binds
    its node to that row; from then on node i is sent h(v_i) — the rows are the partition ids even though the node ids
    are in another order."""
    from strategies.pfedhn import generated_arrays

    ids = [2**63 + 40, 2**63 + 10, 2**63 + 30, 2**63 + 20]  # partition i is served by ids[i]: not in id order
    grid = InProcessGrid(4, record=True, node_ids=ids, mods=[lambda msg, ctx, call_next: twin_client(msg, ctx)])
    for ctx in grid.contexts.values():
        ctx.run_config = {**RUN_CONFIG, "send-partition-id": True}
    strategy = PFedHN(num_nodes=4)
    strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    assert strategy.embedding_of == {node: partition(grid, node) for node in ids}
    first = [values(m.content[protocol.ARRAYS]) for m in grid.sent[:4]]
    assert all(np.array_equal(a["fc.weight"], first[0]["fc.weight"]) for a in first)
    for msg in grid.sent[12:16]:  # round 2's evaluation: h(v_i) after round 2's step
        node = msg.metadata.dst_node_id
        expected = generated_arrays(strategy.hn, partition(grid, node))
        for key, value in expected.items():
            np.testing.assert_array_equal(values(msg.content[protocol.ARRAYS])[key], value)
    sent = [values(m.content[protocol.ARRAYS])["fc.weight"] for m in grid.sent[12:16]]
    assert not np.allclose(sent[0], sent[1])  # personalised


def test_pfedhn_without_ids_binds_nodes_in_first_seen_order_and_a_full_table_leaves_the_rest_the_mean(caplog):
    grid = twin_grid()
    strategy = PFedHN(num_nodes=2)  # two rows for four nodes: the two lowest node ids get them
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    nodes = sorted(grid.contexts)
    assert strategy.embedding_of == {nodes[0]: 0, nodes[1]: 1}
    assert sum("no embedding left" in r.getMessage() for r in caplog.records) == 2  # once per node
    round_two = {m.metadata.dst_node_id: values(m.content[protocol.ARRAYS]) for m in grid.sent[8:12]}
    assert np.array_equal(round_two[nodes[2]]["fc.weight"], round_two[nodes[3]]["fc.weight"])  # both: the mean's
    assert not np.array_equal(round_two[nodes[0]]["fc.weight"], round_two[nodes[2]]["fc.weight"])
    bad = PFedHN(num_nodes=2)  # a partition id outside the table: placed in first-seen order, with the reason
    with caplog.at_level(logging.WARNING, logger="flwr"):
        bad.start(grid=twin_grid(2, **{"send-partition-id": True}), initial_arrays=initial_arrays(), num_rounds=1)
    assert sorted(bad.embedding_of.values()) == [0, 1]
    grid4 = twin_grid(**{"send-partition-id": True})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        PFedHN(num_nodes=3).start(grid=grid4, initial_arrays=initial_arrays(), num_rounds=1)
    assert any(f"sent {PARTITION_ID}=3, not a row of the 3-row table" in r.getMessage() for r in caplog.records)


def test_pfedhn_round_one_is_the_papers_step_written_out():
    """h after round 1, by hand: every node was sent θ = h(v̄) (v̄ the mean embedding, a constant); the gradient is
    Σ_i (∂θ/∂φ)ᵀ(θ − θ̃_i), i.e. that of Σ_i ½‖h(v̄) − θ̃_i‖²; clipped to norm 50; one SGD step with momentum 0.9 and
    weight decay 1e-3 at lr 1e-2 (its first: p ← p − lr·(g + wd·p)). The generated model moves towards the uploads
    (not necessarily closer: at the app's default lr one step may overshoot them)."""
    import copy

    import torch

    from strategies.pfedhn import build_hypernetwork, generated_arrays

    grid = twin_grid()
    strategy = PFedHN(num_nodes=4, seed=7)
    strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=1)
    shapes = {k: v.shape for k, v in values(initial_arrays()).items()}
    before = build_hypernetwork(7, 4, shapes, 2, 100, 3)  # d = 1 + 4 // 4
    reference = copy.deepcopy(before)
    trained = [values(only_arrays(r)) for r in grid.replies[:4]]
    generated = reference.generate(None)
    loss = sum(0.5 * sum(((generated[k] - torch.from_numpy(t[k])) ** 2).sum() for k in generated) for t in trained)
    grads = torch.autograd.grad(loss, list(reference.parameters()), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(reference.parameters(), grads, strict=True)]
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, 50.0 / (float(norm) + 1e-6))
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads, strict=True):
            p -= 1e-2 * (g * scale + 1e-3 * p)
    for (name, got), expected in zip(strategy.hn.named_parameters(), reference.parameters(), strict=True):
        if name == "embeddings.weight":  # no gradient reaches the embeddings through the constant mean
            np.testing.assert_array_equal(got.detach().numpy(), before.embeddings.weight.detach().numpy())
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)
    # the sign: the generated model moved towards the mean upload (a positive inner product with the way there)
    old, new = generated_arrays(before, None), generated_arrays(strategy.hn, None)
    towards = sum(float(((new[k] - old[k]) * (np.mean([t[k] for t in trained], axis=0) - old[k])).sum()) for k in old)
    assert towards > 0


def test_pfedhn_generates_the_parameters_and_leaves_each_nodes_buffers_its_own():
    from torch import nn

    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    arrays = {k: v.numpy() for k, v in net.state_dict().items()}
    assert parameter_keys(net, arrays) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert parameter_keys(None, arrays) == [k for k in arrays if k != "1.num_batches_tracked"]  # every float array
    with pytest.raises(ValueError, match="pass initial arrays from the same model"):
        parameter_keys(net, {"0.weight": arrays["0.weight"]})
    with pytest.raises(ValueError, match="max_hn_params"):
        PFedHN(num_nodes=4, max_hn_params=1000).start(grid=twin_grid(2), initial_arrays=initial_arrays(), num_rounds=1)


# --------------------------------------------------------------------------- FedAMP


def test_fedamp_sends_each_node_its_anchor_with_proximal_mu_and_evaluates_its_own_model():
    """Round 2's training messages against FedAMP written out over the round-1 uploads w_j (relative attention,
    kappa 1, share 0.5): σ = median of the non-zero ‖w_i − w_j‖², ξ_ij = (0.5/3)·exp(−‖w_i − w_j‖²/σ) for j ≠ i,
    ξ_ii = 1 − Σ_{j≠i} ξ_ij, u_i = Σ_j ξ_ij w_j; μ = λ/α_r with the round's step α_r = 0.5·σ/3 under Flower's FedProx
    key (round 1, every model alike: μ = 0); each evaluation message is the node's own upload; no global model."""
    grid = twin_grid(**{"keep-model": True})
    result = FedAMP(lam=0.1, kappa=1.0).start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    replies = sorted(grid.replies[:4], key=lambda r: r.metadata.src_node_id)
    w = [values(only_arrays(r)) for r in replies]
    flat = np.stack([np.concatenate([a[k].ravel() for k in a]).astype(np.float64) for a in w])
    d2 = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    sigma = np.median(d2[np.triu_indices(4, 1)])
    xi = 0.5 / 3 * np.exp(-d2 / sigma)
    np.fill_diagonal(xi, 0.0)
    np.fill_diagonal(xi, 1.0 - xi.sum(1))
    train_two = {m.metadata.dst_node_id: m for m in grid.sent[8:12]}
    assert all(m.content["config"][PROXIMAL_MU] == 0.0 for m in grid.sent[:4])
    for i, r in enumerate(replies):
        msg = train_two[r.metadata.src_node_id]
        assert msg.content["config"][PROXIMAL_MU] == pytest.approx(0.1 / (0.5 * sigma / 3), rel=1e-4)
        for key, got in values(msg.content[protocol.ARRAYS]).items():
            expected = sum(xi[i, j] * w[j][key] for j in range(4))  # the app's distances: a float32 Gram matrix
            np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5, err_msg=key)
    assert not np.allclose(values(grid.sent[8].content[protocol.ARRAYS])["fc.weight"], w[0]["fc.weight"])
    uploads = {r.metadata.src_node_id: values(only_arrays(r)) for r in grid.replies[8:12]}
    for msg in grid.sent[12:16]:  # round 2's evaluation: the node's own model, as it uploaded it
        for key, got in values(msg.content[protocol.ARRAYS]).items():
            np.testing.assert_array_equal(got, uploads[msg.metadata.dst_node_id][key])
    assert len(result.arrays) == 0


def test_fedamp_pool_counts_new_nodes_at_the_initial_model_and_a_bad_upload_keeps_the_previous(caplog):
    """Two of four nodes a round: a node sampled for the first time is in the pool at the initial arrays, as the app
    counts a client not heard from; a node whose upload does not match the model keeps its previous one."""
    random.seed(2)  # Flower's sample_nodes draws with `random`: nodes 0 and 3, then 0 and 1, then 1 and 2 (offsets)
    bad_node = 2**63 + 12

    def corrupt(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        if msg.metadata.dst_node_id == bad_node and msg.metadata.message_type == "train":
            only_arrays(reply)["fc.weight"] = Array(np.zeros((3, 3), np.float32))
        return reply

    grid = twin_grid(mods=[corrupt], **{"keep-model": True})
    strategy = FedAMP(lam=0.1, kappa=1.0, fraction_train=0.5, fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=3)
    heard = {r.metadata.src_node_id for r in grid.replies if r.metadata.src_node_id != bad_node}
    assert set(strategy.vectors) == heard
    assert [m.metadata.dst_node_id - 2**63 - 11 for m in grid.sent] == [0, 3, 0, 1, 1, 2]
    assert sum(f"node {bad_node} sent arrays that do not match" in r.getMessage() for r in caplog.records) == 2
    # the last round's anchors, recomputed over the pool the app would use: known nodes ∪ this round's, new ones initial
    from strategies.fedamp import flatten, personalised_anchors

    last = [m.metadata.dst_node_id for m in grid.sent[-2:]]
    before = {
        r.metadata.src_node_id: values(only_arrays(r)) for r in grid.replies[:-2] if r.metadata.src_node_id in heard
    }
    keys = list(values(initial_arrays()))
    pool = sorted(set(before) | set(last))
    vectors = np.stack(
        [flatten(before[n], keys) if n in before else flatten(values(initial_arrays()), keys) for n in pool]
    )
    u, _ = personalised_anchors(vectors, [pool.index(n) for n in last], 0.01, 0.2, 1.0, 0.5)
    for msg, anchor in zip(grid.sent[-2:], u, strict=True):
        got = np.concatenate([values(msg.content[protocol.ARRAYS])[k].ravel() for k in keys])
        np.testing.assert_allclose(got, anchor, rtol=1e-5, atol=1e-7)


def test_the_proximal_term_and_its_key_are_the_apps_and_flowers():
    """proximal_penalty is the function the app's FedAMP/FedProx/Ditto clients call; PROXIMAL_MU is the config key
    Flower's own FedProx sends μ under."""
    import torch
    from flwr.app import ConfigRecord
    from flwr.serverapp.strategy import FedProx

    import strategies.fedprox as fp

    assert flower_strategies.proximal_penalty is fp.proximal_penalty
    (msg, *_) = FedProx(proximal_mu=0.3).configure_train(1, initial_arrays(), ConfigRecord(), twin_grid(2))
    assert msg.content["config"][PROXIMAL_MU] == 0.3
    net = build_model("mlp", 10, (1, 8, 8), seed=0)
    anchor = {k: v.detach() + 1.0 for k, v in net.named_parameters()}  # every parameter 1 away from its anchor
    expected = 0.5 * 4.0 * sum(p.numel() for p in net.parameters())
    assert float(flower_strategies.proximal_penalty(net, anchor, 4.0)) == pytest.approx(expected)
    flower_strategies.proximal_penalty(net, anchor, 4.0).backward()
    assert all(torch.allclose(p.grad, torch.full_like(p, -4.0)) for p in net.parameters())  # μ(w − anchor)


@pytest.mark.heavy
def test_through_flwr_run_fedamp_with_a_client_that_keeps_its_model_gives_the_apps_models(
    twin_run, tmp_path, tiny_config
):
    """The quickstart twin keeping its model in context.state and adding proximal_penalty(net, anchor, mu) (the
    documented pattern) with the drop-in FedAMP under `flwr run` (4 SuperNodes, 3 rounds; :func:`twin_run`), against
    the app's FedAMP (λ 0.1, κ 1) on the same partition, seed and initial model: every round, each client's anchor u_i
    and its trained model are the same to float tolerance, and so is its accuracy."""
    run, dumps = twin_run
    assert run.completed, run.log[-4000:]
    rounds = TWIN_ROUNDS
    dump = dumps / "fedamp"

    cfg = tiny_config(
        rounds=rounds,
        strategy={"name": "fedamp", "params": {"fedamp": {"lam": 0.1, "kappa": 1.0}}},
        data={"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 2},
    )
    grid = InProcessGrid(4, record=True)
    _, run_dir = run_in_process(cfg, tmp_path / "app", grid)
    anchors, trained = {}, {}
    for msg in grid.sent:
        if msg.metadata.message_type == "train" and protocol.ARRAYS in msg.content.array_records:
            key = (partition(grid, msg.metadata.dst_node_id), protocol.request_of(msg).round)
            anchors[key] = protocol.record_values(msg.content[protocol.ARRAYS])
    for reply in grid.replies:
        if reply.content.array_records:
            key = (partition(grid, reply.metadata.src_node_id), int(reply.metadata.group_id))
            trained[key] = values(next(iter(reply.content.array_records.values())))
    with open(run_dir / "rounds.csv") as f:
        app_rounds = list(csv.DictReader(f))
    compared = 0
    for client in range(4):
        for rnd in range(1, rounds + 1):
            sent = np.load(dump / f"client{client}-train{rnd}.npz")  # the anchor the twin was sent
            own = np.load(dump / f"client{client}-round{rnd}.npz")  # its own model, sent back to it for evaluation
            for app, twin in ((anchors[(client, rnd)], sent), (trained[(client, rnd)], own)):
                for key, value in app.items():
                    np.testing.assert_allclose(twin[key], value, rtol=1e-4, atol=1e-6, err_msg=f"{client} {rnd} {key}")
                    compared += 1
            assert float(own["acc"]) == pytest.approx(float(app_rounds[rnd - 1][f"acc_client_{client}"]), abs=1e-9)
    assert compared == 4 * 3 * 2 * 6
