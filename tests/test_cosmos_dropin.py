"""COSMOS as a drop-in Flower strategy (:class:`strategies.cosmos.FlowerCosmos`, exported as
``fedapps.flower_strategies.Cosmos``) and its client helpers, against our app's COSMOS.

- The server: fed the same predictions, the drop-in forms the same clusters, the same targets (to the bit) and the
  same cluster models as our app's strategy, round after round; it sends each client its cluster's targets and, for
  evaluation, its cluster model.
- The client helpers: a user's ClientApp written as Flower's quickstart-pytorch writes one (its own ``Net``,
  ``train``, ``test``; our data only through :func:`fedapps.flower_strategies.load_partition`), driven by Flower's own
  ``Strategy.start()``: the same clusters as our app on the same partition, seed and initial weights. The targets and
  models are not equal to the bit there: the user's loop shuffles its own batches (a DataLoader), so its models, and
  with them the predictions the cluster models learn from, differ in the last digits and beyond. The per-client
  accuracies of the deployed cluster models are compared instead.
- Through ``flwr run`` (Ray simulation): the example ``examples/cosmos-quickstart`` (heavy), compared the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import server_app
from fedapps.config import ConfigError, load_config
from fedapps.data import public_fingerprint
from fedapps.flower.inprocess import InProcessGrid
from fedapps.flower_strategies import (
    EVALUATE_TYPE,
    TRAIN_TYPE,
    Cosmos,
    cosmos_evaluate,
    cosmos_train,
    count_classes,
    load_partition,
    load_public,
)
from fedapps.models import build_model
from fedapps.wire import protocol
from strategies.cosmos import Cosmos as AppCosmos
from strategies.pseudolabel_dropin import DEPLOYED_ACC, OWN_ACC

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cosmos-quickstart"
N = 4
PARAMS = {
    "pretrain_epochs": 2,
    "server_epochs": 1,
    "distill_epochs": 1,
    "server_lr": 1e-3,
    "distill_lr": 1e-3,
    "max_clusters": 2,
}
DATA = {"source": "digits", "partition": "cosmos-groups", "groups": 2, "alpha": 5.0, "public_fraction": 0.2, "seed": 1}
CLIENT = {"epochs": 1, "batch_size": 32, "lr": 1e-3, "optimizer": "adam", "drop_last": False, "device": "cpu"}


@pytest.fixture(autouse=True)
def flower_identity() -> None:
    """Message() outside Flower's runtime needs a task identity (as the in-process engine sets one)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, value)


def write_config(tmp_path: Path, rounds: int = 2, data: dict | None = None, model: str = "mlp", **params) -> Path:
    """Our app's COSMOS on the drop-in's setting: every client and every cluster model the zoo's ``model``."""
    cfg = {
        "seed": 0,
        "rounds": rounds,
        "output_dir": str(tmp_path / "results"),
        "strategy": {
            "name": "cosmos",
            "min_clients": N,
            "params": {"cosmos": {"server_model": model, **PARAMS, **params}},
        },
        "data": {**(data or DATA), "num_clients": N},
        "model": {"name": model},
        "client": CLIENT,
    }
    path = tmp_path / "cosmos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# --------------------------------------------------------------------------- a user's ClientApp, quickstart style


