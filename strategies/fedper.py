"""FedPer (Arivazhagan et al. 2019): a shared body averaged by the server, a personal head on each client.

Each round a sampled client receives the global body (every parameter and buffer outside the classifier
head), loads it under its own head, trains the whole model on its data and sends the body back; the server averages
the bodies by sample count. The head never leaves the client. The deployed model after round r is round r's
averaged body under the client's own head (the base class evaluates it on round r+1's message, after the body
is loaded and before training).
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message

from fedapps.config import ExperimentConfig
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.aggregation import average_matching
from strategies.base import DeployedModel, PersonalisedStrategy, RunContext
from strategies.fedavg import initial_model_arrays


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

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        request = self.request(
            server_round,
            self.client_ops(),
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="body"),
            training=protocol.Training(sections=self.client_settings()),
        )
        arrays = protocol.arrays_record(self.body)
        return [protocol.build_message(n, request, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        self.body = average_matching(replies, self.body, self.rule)
        return {}
