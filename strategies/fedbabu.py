"""FedBABU (Oh et al., ICLR 2022): federated training of the body only, the head frozen at its random init.

Every client's head is the same seeded random initialisation and is never trained during federation; the
server averages the bodies (as FedPer). For evaluation each client fine-tunes a copy of its model's head on
its training data (``finetune_epochs``, body frozen) and evaluates that copy on its test split — the model
that continues federated training keeps the frozen initial head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedapps import ops
from fedapps.clientops import client_op
from fedapps.params import param
from fedapps.worker import part_names
from strategies.fedper import FedPer


@client_op("evaluate-finetuned", default_tag="eval")
def evaluate_finetuned(w, tag: str) -> None:
    """Evaluate a copy of the model after training its head alone on the local data (settings ``finetune.*``);
    the model itself is left as it was."""
    copy = w.model_from(w.model.state_dict())
    with ops.frozen(copy, part_names(copy, "body")):
        ops.train(copy, w.train_x, w.train_y, w.settings("finetune"), None, w.generator)
    w.record_eval(tag, ops.evaluate(copy, w.data.test_x, w.data.test_y))


@dataclass
class FedBABUParams:
    """FedBABU's parameters."""

    finetune_epochs: int = param(5, ge=1)  # head fine-tuning epochs before each evaluation (on a copy of the model)


class FedBABU(FedPer):
    """Body averaged with the head frozen; evaluation after fine-tuning the head."""

    name = "fedbabu"
    Params = FedBABUParams

    def client_ops(self) -> list[str]:
        return ["train", "evaluate-finetuned"]

    def client_settings(self) -> dict[str, Any]:
        return {"train.freeze": "head", "finetune.epochs": int(self.params.finetune_epochs)}
