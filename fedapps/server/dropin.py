"""The base of the drop-in personalised strategies: Flower ``Strategy`` objects for any ClientApp that follows
Flower's plain message convention (train: ``arrays`` + ``config`` in, ``arrays`` + ``metrics`` with ``num-examples``
out; evaluate: ``arrays`` in, ``metrics`` out), driven by Flower's own ``Strategy.start(grid=..., initial_arrays=...,
num_rounds=...)`` and returning its ``Result``.

What differs from Flower's ``FedAvg`` is one thing: each node is sent ITS arrays, in ``configure_train`` and in
``configure_evaluate`` (:meth:`PersonalisedFlowerStrategy.node_arrays`), and the replies update per-node state
(:meth:`PersonalisedFlowerStrategy.aggregate_arrays`), which returns the round's global aggregate for Flower's loop
(``Result.arrays``, ``evaluate_fn``). Sampling, the ``server-round`` config entry and the metric averaging are
Flower's own (:mod:`flwr.serverapp.strategy.strategy_utils`). Per-node state is keyed by Flower's node id: a node
keeps its state while its id lives (one run of the simulation engine, or one SuperNode process in deployment).
Unlike Flower's FedAvg, a malformed reply is dropped with a logged reason instead of failing the round.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, sample_nodes
from torch import nn

from fedapps.models import classifier_name
from fedapps.wire.protocol import ARRAYS, CONFIG, NUM_EXAMPLES

log = logging.getLogger("flwr")  # Flower's logger: the drop-in strategies log where Flower's own do

SERVER_ROUND = "server-round"  # the config entry Flower's strategies add to every message (FedAvg's name for it)
PROXIMAL_MU = "proximal-mu"  # the train-config entry Flower's FedProx sends its proximal weight μ in
MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


class PersonalisedFlowerStrategy(Strategy, ABC):
    """A Flower ``Strategy`` that sends each node its own arrays. The sampling arguments mean what they mean in
    Flower's ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ...); a subclass says what a node gets
    (:meth:`node_arrays`) and what the replies do to its state (:meth:`aggregate_arrays`)."""

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = NUM_EXAMPLES,
        arrayrecord_key: str = ARRAYS,
        configrecord_key: str = CONFIG,
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
    ) -> None:
        for name, value in (("fraction_train", fraction_train), ("fraction_evaluate", fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{type(self).__name__}: {name} is {value}; give a fraction in [0, 1]")
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = 0 if fraction_train == 0.0 else min_train_nodes
        self.min_evaluate_nodes = 0 if fraction_evaluate == 0.0 else min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn or aggregate_metricrecords
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn or aggregate_metricrecords
        self.current_arrays: ArrayRecord | None = None  # what start() last passed in (the global aggregate)

    # ------------------------------------------------------------------ what a subclass says
    @abstractmethod
    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        """The arrays node ``node_id`` is sent (``arrays``: the global arrays Flower's loop passes this round)."""

    @abstractmethod
    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """Update the per-node state from this round's usable training replies; the round's global aggregate (or
        None when no reply could be used)."""

    def round_nodes(self, node_ids: list[int], arrays: ArrayRecord, for_training: bool) -> None:
        """Called with a round's sampled nodes before :meth:`node_arrays` is asked for each of them; nothing by default
        (a strategy whose arrays depend on the whole cohort, as FedAMP's anchors do, computes them here)."""

    def settings(self) -> list[tuple[str, object]]:
        """The strategy's own settings, logged by :meth:`summary`."""
        return []

    def personalised_arrays(self, node_id: int) -> ArrayRecord:
        """What node ``node_id`` would be sent now (e.g. to save every node's model after ``start()`` returns)."""
        if self.current_arrays is None:
            raise RuntimeError(f"{type(self).__name__}: no round has run yet; call start() first")
        return self.node_arrays(node_id, self.current_arrays, for_training=False)

    # ------------------------------------------------------------------ Flower's Strategy
    def summary(self) -> None:
        """Log the sampling and the strategy's own settings."""
        log.info("\t├──> Sampling:")
        log.info("\t│\t├──Fraction: train (%.2f) | evaluate (%.2f)", self.fraction_train, self.fraction_evaluate)
        log.info("\t│\t├──Minimum nodes: train (%d) | evaluate (%d)", self.min_train_nodes, self.min_evaluate_nodes)
        log.info("\t│\t└──Minimum available nodes: %d", self.min_available_nodes)
        log.info("\t└──> Personalised: each node is sent its own arrays")
        for name, value in self.settings():
            log.info("\t\t├── %s: %s", name, value)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes as Flower's FedAvg does; each gets its own arrays and the shared config."""
        return self._messages(server_round, arrays, config, grid, MessageType.TRAIN, self.fraction_train)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The usable replies update the per-node state; the global aggregate and the weighted mean metrics."""
        usable = self._usable(server_round, replies, training=True)
        if not usable:
            return None, None
        aggregated = self.aggregate_arrays(server_round, usable)
        return aggregated, self.train_metrics_aggr_fn([m.content for m in usable], self.weighted_by_key)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Each sampled node evaluates ITS arrays (the model it would deploy now)."""
        return self._messages(server_round, arrays, config, grid, MessageType.EVALUATE, self.fraction_evaluate)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The weighted mean of the usable replies' metrics."""
        usable = self._usable(server_round, replies, training=False)
        return self.evaluate_metrics_aggr_fn([m.content for m in usable], self.weighted_by_key) if usable else None

    # ------------------------------------------------------------------ helpers
    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        message_type: str,
        fraction: float,
    ) -> list[Message]:
        if fraction == 0.0:
            return []
        self.current_arrays = arrays
        minimum = self.min_train_nodes if message_type == MessageType.TRAIN else self.min_evaluate_nodes
        sample_size = max(int(len(list(grid.get_node_ids())) * fraction), minimum)
        node_ids, all_nodes = sample_nodes(grid, self.min_available_nodes, sample_size)
        log.info("configure_%s: Sampled %s nodes (out of %s)", message_type, len(node_ids), len(all_nodes))
        config[SERVER_ROUND] = server_round
        training = message_type == MessageType.TRAIN
        self.round_nodes(node_ids, arrays, training)
        return [
            Message(
                content=RecordDict(
                    {
                        self.arrayrecord_key: self.node_arrays(node, arrays, for_training=training),
                        self.configrecord_key: config,
                    }
                ),
                message_type=message_type,
                dst_node_id=node,
            )
            for node in node_ids
        ]

    def _usable(self, server_round: int, replies: Iterable[Message], training: bool) -> list[Message]:
        """The replies without error that carry one MetricRecord with a positive ``weighted_by_key`` (and, from
        training, one ArrayRecord); every other reply is logged with its reason and left out."""
        usable, dropped = [], 0
        for msg in replies:
            problem = reply_problem(msg, self.weighted_by_key, training)
            if problem:
                dropped += 1
                log.warning(
                    "round %d: reply from node %d left out: %s", server_round, msg.metadata.src_node_id, problem
                )
            else:
                usable.append(msg)
        log.info(
            "aggregate_%s: Received %s results and %s failures",
            "train" if training else "evaluate",
            len(usable),
            dropped,
        )
        return usable


