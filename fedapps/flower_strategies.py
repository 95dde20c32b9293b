"""Personalised strategies for any Flower app (docs/flower-apps.md): drop-in ``flwr.serverapp.strategy.Strategy``
objects for a ClientApp that follows Flower's plain message convention, and the client-side terms a user adds to
their own training loop. The maths is the code the app's strategies run (``strategies/<name>.py``).

The top layer of ``fedapps``, beside the tools: the one module of the package that imports ``strategies``.
"""

from fedapps.server.dropin import PROXIMAL_MU, PersonalisedFlowerStrategy
from strategies.cfl import FlowerCFL as CFL
from strategies.cwfedavg import CLASS_COUNTS, wdr_penalty
from strategies.cwfedavg import FlowerCwFedAvg as CwFedAvg
from strategies.fedamp import FlowerFedAMP as FedAMP
from strategies.fedper import FlowerFedPer as FedPer
from strategies.fedprox import proximal_penalty
from strategies.local import FlowerLocal as Local
from strategies.pfedhn import PARTITION_ID
from strategies.pfedhn import FlowerPFedHN as PFedHN

__all__ = [
    "CFL",
    "CLASS_COUNTS",
    "CwFedAvg",
    "FedAMP",
    "FedPer",
    "Local",
    "PARTITION_ID",
    "PFedHN",
    "PROXIMAL_MU",
    "PersonalisedFlowerStrategy",
    "proximal_penalty",
    "wdr_penalty",
]
