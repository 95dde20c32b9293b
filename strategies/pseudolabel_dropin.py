"""The pseudo-label exchange in any Flower app: its message convention, the client helpers a user's ClientApp calls
from two handlers, and :class:`FlowerPseudoLabelStrategy`, the base of the drop-in server strategies (subclasses of
Flower's ``flwr.serverapp.strategy.Strategy``, driven by Flower's own ``start()``).

The convention (docs/flower-apps.md, "COSMOS and the pseudo-label methods"). One round is the two phases of
Flower's ``start()`` loop:

- ``train.pseudolabels`` (:data:`TRAIN_TYPE`): the server's settings in ``config`` (the same schema as our app's
  messages, :class:`fedapps.wire.protocol.Request`: the round, the seed, U's fingerprint, the ``distill.*`` and
  ``train.*`` settings, what to predict and how to encode it) and, once the client has targets, the record
  ``targets`` (array ``targets``: n×M on U). The client distils its own model on the targets, trains it on its own
  data with its own loop, and replies ``predictions`` (array ``predictions``: its predictions on U, as asked) and
  ``metrics`` (``num-examples``, ``client-id`` where its node config has one). Its model never leaves it.
- ``evaluate.pseudolabels`` (:data:`EVALUATE_TYPE`): the client's deployed model where the server holds it (COSMOS's
  cluster model, as ``arrays``, Flower's usual record of a state dict), else none; the client replies ``metrics``:
  the deployed model's ``deployed-acc`` / ``deployed-loss``, its own model's ``after-acc`` / ``after-loss`` and
  ``num-examples`` of its test data.

The predictions ride on the train reply: a separate ``query`` round trip per round would cost a message each way
(seconds in deployment) for nothing the train reply cannot carry. The handlers take named message types, so one
ClientApp can keep its plain ``@app.train()`` / ``@app.evaluate()`` for Flower's own strategies beside them.

The client's maths is the code our generic client runs: :func:`fedapps.client.worker.distill_towards` (KL towards the
targets, the algorithm's per-sample weights and distillation term), :func:`fedapps.client.ops.predict`, the wire
encodings of :mod:`fedapps.wire.pseudolabels` and the reply check :func:`fedapps.wire.validation.prediction_problem`.
Only the local training is the user's own loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from torch import nn

from fedapps.client import ops
from fedapps.client.registry import ProtocolError
from fedapps.client.worker import distill_towards, optim_settings
from fedapps.data import public_fingerprint
from fedapps.models import seeded
from fedapps.seeds import derive_seed
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.validation import PredictionSpec, prediction_problem

log = logging.getLogger("fedapps")

ACTION = "pseudolabels"  # the action of both message types (Flower: <category>.<action>)
TRAIN_TYPE = f"{protocol.MESSAGE_TYPE}.{ACTION}"
EVALUATE_TYPE = f"{protocol.EVAL_MESSAGE_TYPE}.{ACTION}"
STATE_KEY = "pseudolabels-own-model"  # Context.state: the client's own model between rounds
EVALUATE_OPS = ("evaluate-received", "evaluate")  # what an evaluate message asks for (in its config's ops)
DEPLOYED_ACC = protocol.metric_name(protocol.DEPLOYED_TAG, "acc")
DEPLOYED_LOSS = protocol.metric_name(protocol.DEPLOYED_TAG, "loss")
OWN_ACC = protocol.metric_name(protocol.AFTER_TAG, "acc")
OWN_LOSS = protocol.metric_name(protocol.AFTER_TAG, "loss")
TRAIN_LOSS = protocol.metric_name(protocol.TRAIN, "loss")
DISTILL_LOSS = protocol.metric_name(protocol.DISTILL, "loss")

TrainFn = Callable[[nn.Module, int], Any]  # the user's loop: (own model, epochs) -> its loss (or anything)
TestFn = Callable[[nn.Module], tuple[float, float]]  # the user's test: model -> (loss, accuracy) on its test data
# an algorithm's distillation extras: (distill section, class counts, generator) -> (weights of targets, loss term)
DistillExtras = Callable[
    [protocol.Section, np.ndarray, torch.Generator],
    tuple[Callable[[np.ndarray], torch.Tensor | None], ops.DistillTerm | None],
]


# --------------------------------------------------------------------------- client side


def count_classes(labels: Any, num_classes: int) -> np.ndarray:
    """Per-class sample counts of a client's training labels (a tensor, array or list): what the label-free
    per-sample weight w_i(x) reads, and the reply's ``num-examples``."""
    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64).reshape(-1)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got {int(y.min())}..{int(y.max())}")
    return np.bincount(y, minlength=num_classes)


