"""FedBABU (Oh et al., ICLR 2022): federated training of the body only, the head frozen at its random init.

Every client's head is the same seeded random initialisation and is never trained during federation; the
server averages the bodies (as FedPer). The deployed model after round r is round r's averaged body and the
frozen head, fine-tuned on the client's training split on a copy (the model that continues federated training
keeps the frozen initial head): ``finetune_part: full`` (default, the authors' evaluation) fine-tunes body and
head, ``head`` the head alone with the body frozen; for ``finetune_epochs`` with its own SGD settings
(``finetune_lr``, ``finetune_momentum``). The after-training column is the model as trained, with its frozen
initial head (the paper's accuracy before fine-tuning).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedapps.client import ops
from fedapps.client.registry import client_op
from fedapps.client.worker import part_names
from fedapps.params import param
from fedapps.server.strategy import DeployedModel
from fedapps.wire import protocol
from strategies.fedper import FedPer

EVALUATE_FINETUNED = "evaluate-finetuned"  # the operation below (FedNH's deployed model uses it too)
FINETUNE = "finetune"  # its settings section (finetune.*)
FINETUNE_PARTS = {"full": "none", "head": "body"}  # finetune_part -> the part kept frozen while fine-tuning


@client_op(EVALUATE_FINETUNED, default_tag="eval")
def evaluate_finetuned(w, tag: str) -> None:
    """Evaluate a copy of the model after fine-tuning it on the local training data (settings ``finetune.*``;
    ``finetune.freeze``: the part kept fixed, body when not sent: the head alone is trained); the model itself is
    left as it was."""
    section = w.request.training.section(FINETUNE)
    copy = w.model_from(w.model.state_dict())
    with ops.frozen(copy, part_names(copy, section.freeze or "body")):
        ops.train(copy, w.train_x, w.train_y, w.settings(FINETUNE), None, w.generator)
    w.evaluate(copy, tag)


@dataclass
class FedBABUParams:
    """FedBABU's parameters."""

    finetune_part: str = param(
        "full",
        choices=tuple(FINETUNE_PARTS),
        help="what the evaluation fine-tunes on a copy of the federated model: full (body and head, the authors' "
        "evaluation) or head (body frozen)",
    )
    finetune_epochs: int = param(5, ge=1, help="fine-tuning epochs before each evaluation (on a copy of the model)")
    finetune_lr: float = param(1e-3, gt=0, help="SGD learning rate of the fine-tuning (the authors' evaluation: 1e-3)")
    finetune_momentum: float = param(
        0.9, ge=0, lt=1, help="SGD momentum of the fine-tuning (the authors' evaluation: 0.9)"
    )


class FedBABU(FedPer):
    """Body averaged with the head frozen; evaluation after fine-tuning (the whole model, or the head)."""

    name = "fedbabu"
    needs_classifier = "freezes the classifier head during federation and fine-tunes it for the deployed model"
    Params = FedBABUParams
    deployed = DeployedModel(
        "round r's aggregated body and the frozen head, fine-tuned on client i's training split on a copy "
        "(finetune_part: full = body and head, head = head alone; finetune_epochs at finetune_lr)",
        source="message",
        evaluate=EVALUATE_FINETUNED,
    )

    def client_ops(self) -> list[str]:
        return ["train"]

    def client_settings(self) -> dict[str, protocol.Section]:
        p = self.params
        return {
            protocol.TRAIN: protocol.Section(freeze="head"),
            FINETUNE: protocol.Section(
                epochs=int(p.finetune_epochs),
                lr=float(p.finetune_lr),
                momentum=float(p.finetune_momentum),
                optimizer="sgd",
                freeze=FINETUNE_PARTS[p.finetune_part],
            ),
        }