def reply_problem(msg: Message, weighted_by_key: str, training: bool) -> str:
    """Why a reply cannot be used under Flower's plain convention ('' when it can)."""
    if msg.has_error():
        return f"error reply ({msg.error.reason})"
    content = msg.content
    if training and len(content.array_records) != 1:
        return f"{len(content.array_records)} ArrayRecords (expected one)"
    if len(content.metric_records) != 1:
        return f"{len(content.metric_records)} MetricRecords (expected one)"
    weight = next(iter(content.metric_records.values())).get(weighted_by_key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
        return f"no positive '{weighted_by_key}' in its metrics ({weight!r})"
    return ""


def classifier_from_arrays(arrays: Mapping[str, np.ndarray]) -> str:
    """The output layer as the app finds it (the last ``nn.Linear`` registered: :func:`fedapps.models.classifier_name`)
    when only the arrays are known: the module of the last 2-D ``<module>.weight`` in the arrays' order (a state dict
    lists modules in registration order)."""
    heads = [k.rsplit(".", 1)[0] for k, v in arrays.items() if k.endswith(".weight") and np.ndim(v) == 2]
    if not heads:
        raise ValueError(
            "no 2-D '<module>.weight' array among the arrays to take as the output layer; name it with "
            "classifier='fc' or pass the model (model=Net())"
        )
    return heads[-1]


def output_layer(classifier: str | None, model: nn.Module | None, arrays: Mapping[str, np.ndarray]) -> str:
    """The output layer a drop-in strategy treats apart: ``classifier`` if named, else found in ``model`` as the app
    finds it, else in the arrays (:func:`classifier_from_arrays`); its weight must be a 2-D array among them."""
    head = classifier if classifier is not None else (classifier_name(model) if model is not None else None)
    head = head if head is not None else classifier_from_arrays(arrays)
    weight = arrays.get(f"{head}.weight")
    if weight is None or np.ndim(weight) != 2:
        raise ValueError(
            f"the output layer '{head}' has no 2-D '{head}.weight' among the arrays ({', '.join(arrays)}); "
            "name another with classifier=..."
        )
    return head


def parameter_keys(model: nn.Module | None, arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The arrays a drop-in strategy treats as the model's parameters, in the arrays' order: the names of ``model``'s
    parameters when it is given (buffers such as BatchNorm's running statistics left out), else every floating-point
    array. Each must be among the arrays."""
    if model is None:
        return [k for k, v in arrays.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
    names = {name for name, _ in model.named_parameters()}
    missing = sorted(names - set(arrays))
    if missing:
        raise ValueError(
            f"the model's parameters {', '.join(missing)} are not among the arrays ({', '.join(arrays)}); "
            "pass initial arrays from the same model (ArrayRecord(model.state_dict()))"
        )
    return [k for k in arrays if k in names]


def numpy_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord's arrays as numpy, in its order."""
    return {k: v.numpy() for k, v in record.items()}


def array_record(arrays: Mapping[str, np.ndarray], keys: Iterable[str]) -> ArrayRecord:
    """An ArrayRecord of ``keys`` (in that order) from numpy arrays."""
    return ArrayRecord({k: Array(np.ascontiguousarray(arrays[k])) for k in keys})


def only_arrays(msg: Message) -> ArrayRecord:
    """The one ArrayRecord of a usable training reply."""
    return next(iter(msg.content.array_records.values()))


def only_metrics(msg: Message) -> MetricRecord:
    """The one MetricRecord of a usable reply."""
    return next(iter(msg.content.metric_records.values()))