def client_identity(context: Context) -> int | None:
    """The client's stable id where its node config has one (``partition-id`` in simulation, ``client-id`` in
    deployment); None: the server then knows it by its node id, which Flower draws afresh every run."""
    for key in (protocol.CLIENT_ID, "partition-id"):
        if key in context.node_config:
            return int(context.node_config[key])
    return None


def read_request(msg: Message) -> protocol.Request:
    """The message's settings (ProtocolError naming the problem: a message of another app or version)."""
    try:
        return protocol.request_of(msg)
    except protocol.MessageError as exc:
        raise ProtocolError(f"a {msg.metadata.message_type} message this helper cannot read: {exc}") from exc


def check_public(request: protocol.Request, public_x: torch.Tensor) -> None:
    """U must be the server's: the same samples in the same order (the fingerprint of both)."""
    expected = request.public.fingerprint
    if expected is not None and expected != public_fingerprint(public_x):
        raise ProtocolError(
            f"public set mismatch: the server's U has fingerprint '{expected}', this client's public_x has "
            f"'{public_fingerprint(public_x)}'; load the same U, in the same order and dtype (float32), on both sides"
        )


def own_model(context: Context, model_fn: Callable[[], nn.Module], seed: int | None, device: str) -> nn.Module:
    """The client's own model: kept in ``Context.state`` between rounds; on first contact built by ``model_fn``
    under the run's seed (every client starts from the weights our app's clients start from with that seed)."""
    with seeded(seed):
        model = model_fn()
    if STATE_KEY in context.state:
        model.load_state_dict(context.state.array_records[STATE_KEY].to_torch_state_dict())
    return model.to(ops.resolve_device(device))


def keep_model(context: Context, model: nn.Module) -> None:
    context.state[STATE_KEY] = ArrayRecord(model.state_dict())


def no_extras(
    section: protocol.Section, counts: np.ndarray, generator: torch.Generator
) -> tuple[Callable[[np.ndarray], torch.Tensor | None], ops.DistillTerm | None]:
    """No per-sample weights and no extra loss term (a ``distill.weighting`` other than none is refused)."""
    if (section.weighting or "none") != "none":
        raise ProtocolError(f"distill.weighting '{section.weighting}' is not one this helper offers; allowed: none")
    return (lambda targets: None), None


def pseudolabel_train(
    msg: Message,
    context: Context,
    *,
    model_fn: Callable[[], nn.Module],
    public_x: torch.Tensor,
    train_fn: TrainFn,
    class_counts: Sequence[int] | np.ndarray,
    optimizer: ops.OptimizerFactory | None = None,
    device: str = "cpu",
    extras: DistillExtras = no_extras,
) -> Message:
    """Serve a ``train.pseudolabels`` message: distil the own model on the targets (if any), run the user's
    ``train_fn(model, epochs)``, reply the predictions on U (see the module docstring). ``optimizer``: builds the
    distillation's optimiser from the parameters (None: the server's ``distill.*`` settings); ``extras``: the
    algorithm's weights and term (:data:`DistillExtras`)."""
    request = read_request(msg)
    check_public(request, public_x)
    counts = np.asarray(class_counts, dtype=np.int64)
    cid = client_identity(context)
    seed = request.setup.model.seed
    model = own_model(context, model_fn, seed, device)
    num_classes = len(counts)
    metrics: dict[str, Any] = {protocol.NUM_EXAMPLES: int(counts.sum())}
    if cid is not None:
        metrics[protocol.CLIENT_ID] = cid
    try:
        targets = protocol.Targets.decode(msg.content[protocol.TARGETS]) if protocol.TARGETS in msg.content else None
    except protocol.MessageError as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    if targets is not None and targets.values is not None:
        section = request.training.section(protocol.DISTILL)
        rows = None if targets.distill_rows is None else torch.as_tensor(targets.distill_rows.astype(np.int64))
        generator = torch.Generator().manual_seed(
            derive_seed(int(seed or 0), "client-batches", request.round, cid if cid is not None else context.node_id)
        )
        weights_of, term = extras(section, counts, generator)
        result = distill_towards(
            model,
            public_x if rows is None else public_x[rows],
            targets.values,
            num_classes,
            optim_settings(section, {}),
            section.loss or "kl",
            weights_of,
            generator,
            term,
            optimizer,
        )
        metrics[DISTILL_LOSS] = result["loss"]
    epochs = request.training.section(protocol.TRAIN).epochs
    loss = train_fn(model, int(epochs if epochs is not None else 1))
    if isinstance(loss, (int, float)) and np.isfinite(loss):
        metrics[TRAIN_LOSS] = float(loss)
    keep_model(context, model)
    predictions = predict_on(model, public_x, targets.predict_rows if targets else None, request, num_classes)
    content = RecordDict(
        {
            protocol.METRICS: MetricRecord(metrics),
            protocol.PREDICTIONS: protocol.arrays_record({protocol.PREDICTION_ARRAY: predictions}),
        }
    )
    return Message(content=content, reply_to=msg)


