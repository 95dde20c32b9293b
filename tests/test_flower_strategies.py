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
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, Result, Strategy

import strategies.cwfedavg as cw
from fedapps import flower_strategies
from fedapps.flower.inprocess import InProcessGrid
from fedapps.flower_strategies import CwFedAvg
from fedapps.models import build_model, classifier_name
from fedapps.server.dropin import only_arrays, only_metrics, reply_problem
from fedapps.wire import protocol

TWIN = Path(__file__).parent / "apps" / "quickstart_twin"
if str(TWIN) not in sys.path:
    sys.path.insert(0, str(TWIN))
from quickstart_twin.client_app import app as twin_client  # noqa: E402
from quickstart_twin.task import load_data  # noqa: E402

RUN_CONFIG = {  # the twin's [tool.flwr.app.config], as the tests run it in-process
    "seed": 0,
    "source": "digits",
    "partition": "pathological",
    "classes-per-client": 2,
    "batch-size": 16,
    "lr": 0.05,
    "local-epochs": 1,
    "send-class-counts": False,
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
    assert cw.classifier_from_arrays(state) == classifier_name(model)
    with pytest.raises(ValueError, match="classifier='fc'"):
        cw.classifier_from_arrays({"conv.weight": np.zeros((2, 1, 3, 3))})


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


def test_flowers_central_dp_noise_never_reaches_the_personalised_models():
    """The wrapper adds its noise to what aggregate_train returns (Result.arrays): with noise std 250 there, the models
    the nodes are sent next are the noise-free personalised ones."""
    grid = twin_grid()
    strategy = DifferentialPrivacyServerSideFixedClipping(
        CwFedAvg(), noise_multiplier=1000.0, clipping_norm=1.0, num_sampled_clients=4
    )
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(), num_rounds=2)
    assert max(float(np.abs(v).max()) for v in values(result.arrays).values()) > 100
    round_two = [values(m.content[protocol.ARRAYS]) for m in grid.sent[8:12]]
    assert max(float(np.abs(v).max()) for a in round_two for v in a.values()) < 5


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


@pytest.mark.heavy
def test_through_flwr_run_the_drop_in_sends_the_apps_personalised_models(tmp_path, tiny_config):
    """The quickstart twin with the drop-in CwFedAvg (norm estimator) under `flwr run` (Ray simulation, 4 SuperNodes)
    and the app's cwFedAvg (wdr_lambda 0, estimator norm) on the same partition, seed and initial model: every
    client's personalised model of every round is the same to float tolerance (the twin's DataLoader draws the app's
    minibatch order; what remains is float rounding: collation and the order replies arrive in), and so are its
    accuracies."""
    from conftest import run_in_process
    from fedapps_tools.appruns import run_app

    rounds = 3
    dump = tmp_path / "dump"
    dump.mkdir()
    run = run_app(TWIN, f'num-server-rounds={rounds} estimator="norm" dump-dir="{dump}"', num_supernodes=4)
    assert run.completed, run.log[-4000:]

    cfg = tiny_config(
        rounds=rounds,
        strategy={"name": "cwfedavg", "params": {"cwfedavg": {"wdr_lambda": 0.0, "estimator": "norm"}}},
        data={"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 2},
    )
    grid = InProcessGrid(4, record=True)
    _, run_dir = run_in_process(cfg, tmp_path / "app", grid)
    # the app's personalised model after round r is what its round-(r+1) message carries (the last: an evaluation)
    app_models: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for msg in grid.sent:
        if protocol.ARRAYS in msg.content.array_records:
            rnd = protocol.request_of(msg).round - 1
            app_models[(partition(grid, msg.metadata.dst_node_id), rnd)] = protocol.record_values(
                msg.content[protocol.ARRAYS]
            )
    with open(run_dir / "rounds.csv") as f:
        last_row = list(csv.DictReader(f))[-1]
    for client in range(4):
        for rnd in range(1, rounds + 1):
            twin = np.load(dump / f"client{client}-round{rnd}.npz")
            ours = app_models[(client, rnd)]
            assert set(ours) == set(twin.files) - {"acc"}
            for key, value in ours.items():
                np.testing.assert_allclose(twin[key], value, rtol=1e-4, atol=1e-6, err_msg=f"{client} {rnd} {key}")
        assert float(twin["acc"]) == pytest.approx(float(last_row[f"acc_client_{client}"]), abs=1e-9)