class Net(nn.Module):
    """The user's own model: a two-hidden-layer MLP (the zoo's ``mlp`` has the same layers, built in the same order,
    so the same seed gives both the same initial weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Sequential(nn.Linear(64, 200), nn.ReLU())
        self.fc2 = nn.Sequential(nn.Linear(200, 200), nn.ReLU())
        self.fc = nn.Linear(200, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc2(self.fc1(torch.flatten(x, 1))))


def load_data(context: Context):
    part = load_partition(context.node_config["partition-id"], context.node_config["num-partitions"], **DATA)
    trainloader = DataLoader(TensorDataset(part.train_x, part.train_y), batch_size=CLIENT["batch_size"], shuffle=True)
    testloader = DataLoader(TensorDataset(part.test_x, part.test_y), batch_size=256)
    return trainloader, testloader, part.public_x


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float) -> float:
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    net.train()
    total = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
    return total / max(epochs * len(trainloader), 1)


def test(net: nn.Module, testloader: DataLoader) -> tuple[float, float]:
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images)
            loss += criterion(outputs, labels).item() * len(labels)
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(testloader.dataset), correct / len(testloader.dataset)


test.__test__ = False  # type: ignore[attr-defined]  # the quickstart's name, not a pytest test


user_app = ClientApp()


@user_app.train("pseudolabels")
def user_train(msg: Message, context: Context) -> Message:
    trainloader, _, public_x = load_data(context)
    return cosmos_train(
        msg,
        context,
        model_fn=Net,
        public_x=public_x,
        train_fn=lambda net, epochs: train(net, trainloader, epochs, CLIENT["lr"]),
        class_counts=count_classes(trainloader.dataset.tensors[1], 10),
    )


@user_app.evaluate("pseudolabels")
def user_evaluate(msg: Message, context: Context) -> Message:
    _, testloader, _ = load_data(context)
    return cosmos_evaluate(
        msg,
        context,
        model_fn=Net,
        server_model_fn=Net,
        test_fn=lambda net: test(net, testloader),
        num_examples=len(testloader.dataset),
    )


class AppGrid:
    """Flower's Grid as Strategy.start() uses it, served in this process by a ClientApp: one Context per node, large
    node ids as Flower draws them, an exception in a handler an error reply (as Flower returns one)."""

    def __init__(self, app: ClientApp, num_nodes: int, first_node: int = 2**63 + 11) -> None:
        self.app = app
        self.contexts = {
            first_node + 7 * (num_nodes - i): Context(
                run_id=1,
                node_id=first_node + 7 * (num_nodes - i),
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            try:
                replies.append(self.app(msg, self.contexts[msg.metadata.dst_node_id]))
            except Exception as exc:  # noqa: BLE001 - as Flower: an exception becomes an error reply
                replies.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        return replies


def dropin_for(cfg_path: Path, nodes: int = N, **extra) -> Cosmos:
    cfg = load_config(cfg_path)
    p = dataclasses.asdict(AppCosmos.params_from(cfg))
    p.pop("server_model")
    fed = AppCosmos(cfg).fed
    return Cosmos(
        server_model_fn=lambda: build_model(cfg.strategy.params["cosmos"]["server_model"], 10, fed.input_shape),
        public_x=fed.public_x,
        num_classes=fed.num_classes,
        seed=cfg.seed,
        local_epochs=cfg.client.epochs,
        min_train_nodes=nodes,
        min_evaluate_nodes=nodes,
        min_available_nodes=nodes,
        **{**p, **extra},
    )


# --------------------------------------------------------------------------- the server, exactly


def group_predictions(rng: np.random.Generator, n: int, sharp: float) -> dict[int, np.ndarray]:
    """Predictions on U of N clients in two groups (classes 0-4 vs 5-9), each with its own noise."""
    out = {}
    for cid in range(N):
        logits = rng.normal(size=(n, 10))
        logits[:, (cid % 2) * 5 : (cid % 2) * 5 + 5] += sharp
        p = np.exp(logits)
        out[cid] = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    return out


def app_round(app: AppCosmos, rnd: int, preds: dict[int, np.ndarray]) -> list[Message]:
    """One round of our app's COSMOS on made-up predictions: its messages, then its aggregation of the replies."""
    nodes = [100 + cid for cid in preds]
    drafts = app.round_messages(rnd, nodes)
    app.replies.validator.expect(drafts)
    messages = protocol.build_messages(drafts)
    tags = app.replies.validator.expected[protocol.MESSAGE_TYPE][nodes[0]].eval_tags
    metrics = {f"{t}-{f}": v for t in tags for f, v in (("acc", 0.5), ("loss", 1.0), ("n", 2), ("correct", 1))}
    replies = [
        Message(
            protocol.Reply(
                cid, 10, dict(metrics), predictions=preds[cid], info=protocol.ReplyInfo(fingerprint=app.fed.fingerprint)
            ).encode(),
            reply_to=msg,
        )
        for cid, msg in zip(preds, messages)
    ]
    accepted = app.replies.validator.validate_batch(rnd, replies).accepted
    app.nodes.bind(accepted)  # as the round driver does: which client each node is
    app.aggregate(rnd, accepted)
    return messages


