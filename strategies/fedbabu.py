"""FedBABU (Oh et al., ICLR 2022): federated training of the body only, the head frozen at its random init.

Every client's head is the same seeded random initialisation and is never trained during federation; the
server averages the bodies (as FedPer). The deployed model after round r (the paper's protocol) is round r's
averaged body with the head fine-tuned on the client's training data (``finetune_epochs``, body frozen, on a
copy: the model that continues federated training keeps the frozen initial head). The after-training column
is the model as trained, with its frozen initial head (the paper's accuracy before fine-tuning).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedapps.client import ops
from fedapps.client.clientops import client_op
from fedapps.client.worker import part_names
from fedapps.params import param
from fedapps.wire import protocol
from strategies.base import DeployedModel
from strategies.fedper import FedPer

EVALUATE_FINETUNED = "evaluate-finetuned"  # the operation below (FedNH's deployed model uses it too)
FINETUNE = "finetune"  # its settings section (finetune.*)


@client_op(EVALUATE_FINETUNED, default_tag="eval")
def evaluate_finetuned(w, tag: str) -> None:
    """Evaluate a copy of the model after training its head alone on the local data (settings ``finetune.*``);
    the model itself is left as it was."""
    copy = w.model_from(w.model.state_dict())
    with ops.frozen(copy, part_names(copy, "body")):
        ops.train(copy, w.train_x, w.train_y, w.settings(FINETUNE), None, w.generator)
    w.evaluate(copy, tag)


@dataclass
class FedBABUParams:
    """FedBABU's parameters."""

    finetune_epochs: int = param(
        5, ge=1, help="head fine-tuning epochs before each evaluation (on a copy of the model)"
    )


class FedBABU(FedPer):
    """Body averaged with the head frozen; evaluation after fine-tuning the head."""

    name = "fedbabu"
    needs_classifier = "freezes the classifier head during federation and fine-tunes it for the deployed model"
    Params = FedBABUParams
    deployed = DeployedModel(
        "round r's aggregated body with the head fine-tuned on client i's training split "
        "(finetune_epochs, body frozen)",
        source="message",
        evaluate=EVALUATE_FINETUNED,
    )

    def client_ops(self) -> list[str]:
        return ["train"]

    def client_settings(self) -> dict[str, protocol.Section]:
        return {
            protocol.TRAIN: protocol.Section(freeze="head"),
            FINETUNE: protocol.Section(epochs=int(self.params.finetune_epochs)),
        }
