"""Local: no federation. Each client trains its own model on its own data; nothing but metrics travels.

The floor every personalised method must beat. The deployed model after round r is the client's own model
after that round's training. ``pretrain_epochs`` gives round 1 as many epochs as the pseudo-label methods'
pre-training, so Local gets the same number of local epochs over a run as the methods it is compared with
(docs/evaluation.md#same-work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Message

from fedapps.params import param
from fedapps.server.dropin import PersonalisedFlowerStrategy, only_arrays
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply


@dataclass
class LocalParams:
    pretrain_epochs: int = param(0, ge=0, help="local epochs of round 1 (the others: client.epochs); 0 = client.epochs")


class Local(PersonalisedStrategy):
    """Purely local training."""

    name = "local"
    Params = LocalParams
    model_agnostic = True
    deployed = DeployedModel("client i's own model after its local training in round r")
    reply_kind = "metrics"
    client_privacy_refused = "each client trains alone and sends the server nothing to aggregate"

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        first = int(self.params.pretrain_epochs)
        sections = {protocol.TRAIN: protocol.Section(epochs=first)} if server_round == 1 and first > 0 else {}
        request = self.request(server_round, ["train"], training=protocol.Training(sections=sections))
        return [protocol.Draft(n, request) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        return {}


class FlowerLocal(PersonalisedFlowerStrategy):
    """Local as a drop-in Flower strategy (``fedapps.flower_strategies.Local``): no federation. The server keeps each
    node's latest upload and sends it back to that node alone (the initial arrays before its first), so a plain Flower
    client that trains what it receives trains its own model on its own data only. There is no global model:
    ``aggregate_train`` returns none, so ``Result.arrays`` stays empty and ``evaluate_fn`` sees the initial arrays."""

    def __init__(self, **flower_args: Any) -> None:
        super().__init__(**flower_args)
        self.models: dict[int, ArrayRecord] = {}  # node id -> its latest upload

    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        return self.models.get(node_id, arrays)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        for msg in replies:
            self.models[msg.metadata.src_node_id] = only_arrays(msg)
        return None
