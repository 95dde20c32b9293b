"""Ditto (Li et al., ICML 2021): a FedAvg global model plus a personal model per client, tied by a proximal term.

Each round a sampled client receives the global model w. It trains a copy of w on its data (the global
branch, sent back and averaged by sample count as in FedAvg), and trains its own personal model v, kept on
the client between rounds, with cross-entropy + (λ/2)‖v − w‖² towards the w it received. The personal model
after the round's training is the client's deployed model. λ = 0 is Local plus a FedAvg
run on the side; a large λ pulls v onto the global model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, client_op
from fedapps.config import ExperimentConfig
from fedapps.params import param
from fedapps.server.aggregation import average_matching
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import initial_model_arrays
from strategies.fedprox import PROX_MU


@client_op("train-received")
def train_received(w, tag: str) -> None:
    """Train a copy of the received model on the local data, plainly (the global branch); the private model is
    untouched and the trained copy is what goes back (``return-arrays``)."""
    if w.received is None:
        raise ProtocolError("train-received needs model arrays in the message")
    copy = w.model_from(w.received)
    result = ops.train(copy, w.train_x, w.train_y, w.settings("train"), None, w.generator)
    w.outgoing = copy
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


@dataclass
class DittoParams:
    """Ditto's parameters."""

    lam: float = param(0.1, ge=0, help="λ: weight of the personal model's proximal term to the global model")


class Ditto(PersonalisedStrategy):
    """FedAvg for the global model; proximal personal models on the clients."""

    name = "ditto"
    robust_aggregation = True
    Params = DittoParams
    deployed = DeployedModel("client i's personal model v_i after its local training in round r")

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.global_arrays = initial_model_arrays(cfg)

    def final_arrays(self) -> dict[str, Any]:
        return self.global_arrays

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            ["train-received", "train"],
            load=protocol.Load(into_model=False),
            training=protocol.Training(
                sections={protocol.TRAIN: protocol.Section(extra={PROX_MU: float(self.params.lam)})}
            ),
            returns=protocol.Return(arrays=True, part="state"),
        )
        arrays = self.global_arrays
        return [protocol.Draft(n, request, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        self.global_arrays = average_matching(replies, self.global_arrays, self.rule)
        return {}
