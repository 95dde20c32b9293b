"""Local: no federation. Each client trains its own model on its own data; nothing but metrics travels.

The floor every personalised method must beat. The deployed model after round r is the client's own model
after that round's training. ``pretrain_epochs`` gives round 1 as many epochs as the pseudo-label methods'
pre-training, so Local gets the same number of local epochs over a run as the methods it is compared with
(docs/evaluation.md#same-work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import Message

from fedapps.params import param
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.base import DeployedModel, PersonalisedStrategy


@dataclass
class LocalParams:
    pretrain_epochs: int = param(0, ge=0, help="local epochs of round 1 (the others: client.epochs); 0 = client.epochs")


class Local(PersonalisedStrategy):
    """Purely local training."""

    name = "local"
    Params = LocalParams
    model_agnostic = True
    deployed = DeployedModel("client i's own model after its local training in round r")
    client_privacy_refused = "each client trains alone and sends the server nothing to aggregate"

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        first = int(self.params.pretrain_epochs)
        sections = {protocol.TRAIN: protocol.Section(epochs=first)} if server_round == 1 and first > 0 else {}
        request = self.request(server_round, ["train"], training=protocol.Training(sections=sections))
        return [protocol.build_message(n, request) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        return {}
