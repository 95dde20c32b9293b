"""Local: no federation. Each client trains its own model on its own data; nothing but metrics travels.

The floor every personalised method must beat. The deployed model after round r is the client's own model
after that round's training.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message

from fedapps import protocol
from fedapps.protocol import ClientReply
from strategies.base import DeployedModel, PersonalisedStrategy


class Local(PersonalisedStrategy):
    """Purely local training."""

    name = "local"
    model_agnostic = True
    deployed = DeployedModel("client i's own model after its local training in round r")

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        return [protocol.build_message(n, server_round, ["train"], self.base_config()) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        return {}
