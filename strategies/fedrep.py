"""FedRep (Collins et al., ICML 2021): a shared representation (body), a personal head, trained in turn.

Like FedPer — the server averages the body, the head never leaves the client — but the client trains in two
phases each round: first the head alone for ``head_epochs`` with the body frozen, then the body alone for
``client.epochs`` with the head frozen. The client evaluates its model (its own head on the new body phase's
result) on its test split after training.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid

from fedapps import protocol
from fedapps.config import ConfigError, ExperimentConfig
from strategies.fedper import FedPer


@dataclass
class FedRepParams:
    """FedRep's parameters."""

    head_epochs: int = 5  # epochs on the head (body frozen) before the body's client.epochs (head frozen)


class FedRep(FedPer):
    """Body averaged; head then body trained on the client each round."""

    name = "fedrep"
    Params = FedRepParams

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        if cfg.strategy.params.head_epochs < 1:
            raise ConfigError(f"'strategy.params.head_epochs' must be >= 1, got {cfg.strategy.params.head_epochs}")

    def round_messages(self, server_round: int, node_ids: list[int], grid: Grid) -> list[Message]:
        config = {**self.base_config(), "load-arrays": True, "return-arrays": True, "arrays.keys": "body",
                  "train:head.freeze": "body", "train:head.epochs": int(self.params.head_epochs),
                  "train:body.freeze": "head"}
        arrays = protocol.arrays_record(self.body)
        return [protocol.build_message(n, server_round, ["train:head", "train:body", "evaluate"], config, arrays=arrays)
                for n in node_ids]