class Nodes:
    """The node ids a Grid reports (Strategy.configure_* only asks for them)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_node_ids(self) -> list[int]:
        return self.ids


def dropin_round(dropin: Cosmos, rnd: int, preds: dict[int, np.ndarray]) -> list[Message]:
    """The same round through the drop-in: Flower's configure_train, then replies as the client helper writes them."""
    grid = Nodes([2**63 + 100 + cid for cid in preds])
    messages = list(dropin.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid))
    by_node = {m.metadata.dst_node_id: m for m in messages}
    replies = []
    for cid, pred in preds.items():
        content = RecordDict(
            {
                protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10, protocol.CLIENT_ID: cid}),
                protocol.PREDICTIONS: protocol.arrays_record({protocol.PREDICTION_ARRAY: pred}),
            }
        )
        replies.append(Message(content, reply_to=by_node[2**63 + 100 + cid]))
    arrays, metrics = dropin.aggregate_train(rnd, replies)
    assert arrays is None and metrics is not None and metrics["clusters"] == dropin.clustering.k
    return messages


def test_fed_the_same_predictions_the_drop_in_learns_what_our_app_learns(tmp_path: Path) -> None:
    path = write_config(tmp_path, member_clip=0.5)  # the robust option too: its centre is the last targets
    app, dropin = AppCosmos(load_config(path)), dropin_for(path)
    assert isinstance(dropin, Strategy)
    n = int(app.fed.public_x.shape[0])
    rng = np.random.default_rng(3)
    for rnd in (1, 2):
        preds = group_predictions(rng, n, sharp=3.0)
        app_msgs = app_round(app, rnd, preds)
        drop_msgs = dropin_round(dropin, rnd, preds)
        # the targets each client got this round: none in round 1; round 2 its cluster's h_k(U), the same bits
        for a, d in zip(app_msgs, drop_msgs):
            assert (protocol.TARGETS in a.content) == (protocol.TARGETS in d.content) == (rnd == 2)
            if rnd == 2:
                want = a.content[protocol.TARGETS][protocol.TARGET_ARRAY].numpy()
                np.testing.assert_array_equal(d.content[protocol.TARGETS][protocol.TARGET_ARRAY].numpy(), want)
            assert d.metadata.message_type == TRAIN_TYPE
        assert dropin.clustering.clusters == app.clustering.clusters and dropin.cluster_of == app.cluster_of
        assert sorted(dropin.server_targets) == sorted(app.server_targets)
        for k, probs in app.server_targets.items():
            np.testing.assert_array_equal(dropin.server_targets[k], probs)
            for name, t in app.models[k].state_dict().items():
                assert torch.equal(dropin.models[k].state_dict()[name], t), (rnd, k, name)
    assert app.clustering.k == 2  # the groups were found (not a degenerate one-cluster run)
    # evaluation: each client gets its own cluster's model, as a state dict the user's factory loads
    grid = Nodes([2**63 + 100 + cid for cid in range(N)])
    evals = list(dropin.configure_evaluate(2, ArrayRecord(), ConfigRecord(), grid))
    assert all(m.metadata.message_type == EVALUATE_TYPE for m in evals)
    for m in evals:
        k = app.cluster_of[int(m.metadata.dst_node_id) - 2**63 - 100]
        state = m.content[protocol.ARRAYS].to_torch_state_dict()
        assert all(torch.equal(state[name], t) for name, t in app.models[k].state_dict().items())


