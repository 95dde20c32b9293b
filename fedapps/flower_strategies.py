"""Personalised strategies for any Flower app (docs/flower-apps.md): subclasses of Flower's
``flwr.serverapp.strategy.Strategy``, driven by Flower's own ``strategy.start(grid=..., initial_arrays=...,
num_rounds=...)``, the client-side terms a user adds to their own training loop, and the client helpers a
pseudo-label ClientApp calls. The maths is the code the app's strategies run (``strategies/<name>.py``, where each
algorithm's drop-in form lives beside the strategy our app runs).

The top layer of ``fedapps``, beside the tools: the one module of the package that imports ``strategies``.

- Plain Flower convention (the user's ClientApp unchanged): :class:`CwFedAvg` (and :func:`wdr_penalty`,
  :data:`CLASS_COUNTS` for a client that adds them), :class:`FedPer`, :class:`CFL`, :class:`Local`, :class:`PFedHN`
  (:data:`PARTITION_ID` for a client that names its embedding), :class:`FedAMP` (its pull as :data:`PROXIMAL_MU`,
  Flower's FedProx key; :func:`proximal_penalty` for the client's loss).
- :class:`Cosmos` — clustered server models, pseudo-labels only (its client side: :func:`cosmos_train` and
  :func:`cosmos_evaluate` in two handlers of the user's ClientApp; :func:`count_classes` for its label-free weights).
- :func:`load_partition` — one client's data (and U) as our app splits a data set, for a ClientApp that wants our
  partitions through a loader (the examples, the equivalence tests); :func:`load_public` — U alone, for the
  ServerApp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fedapps.config import ConfigError, config_from_dict
from fedapps.data import get_federation
from fedapps.server.dropin import PROXIMAL_MU, PersonalisedFlowerStrategy
from strategies.cfl import FlowerCFL as CFL
from strategies.cosmos import FlowerCosmos as Cosmos
from strategies.cosmos import cosmos_evaluate, cosmos_train
from strategies.cwfedavg import CLASS_COUNTS, wdr_penalty
from strategies.cwfedavg import FlowerCwFedAvg as CwFedAvg
from strategies.fedamp import FlowerFedAMP as FedAMP
from strategies.fedper import FlowerFedPer as FedPer
from strategies.fedprox import proximal_penalty
from strategies.local import FlowerLocal as Local
from strategies.pfedhn import PARTITION_ID
from strategies.pfedhn import FlowerPFedHN as PFedHN
from strategies.pseudolabel_dropin import EVALUATE_TYPE, TRAIN_TYPE, count_classes

__all__ = [
    "CFL",
    "CLASS_COUNTS",
    "EVALUATE_TYPE",
    "TRAIN_TYPE",
    "Cosmos",
    "CwFedAvg",
    "FedAMP",
    "FedPer",
    "Local",
    "PARTITION_ID",
    "PFedHN",
    "PROXIMAL_MU",
    "Partition",
    "PersonalisedFlowerStrategy",
    "cosmos_evaluate",
    "cosmos_train",
    "count_classes",
    "load_partition",
    "load_public",
    "proximal_penalty",
    "wdr_penalty",
]


@dataclass(frozen=True)
class Partition:
    """One client's data as tensors (images N×C×H×W float32, labels int64): its train and test splits, drawn from
    its own distribution, and the public set U (None unless ``public_fraction`` > 0), the same on every client."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    public_x: torch.Tensor | None
    num_classes: int
    input_shape: tuple[int, int, int]


def load_partition(partition_id: int, num_partitions: int, **data: Any) -> Partition:
    """Client ``partition_id`` of ``num_partitions``, split as our app splits the data set ``data`` describes: the
    keys of the config's ``data`` section (``source``, ``partition``, ``alpha``, ``public_fraction``, ``seed``, ...;
    unknown keys and bad values are ConfigErrors naming the key). Loaded and partitioned once per process."""
    cfg = config_from_dict({"data": {**data, "num_clients": int(num_partitions)}})
    fed = get_federation(dataclasses.asdict(cfg.data))
    client = fed.client(int(partition_id))
    return Partition(
        client.train_x,
        client.train_y,
        client.test_x,
        client.test_y,
        fed.public_x,
        int(fed.num_classes),
        tuple(int(d) for d in fed.input_shape),  # type: ignore[arg-type]
    )


def load_public(**data: Any) -> torch.Tensor:
    """The public set U of the data set ``data`` describes (the keys of :func:`load_partition`): the held-out,
    class-stratified ``public_fraction`` of it, the same whatever the number of clients, in a fixed order."""
    cfg = config_from_dict({"data": data})
    if cfg.data.public_fraction <= 0:
        raise ConfigError("load_public: set public_fraction in (0, 1), e.g. 0.2 (the share of the data held out as U)")
    public_x = get_federation(dataclasses.asdict(cfg.data)).public_x
    assert public_x is not None  # public_fraction > 0
    return public_x
