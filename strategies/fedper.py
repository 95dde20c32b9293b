"""FedPer (Arivazhagan et al. 2019): a shared body averaged by the server, a personal head on each client.

Each round a sampled client receives the global body (every parameter and buffer outside the classifier
head), loads it under its own head, trains the whole model on its data, evaluates it on its test split and
sends the body back; the server averages the bodies by sample count. The head never leaves the client.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedapps import protocol
from fedapps.config import ExperimentConfig
from fedapps.data import source_info
from fedapps.models import build_model, classifier_name
from fedapps.protocol import ClientReply
from strategies.base import PersonalisedStrategy, average_matching
from strategies.fedavg import initial_model_arrays


def body_keys(cfg: ExperimentConfig) -> list[str]:
    """State-dict keys of the configured model outside its classifier head."""
    num_classes, shape = source_info(cfg.data.source, cfg.data.synthetic_classes, tuple(cfg.data.synthetic_shape))
    model = build_model(cfg.model.name, num_classes, shape, seed=cfg.seed)
    head = classifier_name(model) + "."
    return [k for k in model.state_dict() if not k.startswith(head)]


class FedPer(PersonalisedStrategy):
    """Average the body, keep the head personal."""

    name = "fedper"

    def __init__(self, cfg: ExperimentConfig, on_round: Any = None) -> None:
        super().__init__(cfg, on_round)
        initial = initial_model_arrays(cfg)
        self.body = {k: initial[k] for k in body_keys(cfg)}

    def expect_arrays(self) -> bool:
        return True

    def round_messages(self, server_round: int, node_ids: list[int], grid: Grid) -> list[Message]:
        config = {**self.base_config(), "load-arrays": True, "return-arrays": True, "arrays.keys": "body"}
        arrays = protocol.arrays_record(self.body)
        return [protocol.build_message(n, server_round, ["train", "evaluate"], config, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        self.body = average_matching(replies, self.body)
        return {}
