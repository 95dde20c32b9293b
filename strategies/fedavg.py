"""FedAvg: one global model, the sample-weighted mean of the client models.

Each round every sampled client receives the global model, trains it on its data, and sends it back. The
deployed model after round r is the global model aggregated in round r (evaluated by the base class's
protocol on round r+1's message before training, as PFLlib does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from fedapps.config import ExperimentConfig
from fedapps.data import spec_info
from fedapps.models import build_model, state_part
from fedapps.server.aggregation import average_matching
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply


def initial_model_arrays(cfg, part: str = "state", seed: int | None = None) -> dict[str, np.ndarray]:
    """The model every client starts from (seeded by the experiment seed unless ``seed`` is given): its whole
    state, its parameters or its body (``part``, see :func:`fedapps.models.state_part`)."""
    num_classes, shape = spec_info(dataclasses.asdict(cfg.data))  # a source's, or what the nodes described
    model = build_model(cfg.model.name, num_classes, shape, seed=cfg.seed if seed is None else seed)
    return {k: v.detach().cpu().numpy() for k, v in state_part(model, part).items()}


class FedAvg(PersonalisedStrategy):
    """Sample-weighted averaging of whole models (parameters and buffers)."""

    name = "fedavg"
    robust_aggregation = True
    deployed = DeployedModel("the global model aggregated in round r", source="message")
    train_op: ClassVar[str] = "train"  # the client operation that trains the received model (FedUV: its own)

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.global_arrays = initial_model_arrays(cfg)

    def final_arrays(self) -> dict[str, np.ndarray]:
        return self.global_arrays

    def client_settings(self) -> dict[str, protocol.Section]:
        """Operation settings beyond FedAvg's own, by section (FedProx adds its proximal term to ``train``)."""
        return {}

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            [self.train_op],
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="state"),
            keep=protocol.Keep(persist=False),  # the whole model arrives every round: none kept
            training=protocol.Training(sections=self.client_settings()),
        )
        arrays = self.global_arrays
        return [protocol.Draft(n, request, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        self.global_arrays = average_matching(replies, self.global_arrays, self.rule)
        return {}
