"""FedPer (Arivazhagan et al. 2019): a shared body averaged by the server, a personal head on each client.

Each round a sampled client receives the global body (every parameter and buffer outside the classifier
head), loads it under its own head, trains the whole model on its data and sends the body back; the server averages
the bodies by sample count. The head never leaves the client. The deployed model after round r is round r's
averaged body under the client's own head (the base class evaluates it on round r+1's message, after the body
is loaded and before training).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from torch import nn

from fedapps.config import ExperimentConfig
from fedapps.server.aggregation import average_matching, weighted_average
from fedapps.server.dropin import (
    PersonalisedFlowerStrategy,
    array_record,
    numpy_arrays,
    only_arrays,
    only_metrics,
    output_layer,
)
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import initial_model_arrays

log = logging.getLogger("flwr")


class FedPer(PersonalisedStrategy):
    """Average the body, keep the head personal."""

    name = "fedper"
    needs_classifier = "shares the body and keeps each client's classifier head on the client"
    robust_aggregation = True
    deployed = DeployedModel("round r's aggregated body with client i's own head", source="message")

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.body = initial_model_arrays(cfg, "body")

    def client_ops(self) -> list[str]:
        """What the client runs after loading the body (FedRep trains differently)."""
        return ["train"]

    def client_settings(self) -> dict[str, protocol.Section]:
        """Settings those operations need beyond the shared ones, by section."""
        return {}

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            self.client_ops(),
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="body"),
            training=protocol.Training(sections=self.client_settings()),
        )
        arrays = self.body
        return [protocol.Draft(n, request, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        self.body = average_matching(replies, self.body, self.rule)
        return {}


class FlowerFedPer(PersonalisedFlowerStrategy):
    """FedPer as a drop-in Flower strategy (``fedapps.flower_strategies.FedPer``): the server keeps each node's head
    (its last upload's output layer) and sends the node the averaged body under that head; the body is the
    sample-weighted mean of this round's uploads (:func:`fedapps.server.aggregation.weighted_average`, the app's
    mean). A node never heard from gets the body under the initial head. The output layer: ``classifier``, else found in
    ``model`` or in the arrays as the app finds it. Every other argument is Flower's FedAvg's."""

    def __init__(self, *, classifier: str | None = None, model: nn.Module | None = None, **flower_args: Any) -> None:
        super().__init__(**flower_args)
        self.classifier, self.model = classifier, model
        self.keys: list[str] = []
        self.heads: dict[int, dict[str, np.ndarray]] = {}  # node id -> its latest head

    def settings(self) -> list[tuple[str, object]]:
        return [("Personal layer", self.classifier or "the output layer")]

    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        """The body and the node's own head (the initial head until it has uploaded one)."""
        if not self.keys:
            initial = numpy_arrays(arrays)
            self.keys = list(initial)
            self.shapes = {k: v.shape for k, v in initial.items()}
            head = output_layer(self.classifier, self.model, initial) + "."
            self.head_keys = [k for k in self.keys if k.startswith(head)]
            self.initial_head = {k: initial[k] for k in self.head_keys}
            self.body = {k: v for k, v in initial.items() if k not in self.head_keys}
        return array_record({**self.body, **self.heads.get(node_id, self.initial_head)}, self.keys)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """Every matching upload's head kept for its node; the bodies averaged. Returns the body under the
        sample-weighted mean of this round's heads (a global model for Flower's loop: no node is sent it)."""
        uploads, weights = [], []
        for msg in replies:
            arrays = numpy_arrays(only_arrays(msg))
            if list(arrays) != self.keys or any(arrays[k].shape != self.shapes[k] for k in self.keys):
                log.warning("FedPer round %d: node %d sent arrays that do not match the model; left out",
                            server_round, msg.metadata.src_node_id)  # fmt: skip
                continue
            self.heads[msg.metadata.src_node_id] = {k: arrays[k] for k in self.head_keys}
            uploads.append(arrays)
            weights.append(float(only_metrics(msg)[self.weighted_by_key]))  # type: ignore[arg-type]  # checked: a number
        if not uploads:
            return None
        mean = weighted_average(uploads, weights)
        self.body = {k: v for k, v in mean.items() if k not in self.head_keys}
        return array_record(mean, self.keys)
