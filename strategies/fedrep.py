"""FedRep (Collins et al., ICML 2021): a shared representation (body), a personal head, trained in turn.

Like FedPer — the server averages the body, the head never leaves the client — but the client trains in two
phases each round: first the head alone for ``head_epochs`` with the body frozen, then the body alone for
``client.epochs`` with the head frozen. The deployed model after round r is round r's averaged body under the
client's own head (as FedPer's).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedapps.params import param
from fedapps.wire import protocol
from strategies.fedper import FedPer


@dataclass
class FedRepParams:
    """FedRep's parameters."""

    head_epochs: int = param(
        5, ge=1, help="epochs on the head (body frozen) before the body's client.epochs (head frozen)"
    )


class FedRep(FedPer):
    """Body averaged; head then body trained on the client each round."""

    name = "fedrep"
    needs_classifier = "trains the classifier head and the body in turn, and shares the body only"
    Params = FedRepParams

    def client_ops(self) -> list[str]:
        return ["train:head", "train:body"]

    def client_settings(self) -> dict[str, protocol.Section]:
        return {
            protocol.train_section("head"): protocol.Section(freeze="body", epochs=int(self.params.head_epochs)),
            protocol.train_section("body"): protocol.Section(freeze="head"),
        }