def predict_on(
    model: nn.Module, public_x: torch.Tensor, rows: np.ndarray | None, request: protocol.Request, num_classes: int
) -> np.ndarray:
    """The own model's predictions on U (or on the rows the message names), encoded as the message asks."""
    x = public_x if rows is None else public_x[torch.as_tensor(rows.astype(np.int64))]
    values = ops.predict(model, x, output=request.public.predict_output)
    return pseudolabels.encode(values.numpy(), request.public.predict_encoding, num_classes)


def pseudolabel_evaluate(
    msg: Message,
    context: Context,
    *,
    model_fn: Callable[[], nn.Module],
    test_fn: TestFn,
    num_examples: int,
    server_model_fn: Callable[[], nn.Module] | None = None,
    device: str = "cpu",
) -> Message:
    """Serve an ``evaluate.pseudolabels`` message: the deployed model the message carries (built by
    ``server_model_fn``; none carried: the own model is the deployed one) and the own model, each through the user's
    ``test_fn(model) -> (loss, accuracy)``."""
    request = read_request(msg)
    own = own_model(context, model_fn, request.setup.model.seed, device)
    own_loss, own_acc = test_fn(own)
    metrics: dict[str, Any] = {protocol.NUM_EXAMPLES: int(num_examples), OWN_ACC: own_acc, OWN_LOSS: own_loss}
    cid = client_identity(context)
    if cid is not None:
        metrics[protocol.CLIENT_ID] = cid
    if protocol.ARRAYS in msg.content:
        if server_model_fn is None:
            raise ProtocolError(
                "the server sent the deployed model's arrays, but this ClientApp gave no server_model_fn to build it; "
                "pass the server's model factory to pseudolabel_evaluate"
            )
        deployed = server_model_fn()
        deployed.load_state_dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict())
        loss, acc = test_fn(deployed.to(ops.resolve_device(device)))
    else:
        loss, acc = own_loss, own_acc
    metrics[DEPLOYED_ACC], metrics[DEPLOYED_LOSS] = float(acc), float(loss)
    return Message(content=RecordDict({protocol.METRICS: MetricRecord(metrics)}), reply_to=msg)


# --------------------------------------------------------------------------- server side


