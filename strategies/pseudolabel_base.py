"""Shared machinery of the pseudo-label baselines (FedMD, FedCT, COMET): their distillation parameters, the
prediction collection, the round's request and :class:`PseudoLabelStrategy`, whose clients distil on server
targets on U, train and predict on U in one message per round; the own model after that is the deployed one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedapps.config import OPTIMIZERS, ConfigError, ExperimentConfig
from fedapps.data import get_federation
from fedapps.params import param
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply


@dataclass
class DistillParams:
    """Client distillation (on U) and wire settings shared by the pseudo-label baselines."""

    distill_epochs: int = param(5, ge=0, help="epochs over the (subset of) U per round")
    distill_lr: float = param(1e-4, gt=0, help="learning rate of the distillation optimiser")
    distill_batch_size: int = param(32, gt=0, help="minibatch size on U")
    distill_optimizer: str = param("adam", choices=OPTIMIZERS, help="a new optimiser every round")
    distill_clip_norm: float = param(1.0, ge=0, help="gradient-norm clipping during distillation; 0 = off")
    encoding: str = param("float32", choices=("float32", "float16"), help="soft labels on the wire, both directions")
    pretrain_epochs: int = param(
        0, ge=0, help="local cross-entropy epochs in round 1 (before the first predictions); 0 = client.epochs"
    )


def collect_predictions(
    replies: list[ClientReply], rows: int, num_classes: int, kind: str
) -> tuple[list[ClientReply], np.ndarray]:
    """The replies in client-id order and their decoded predictions stacked clients×rows(×M). Each reply was
    checked once, by the reply validator (:func:`fedapps.wire.validation.prediction_problem`), against what its message
    asked for; a reply without predictions here is a caller's error (it bypassed the validator)."""
    used = sorted(replies, key=lambda r: r.client_id)
    arrays: list[np.ndarray] = []
    for r in used:
        wire = (r.predictions or {}).get(protocol.PREDICTION_ARRAY)
        if wire is None:
            raise ValueError(
                f"client {r.client_id}'s reply carries no predictions; pass replies through "
                "fedapps.wire.validation.ReplyValidator (the strategy's validate) first"
            )
        arrays.append(pseudolabels.decode(wire, num_classes))
    if not arrays:
        return used, np.zeros((0, rows) if kind == "hard" else (0, rows, num_classes))
    return used, np.stack(arrays)


def index_array(rows: np.ndarray, public_size: int) -> np.ndarray:
    """Row indices of U in the smallest unsigned integer type that holds them."""
    return np.asarray(rows).astype(pseudolabels.label_dtype(public_size))


class PseudoLabelStrategy(PersonalisedStrategy):
    """Clients distil on server targets on U, train, and predict on U — one message per round."""

    needs_public_set = True
    model_agnostic = True
    deployed = DeployedModel("client i's own model after its digest and local training in round r")
    reply_kind = "predictions"
    client_privacy_refused = ""  # each releases its consensus through ClientLevelDP under privacy.mode client

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        fed = get_federation(dataclasses.asdict(cfg.data))
        if fed.public_x is None:
            raise ConfigError(f"strategy '{self.name}' needs a public set U: set 'data.public_fraction' in (0, 1)")
        self.num_classes = int(fed.num_classes)
        self.public_size = int(fed.public_x.shape[0])
        self.public_fingerprint = fed.fingerprint
        self.public_has_labels = fed.public_y is not None
        self._public_y = None if fed.public_y is None else fed.public_y.numpy().astype(np.int64)

    def oracle_accuracy(self, labels: np.ndarray, rows: np.ndarray | None = None) -> float | None:
        """DIAGNOSTIC ONLY (the method never sees U's labels): share of U rows whose server label is right."""
        if self._public_y is None or len(labels) == 0:
            return None
        truth = self._public_y if rows is None else self._public_y[rows]
        return float(np.mean(np.asarray(labels) == truth))

    def round_request(
        self,
        server_round: int,
        ops: list[str],
        distill_loss: str,
        predict_output: str,
        predict_encoding: str,
        weighting: str = "none",
        sections: Mapping[str, protocol.Section] | None = None,
    ) -> protocol.Request:
        """The round's request: the base settings plus the public set (fingerprint, predict settings), the distill
        section, round 1's training epochs and the strategy's own ``sections``."""
        p = self.params
        first = (
            {protocol.TRAIN: protocol.Section(epochs=int(p.pretrain_epochs))}
            if server_round == 1 and p.pretrain_epochs > 0
            else {}
        )
        distill = protocol.Section(
            epochs=int(p.distill_epochs),
            lr=float(p.distill_lr),
            batch_size=int(p.distill_batch_size),
            optimizer=str(p.distill_optimizer),
            clip_norm=float(p.distill_clip_norm),
            drop_last=False,
            loss=distill_loss,
            weighting=weighting,
        )
        sections = {**first, protocol.DISTILL: distill, **(sections or {})}
        return self.request(
            server_round,
            ops,
            public=protocol.PublicSet(self.public_fingerprint, predict_output, predict_encoding),
            training=protocol.Training(sections=sections),
        )

    @staticmethod
    def round_ops(with_distill: bool, first: tuple[str, ...] = ()) -> list[str]:
        """distill → train → predict (the base class adds the evaluations of the deployed, i.e. own, model)."""
        return [*first, *(["distill"] if with_distill else []), "train", "predict"]
