"""FedProx (Li et al., MLSys 2020): FedAvg whose clients add a proximal term (μ/2)‖w − w_global‖² to their loss.

The worked example of an algorithm with client behaviour of its own (docs/development.md): the
server side is FedAvg's; the client side is one training term, registered here under the name ``proximal``
and switched on by the message setting ``train.prox_mu`` (μ: :data:`PROX_MU` in the ``train`` section). Its
anchor is the arrays the message carries (for FedProx the global model the client starts from). Ditto and FedAMP
use the same term with their own anchors (the global model, the personalised aggregate u_i) and import it from
here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedapps.client.registry import ProtocolError, training_term
from fedapps.params import param
from fedapps.wire import protocol
from strategies.fedavg import FedAvg

PROX_MU = "prox_mu"  # the train-section setting that switches the proximal term on (μ > 0): train.prox_mu


# --------------------------------------------------------------------------- maths


def proximal_penalty(model: nn.Module, anchor: dict[str, Tensor], mu: float) -> Tensor:
    """(μ/2)·‖w − anchor‖² over the parameters named in ``anchor`` (gradient flows into w)."""
    terms = [((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if n in anchor]
    return 0.5 * mu * torch.stack(terms).sum() if terms else torch.zeros(())


# --------------------------------------------------------------------------- client side


@training_term("proximal", data_free=True)  # reads the received model only: DP-SGD adds it after the noise
def proximal_term(w, section: protocol.Section) -> Any:
    """(μ/2)‖w − anchor‖² with μ = ``train.prox_mu`` and the message's arrays as the anchor; None when μ = 0."""
    mu = float(section.extra.get(PROX_MU, 0.0))
    if mu <= 0:
        return None
    if w.received is None:
        raise ProtocolError(f"{protocol.TRAIN}.{PROX_MU} > 0 needs arrays in the message (the proximal anchor)")
    anchor = {k: v.to(w.device) for k, v in w.received.items()}
    return lambda model: proximal_penalty(model, anchor, mu)


# --------------------------------------------------------------------------- server side


@dataclass
class FedProxParams:
    """FedProx's parameters."""

    mu: float = param(0.01, ge=0, help="μ: weight of the proximal term (the paper tries 0.001 to 1); 0 = FedAvg")


class FedProx(FedAvg):
    """FedAvg with a proximal term on the clients."""

    name = "fedprox"
    Params = FedProxParams

    def client_settings(self) -> dict[str, protocol.Section]:
        return {protocol.TRAIN: protocol.Section(extra={PROX_MU: float(self.params.mu)})}