def test_a_client_first_seen_later_joins_the_nearest_cluster_in_both(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    app, dropin = AppCosmos(load_config(path)), dropin_for(path, nodes=N - 1)  # Flower waits for that many
    n = int(app.fed.public_x.shape[0])
    rng = np.random.default_rng(5)
    first = group_predictions(rng, n, sharp=3.0)
    late = first.pop(3)
    app_round(app, 1, first)
    dropin_round(dropin, 1, first)
    app_round(app, 2, {**group_predictions(rng, n, 3.0), 3: late})
    dropin_msgs = dropin_round(dropin, 2, {**group_predictions(np.random.default_rng(5), n, 3.0), 3: late})
    assert 3 not in app.distance_clients and app.cluster_of[3] == dropin.cluster_of[3] == app.cluster_of[1]
    assert len(dropin_msgs) == N


def test_bad_replies_are_dropped_and_bad_settings_refused(tmp_path: Path, caplog) -> None:
    path = write_config(tmp_path)
    dropin = dropin_for(path, nodes=3)
    n = len(dropin.public_x)
    [msg, other, third, fourth] = dropin.configure_train(1, ArrayRecord(), ConfigRecord(), Nodes([7, 8, 9, 10]))
    good = np.full((n, 10), 0.1, np.float32)
    replies = [
        Message(Error(code=0, reason="boom"), reply_to=msg),
        Message(
            RecordDict(
                {
                    protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 3}),
                    protocol.PREDICTIONS: protocol.arrays_record({protocol.PREDICTION_ARRAY: good[:-1]}),  # a row short
                }
            ),
            reply_to=other,
        ),
        Message(
            RecordDict(
                {
                    protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 3}),
                    protocol.PREDICTIONS: protocol.arrays_record(
                        {protocol.PREDICTION_ARRAY: good * 2}
                    ),  # not probabilities
                }
            ),
            reply_to=third,
        ),
        Message(
            RecordDict(
                {
                    protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 3, protocol.CLIENT_ID: 1.5}),
                    protocol.PREDICTIONS: protocol.arrays_record({protocol.PREDICTION_ARRAY: good}),
                }
            ),
            reply_to=fourth,
        ),
    ]
    assert dropin.aggregate_train(1, replies) == (None, None)
    assert dropin.clustering is None
    text = caplog.text
    assert "boom" in text and f"expected ({n}, 10)" in text and "probability" in text and "not an integer" in text
    with pytest.raises(ConfigError, match="Cosmos.max_clusters"):
        Cosmos(server_model_fn=Net, public_x=dropin.public_x, num_classes=10, max_clusters=0)
    with pytest.raises(ConfigError, match="server_model_fn"):
        Cosmos(server_model_fn=Net, public_x=dropin.public_x, num_classes=10, server_model="mlp")
    with pytest.raises(ConfigError, match="unknown key 'Cosmos.nonsense'"):
        Cosmos(server_model_fn=Net, public_x=dropin.public_x, num_classes=10, nonsense=1)


# --------------------------------------------------------------------------- the client helpers


def test_the_client_refuses_another_u_and_reports_it() -> None:
    grid = AppGrid(user_app, 2)
    public = load_public(**DATA)
    dropin = Cosmos(server_model_fn=Net, public_x=public[1:], num_classes=10)  # the server's U lacks a row
    [reply, _] = grid.send_and_receive(dropin.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    assert reply.has_error() and "public set mismatch" in reply.error.reason
    assert public_fingerprint(public[1:]) in reply.error.reason
    # U does not depend on the client count (the server loads it without knowing how many nodes come)
    assert public_fingerprint(load_partition(0, 7, **DATA).public_x) == public_fingerprint(public)


def test_the_helper_distils_as_our_client_does(tmp_path: Path) -> None:
    """Objective (2) in the helper is our client's: with the label-free weights and r_B the distillation moves the
    model differently than without them (the settings are read), and float16 targets on the wire are decoded."""
    grid = AppGrid(user_app, 2)
    public = load_public(**DATA)
    losses = {}
    for weighting, rb in (("label-free", 5.0), ("none", 0.0)):
        dropin = Cosmos(
            server_model_fn=Net,
            public_x=public,
            num_classes=10,
            weighting=weighting,
            rb_lambda=rb,
            downlink_encoding="float16",
            pretrain_epochs=1,
            distill_epochs=1,
        )
        for context in grid.contexts.values():
            context.state = RecordDict()  # a fresh own model
        for rnd in (1, 2):
            replies = grid.send_and_receive(dropin.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid))
            assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
            dropin.aggregate_train(rnd, replies)
        metrics = {r.content[protocol.METRICS][protocol.CLIENT_ID]: r.content[protocol.METRICS] for r in replies}
        losses[weighting] = metrics[0][protocol.metric_name(protocol.DISTILL, "loss")]
        assert metrics[1][protocol.NUM_EXAMPLES] == len(load_partition(1, 2, **DATA).train_y)
        sent = [m for m in grid.sent if m.metadata.group_id == "2"][-2:]
        assert all(m.content[protocol.TARGETS][protocol.TARGET_ARRAY].numpy().dtype == np.float16 for m in sent)
    assert losses["label-free"] != losses["none"]