class FlowerPseudoLabelStrategy(Strategy):
    """What the drop-in pseudo-label strategies share: Flower's sampling (``fraction_*``, ``min_*_nodes``, as
    Flower's FedAvg), the messages of the convention, the reply checks, the per-client evaluation record.

    A subclass gives :meth:`round_request`, :meth:`targets_for`, :meth:`learn` and :meth:`deployed_arrays`. Clients
    are known by their ``client-id`` where they send one, else by node id (:func:`client_identity`)."""

    def __init__(
        self,
        public_x: torch.Tensor,
        num_classes: int,
        *,
        seed: int = 0,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
    ) -> None:
        x = torch.as_tensor(public_x)
        if x.ndim < 2 or len(x) == 0:
            raise ValueError(f"public_x (U) must be a non-empty batch of inputs, got shape {tuple(x.shape)}")
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        for name, value in (("fraction_train", fraction_train), ("fraction_evaluate", fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.public_x = x
        self.num_classes = num_classes
        self.seed = int(seed)
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        self.min_train_nodes, self.min_evaluate_nodes = min_train_nodes, min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.fingerprint = public_fingerprint(x)
        self.node_client: dict[int, int] = {}  # node id -> client id (from its replies)
        # round -> client id -> its evaluation (deployed-acc, deployed-loss, after-acc, after-loss, num-examples)
        self.client_metrics: dict[int, dict[int, dict[str, float]]] = {}

    # ------------------------------------------------------------------ to implement
    def round_request(self, server_round: int) -> protocol.Request:
        """The settings of the round's train messages."""
        raise NotImplementedError

    def targets_for(self, client_id: int | None) -> ArrayRecord | None:
        """The targets record for one client (None: none yet, the client trains and predicts only)."""
        raise NotImplementedError

    def learn(self, server_round: int, predictions: dict[int, np.ndarray]) -> dict[str, float]:
        """The server's step on the round's predictions (client id -> soft predictions n×M); its metrics."""
        raise NotImplementedError

    def deployed_arrays(self, client_id: int | None) -> ArrayRecord | None:
        """The client's deployed model where the server holds it (None: the client's own model is deployed)."""
        return None

    # ------------------------------------------------------------------ Flower's Strategy
    def summary(self) -> None:
        log.info(
            "%s: |U| = %d, %d classes, U fingerprint %s; fraction train %.2f / evaluate %.2f, min nodes %d / %d",
            type(self).__name__,
            len(self.public_x),
            self.num_classes,
            self.fingerprint,
            self.fraction_train,
            self.fraction_evaluate,
            self.min_train_nodes,
            self.min_evaluate_nodes,
        )

    def sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Flower's sampling, as its FedAvg: ``fraction`` of the connected nodes, at least ``minimum``."""
        if fraction == 0.0:
            return []
        size = max(int(len(list(grid.get_node_ids())) * fraction), minimum)
        nodes, _ = sample_nodes(grid, max(self.min_available_nodes, size), size)
        return sorted(nodes)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.pseudolabels`` message per sampled node: the round's settings and that client's targets.
        ``arrays`` and ``config`` (Flower's global model and train config) are not used: nothing global travels."""
        del arrays
        if len(config):
            log.warning("%s ignores start()'s train_config; its settings are its parameters", type(self).__name__)
        settings = self.round_request(server_round).encode()
        nodes = self.sample(grid, self.fraction_train, self.min_train_nodes)
        return self.messages(server_round, nodes, settings, TRAIN_TYPE, protocol.TARGETS, self.targets_for)

    def messages(
        self,
        server_round: int,
        nodes: Iterable[int],
        settings: ConfigRecord,
        message_type: str,
        key: str,
        record_of: Callable[[int | None], Any],
    ) -> list[Message]:
        """One message of ``message_type`` per node: ``settings`` as its config, and under ``key`` the record
        ``record_of(client)`` gives for the node's client, where it gives one."""
        out = []
        for node in nodes:
            content = RecordDict({protocol.CONFIG: settings})
            record = record_of(self.node_client.get(node))
            if record is not None:
                content[key] = record
            message = Message(content=content, dst_node_id=node, message_type=message_type, group_id=str(server_round))
            out.append(message)
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check each reply's predictions, then :meth:`learn` on them. No global arrays (the result's ``arrays``
        stay empty); the metrics: the replies' means weighted by ``num-examples`` and the learner's own."""
        predictions: dict[int, np.ndarray] = {}
        kept: list[MetricRecord] = []
        for reply in replies:
            read = self.read_train_reply(reply)
            if read is None:
                continue
            cid, pred, metrics = read
            predictions[cid] = pred
            kept.append(metrics)
        if not predictions:
            log.warning("%s round %d: no usable predictions; nothing learnt", type(self).__name__, server_round)
            return None, None
        out = weighted_means(kept)
        out.update(self.learn(server_round, predictions))
        return None, MetricRecord(out)

    def read_train_reply(self, reply: Message) -> tuple[int, np.ndarray, MetricRecord] | None:
        """(client id, soft predictions, metrics) of a usable reply; None (logged with the reason) otherwise."""
        node = int(reply.metadata.src_node_id)
        problem = None
        if reply.has_error():
            problem = f"error reply: {reply.error.reason}"
        elif protocol.PREDICTIONS not in reply.content.array_records:
            problem = f"no '{protocol.PREDICTIONS}' record"
        elif protocol.METRICS not in reply.content.metric_records:
            problem = f"no '{protocol.METRICS}' record"
        else:
            metrics = reply.content.metric_records[protocol.METRICS]
            record = reply.content.array_records[protocol.PREDICTIONS]
            if protocol.PREDICTION_ARRAY not in record:
                problem = f"no '{protocol.PREDICTION_ARRAY}' array"
            else:
                wire = record[protocol.PREDICTION_ARRAY].numpy()
                problem = prediction_problem(wire, self.spec_for_replies())
        if problem is None:
            count = metrics.get(protocol.NUM_EXAMPLES)
            if not isinstance(count, (int, float)) or isinstance(count, bool) or count < 0:
                problem = f"'{protocol.NUM_EXAMPLES}' is not a count: {count!r}"
        cid = reported_id(metrics, node) if problem is None else None
        if problem is None and cid is None:
            problem = f"'{protocol.CLIENT_ID}' is not an integer: {metrics.get(protocol.CLIENT_ID)!r}"
        if problem is not None or cid is None:
            log.warning("%s: the reply of node %d is dropped: %s", type(self).__name__, node, problem)
            return None
        self.node_client[node] = cid
        return cid, pseudolabels.soft_labels(wire, self.num_classes), metrics

    def spec_for_replies(self) -> PredictionSpec:
        request = self.round_request(1)
        return PredictionSpec(
            len(self.public_x), self.num_classes, request.public.predict_output, request.public.predict_encoding
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``evaluate.pseudolabels`` message per sampled node, with its deployed model's arrays where the server
        holds it."""
        del arrays, config
        settings = protocol.Request(
            ops=EVALUATE_OPS, round=server_round, setup=protocol.Setup(model=protocol.ModelSpec(None, self.seed))
        ).encode()
        nodes = self.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        return self.messages(server_round, nodes, settings, EVALUATE_TYPE, protocol.ARRAYS, self.deployed_arrays)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Each client's evaluation (kept in :attr:`client_metrics`); the means over clients (``-mean``, the headline
        as our app reports it) and weighted by ``num-examples``."""
        per_client: dict[int, dict[str, float]] = {}
        kept: list[MetricRecord] = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error() or protocol.METRICS not in reply.content.metric_records:
                reason = reply.error.reason if reply.has_error() else f"no '{protocol.METRICS}' record"
                log.warning("%s: the evaluation of node %d is dropped: %s", type(self).__name__, node, reason)
                continue
            metrics = reply.content.metric_records[protocol.METRICS]
            if not all(
                isinstance(metrics.get(k), (int, float)) and not isinstance(metrics.get(k), bool)
                for k in (DEPLOYED_ACC, protocol.NUM_EXAMPLES)
            ):
                log.warning("%s: the evaluation of node %d lacks %s", type(self).__name__, node, DEPLOYED_ACC)
                continue
            cid = reported_id(metrics, self.node_client.get(node, node))
            if cid is None:
                log.warning("%s: the evaluation of node %d has a bad %s", type(self).__name__, node, protocol.CLIENT_ID)
                continue
            per_client[cid] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            kept.append(metrics)
        if not per_client:
            return None
        self.client_metrics[server_round] = dict(sorted(per_client.items()))
        out = weighted_means(kept)
        for key in (DEPLOYED_ACC, OWN_ACC):  # the mean over clients, the headline as our app reports it
            values = [m[key] for m in per_client.values() if key in m]
            if values:
                out[f"{key}-mean"] = float(np.mean(values))
        return MetricRecord(out)


def reported_id(metrics: MetricRecord, fallback: int) -> int | None:
    """The ``client-id`` a reply reports (``fallback``, the node id, when it reports none); None: not an integer."""
    value = metrics.get(protocol.CLIENT_ID, fallback)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def weighted_means(records: list[MetricRecord]) -> dict[str, Any]:
    """Every numeric metric the records share (client ids aside), averaged with ``num-examples`` as weights."""
    if not records:
        return {}
    weights = np.array([r[protocol.NUM_EXAMPLES] for r in records], dtype=np.float64)  # checked: a count in each
    total = weights.sum()
    shared = set.intersection(*(set(r.keys()) for r in records)) - {protocol.NUM_EXAMPLES, protocol.CLIENT_ID}
    out: dict[str, Any] = {}
    for key in sorted(shared):
        values = [r[key] for r in records]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            w = weights if total > 0 else np.ones(len(values))
            out[key] = float(np.dot(w, np.asarray(values, dtype=np.float64)) / w.sum())
    out[protocol.NUM_EXAMPLES] = float(total)
    return out