def test_the_helpers_distillation_and_predictions_are_our_clients_to_the_bit(tmp_path: Path) -> None:
    """Given the same targets, a client of our app (the generic worker, the zoo's mlp) and the helper (the user's Net,
    built under the run's seed) distil to the same model: their predictions on U are equal to the bit. Only the local
    training loop is the user's own."""
    from fedapps.client.worker import handle

    path = write_config(tmp_path, weighting="label-free", rb_lambda=5.0)
    app, dropin = AppCosmos(load_config(path)), dropin_for(path)
    fed = app.fed
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(10), size=len(fed.public_x)).astype(np.float32)
    targets = protocol.Targets(probs).encode()

    def context() -> Context:
        return Context(
            run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": N}, state=RecordDict(), run_config={}
        )

    request = dataclasses.replace(app.round_request(2), ops=("distill", "predict"))
    ours = handle(protocol.Draft(5, request, targets=targets).message(), context())
    msg = Message(
        RecordDict({protocol.CONFIG: dropin.round_request(2).encode(), protocol.TARGETS: targets}),
        dst_node_id=5,
        message_type=TRAIN_TYPE,
        group_id="2",
    )
    trained: list[int] = []
    theirs = cosmos_train(
        msg,
        context(),
        model_fn=Net,
        public_x=fed.public_x,
        train_fn=lambda net, epochs: trained.append(epochs),  # the user's loop: left out here
        class_counts=fed.train_counts[1],
    )
    assert trained == [CLIENT["epochs"]]
    want = ours.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy()
    got = theirs.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy()
    np.testing.assert_array_equal(got, want)
    loss = protocol.metric_name(protocol.DISTILL, "loss")
    assert theirs.content[protocol.METRICS][loss] == ours.content[protocol.METRICS][loss]
    assert not np.array_equal(got, predictions_without_distillation(fed, request))  # the distillation did something


def predictions_without_distillation(fed, request: protocol.Request) -> np.ndarray:
    from fedapps.client.worker import handle

    ctx = Context(
        run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": N}, state=RecordDict(), run_config={}
    )
    reply = handle(protocol.Draft(5, dataclasses.replace(request, ops=("predict",))).message(), ctx)
    return reply.content[protocol.PREDICTIONS][protocol.PREDICTION_ARRAY].numpy()


# --------------------------------------------------------------------------- end to end, Flower's start()


def test_flowers_start_drives_the_drop_in_with_a_quickstart_clientapp_as_our_app_runs(tmp_path: Path) -> None:
    """Flower's own ``Strategy.start()`` with the user's ClientApp, against our app's COSMOS (in-process engine) on the
    same partition, seed and initial weights: the same clusters; per-client accuracies of the deployed cluster models
    close (the user's DataLoader shuffles its own batches, so not equal to the bit)."""
    path = write_config(tmp_path, rounds=2)
    dropin = dropin_for(path)
    grid = AppGrid(user_app, N)
    result = dropin.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2] and len(result.arrays) == 0
    summary = server_app.run_experiment(InProcessGrid(N), str(path), "", str(tmp_path / "results"))
    run = tmp_path / "results" / load_config(path).resolved_run_name()
    ours = json.loads((run / "clusters.json").read_text())
    groups = AppCosmos(load_config(path)).fed.groups  # the partition's true client groups
    truth = [[c for c in range(N) if groups[c] == g] for g in sorted(set(groups.tolist()))]
    assert dropin.clustering.clusters == ours["clusters"] == truth
    mine = {c: m[DEPLOYED_ACC] for c, m in dropin.client_metrics[2].items()}
    app_acc = per_client_accuracy(run, 2)
    assert sorted(mine) == sorted(app_acc) == list(range(N))
    gaps = [abs(mine[c] - app_acc[c]) for c in range(N)]
    print("per-client accuracy after round 2, drop-in with start():", mine, "our app:", app_acc)
    assert max(gaps) <= 0.1, (mine, app_acc)
    assert abs(np.mean(list(mine.values())) - summary["cluster_model_accuracy"]) <= 0.05
    assert result.evaluate_metrics_clientapp[2][f"{DEPLOYED_ACC}-mean"] == pytest.approx(np.mean(list(mine.values())))
    assert all(OWN_ACC in m for m in dropin.client_metrics[2].values())
    # what travelled: the clients' models never; each train message the settings (and, round 2, targets)
    assert all(protocol.ARRAYS not in m.content for m in grid.sent if m.metadata.message_type == TRAIN_TYPE)


def per_client_accuracy(run: Path, rnd: int) -> dict[int, float]:
    """Our app's per-client accuracy of the deployed model after round ``rnd`` (rounds.csv's acc_client_<i>)."""
    import csv

    [row] = [r for r in csv.DictReader((run / "rounds.csv").open()) if int(r["round"]) == rnd]
    prefix = "acc_client_"
    return {int(k[len(prefix) :]): float(v) for k, v in row.items() if k.startswith(prefix) and v != ""}


def test_what_composes_with_flowers_evaluate_fn_and_dp_wrappers() -> None:
    """``evaluate_fn`` runs but only ever sees the empty global arrays (COSMOS has no global model: evaluate on the
    clients); Flower's server-side DP wrapper does not compose: it clips each reply's arrays as a model update against
    the global model, and a COSMOS reply carries predictions, not an update (our app's ``privacy.mode: client`` is the
    pseudo-label exchange's DP)."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    def cosmos() -> Cosmos:
        return Cosmos(
            server_model_fn=Net,
            public_x=load_public(**DATA),
            num_classes=10,
            pretrain_epochs=1,
            server_epochs=1,
            distill_epochs=1,
        )

    seen: list[int] = []
    strategy = cosmos()
    result = strategy.start(
        grid=AppGrid(user_app, 2),
        initial_arrays=ArrayRecord(),
        num_rounds=1,
        evaluate_fn=lambda rnd, arrays: seen.append(len(arrays)),
    )
    assert seen == [0, 0] and result.evaluate_metrics_serverapp == {} and strategy.clustering is not None
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        cosmos(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=2
    )
    with pytest.raises(ValueError, match="zip"):
        wrapped.start(grid=AppGrid(user_app, 2), initial_arrays=ArrayRecord(), num_rounds=1)


# --------------------------------------------------------------------------- the example, through `flwr run`


@pytest.mark.heavy
def test_the_example_runs_through_flwr_run_as_our_app_runs_cosmos(tmp_path: Path) -> None:
    """`flwr run examples/cosmos-quickstart` (2 rounds, 4 nodes, mnist5k) against our app's COSMOS on the same
    partition, seed and initial weights (the example's Net has the zoo's ``cnn`` layers): the same clusters, close
    per-client accuracies of the deployed cluster models."""
    from conftest import ACTOR_CPUS
    from fedapps_tools.appruns import run_app

    result = tmp_path / "result.json"
    overrides = {
        "num-server-rounds": 2,
        "pretrain-epochs": 1,
        "local-epochs": 1,
        "server-epochs": 1,
        "distill-epochs": 1,
        "max-clusters": 2,
    }
    run_config = " ".join(f"{k}={v}" for k, v in overrides.items()) + f' results="{result}"'
    run = run_app(EXAMPLE, run_config, num_supernodes=N, cpus_per_client=int(ACTOR_CPUS))
    assert run.completed, run.log[-4000:]
    doc = json.loads(result.read_text())
    assert doc["round"] == 2
    mnist = {"source": "mnist5k", "partition": "cosmos-groups", "groups": 2, "alpha": 5.0, "public_fraction": 0.2}
    path = write_config(tmp_path, rounds=2, data=mnist, model="cnn", pretrain_epochs=1)
    server_app.run_experiment(InProcessGrid(N), str(path), "", str(tmp_path / "results"))
    run = tmp_path / "results" / load_config(path).resolved_run_name()
    ours = json.loads((run / "clusters.json").read_text())
    assert doc["clusters"] == ours["clusters"]
    theirs = {int(c): m[DEPLOYED_ACC] for c, m in doc["clients"].items()}
    app_acc = per_client_accuracy(run, 2)
    print("per-client accuracy, drop-in via flwr run:", theirs, "our app:", app_acc)
    assert sorted(theirs) == sorted(app_acc) == list(range(N))
    assert max(abs(theirs[c] - app_acc[c]) for c in range(N)) <= 0.1, (theirs, app_acc)


def test_the_example_is_a_small_complete_flower_app() -> None:
    """What `flwr run examples/cosmos-quickstart` bundles: its own pyproject with the components, a ServerApp of at
    most 40 lines, and a FAB far under Flower's 10 MB cap (no data, no results inside the app folder)."""
    import io
    import tomllib
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    components = config["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "cosmos_quickstart.server_app:app",
        "clientapp": "cosmos_quickstart.client_app:app",
    }
    assert len((EXAMPLE / "cosmos_quickstart" / "server_app.py").read_text().splitlines()) <= 40
    fab = build_fab_from_disk(EXAMPLE)
    assert len(fab) < 100_000  # Flower refuses a FAB over 10 MB
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    assert {"pyproject.toml", "cosmos_quickstart/client_app.py", "cosmos_quickstart/task.py"} <= names
