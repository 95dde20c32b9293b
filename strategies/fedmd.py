"""FedMD (Li & Wang 2019): model-agnostic federated learning by consensus on a public alignment set.

Each round every client digests the previous round's consensus on an alignment subset of U (MAE on
logits in the original; KL on probabilities as an option), revisits its private data (CE), evaluates
its own model on its local test split, and sends its class scores on the NEXT alignment subset. The
server averages all clients' scores into ONE consensus that everyone receives. One message per client
per round; only scores on U travel.

Differences from the original, on purpose: (1) the original draws a fresh 5,000-sample subset of a
separate labelled public set per round; here the subset is drawn from U (``alignment_size``, all of U
by default); (2) the original pre-trains every model on the LABELLED public set before collaborating;
here that is off by default (``pretrain_public_epochs: 0``) because U is meant to be unlabelled — when
switched on, round 1 runs the client operation ``train-public`` (CE on U with its true labels) first.

This module also holds :class:`PseudoLabelStrategy`, the machinery FedMD, FedCT and COMET share.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fedapps import protocol, pseudolabels
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.data import get_federation
from fedapps.protocol import ClientReply
from strategies.base import PersonalisedStrategy

log = logging.getLogger("fedapps")

OPTIMIZERS = ("sgd", "adam")


# --------------------------------------------------------------------------- shared machinery


@dataclass
class DistillParams:
    """Client distillation (on U) and wire settings shared by the pseudo-label baselines."""

    distill_epochs: int = 5  # epochs over the (subset of) U per round
    distill_lr: float = 1e-4  # learning rate of the distillation optimiser
    distill_batch_size: int = 32  # minibatch size on U
    distill_optimizer: str = "adam"  # adam | sgd (a new optimiser every round)
    distill_clip_norm: float = 1.0  # gradient-norm clipping during distillation; 0 = off
    encoding: str = "float32"  # soft labels on the wire, both directions: float32 | float16
    pretrain_epochs: int = 0  # local CE epochs in round 1 (before the first predictions); 0 = client.epochs


def check_distill_params(p: DistillParams, allowed_encodings: tuple[str, ...] = ("float32", "float16")) -> None:
    """Raise ConfigError on an invalid distillation / wire setting."""
    prefix = "strategy.params."
    if p.distill_epochs < 0:
        raise ConfigError(f"'{prefix}distill_epochs' must be >= 0, got {p.distill_epochs}")
    if p.distill_lr <= 0:
        raise ConfigError(f"'{prefix}distill_lr' must be > 0, got {p.distill_lr}")
    if p.distill_batch_size <= 0:
        raise ConfigError(f"'{prefix}distill_batch_size' must be a positive integer, got {p.distill_batch_size}")
    if p.distill_optimizer not in OPTIMIZERS:
        raise ConfigError(f"'{prefix}distill_optimizer' is '{p.distill_optimizer}'; allowed: {', '.join(OPTIMIZERS)}")
    if p.distill_clip_norm < 0:
        raise ConfigError(f"'{prefix}distill_clip_norm' must be >= 0 (0 = off), got {p.distill_clip_norm}")
    if p.pretrain_epochs < 0:
        raise ConfigError(f"'{prefix}pretrain_epochs' must be >= 0 (0 = client.epochs), got {p.pretrain_epochs}")
    if p.encoding not in allowed_encodings:
        raise ConfigError(f"'{prefix}encoding' is '{p.encoding}'; allowed: {', '.join(allowed_encodings)}")


def collect_predictions(replies: list[ClientReply], rows: int, num_classes: int, kind: str,
                        server_round: int = 0) -> tuple[list[ClientReply], np.ndarray]:
    """Decoded predictions of the usable replies, stacked clients×rows(×M); bad ones are dropped and logged."""
    used: list[ClientReply] = []
    arrays: list[np.ndarray] = []
    for r in sorted(replies, key=lambda r: r.client_id):
        wire = (r.predictions or {}).get("predictions")
        reason = "no 'predictions' array" if wire is None else pseudolabels.prediction_problem(wire, rows, num_classes, kind)
        if reason:
            log.warning("round %d: predictions of client %d not used: %s", server_round, r.client_id, reason)
            continue
        used.append(r)
        arrays.append(pseudolabels.decode(wire, num_classes))
    if not arrays:
        return used, np.zeros((0, rows) if kind == "hard" else (0, rows, num_classes))
    return used, np.stack(arrays)


def index_array(rows: np.ndarray, public_size: int) -> np.ndarray:
    """Row indices of U in the smallest unsigned integer type that holds them."""
    return np.asarray(rows).astype(pseudolabels.label_dtype(public_size))


class PseudoLabelStrategy(PersonalisedStrategy):
    """Clients distil on server targets on U, train, evaluate, and predict on U — one message per round."""

    needs_public_set = True
    model_agnostic = True

    def __init__(self, cfg: ExperimentConfig, on_round: Any = None) -> None:
        super().__init__(cfg, on_round)
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

    def expect_predictions(self) -> bool:
        return True

    def message_config(self, server_round: int, distill_loss: str, predict_output: str, predict_encoding: str,
                       weighting: str = "none") -> dict[str, Any]:
        """Base settings plus the public-set fingerprint, the distill / predict sections and round 1's epochs."""
        p = self.params
        first = {"train.epochs": int(p.pretrain_epochs)} if server_round == 1 and p.pretrain_epochs > 0 else {}
        return {
            **first,
            **self.base_config(),
            "public.fingerprint": self.public_fingerprint,
            "distill.epochs": int(p.distill_epochs),
            "distill.lr": float(p.distill_lr),
            "distill.batch_size": int(p.distill_batch_size),
            "distill.optimizer": str(p.distill_optimizer),
            "distill.clip_norm": float(p.distill_clip_norm),
            "distill.drop_last": False,
            "distill.loss": distill_loss,
            "distill.weighting": weighting,
            "predict.output": predict_output,
            "predict.encoding": predict_encoding,
        }

    @staticmethod
    def round_ops(with_distill: bool, first: tuple[str, ...] = ()) -> list[str]:
        """distill → train → evaluate (own model, after training: the round's accuracy) → predict."""
        return [*first, *(["distill"] if with_distill else []), "train", "evaluate", "predict"]


def targets_record(targets: np.ndarray | None, distill_rows: np.ndarray | None = None,
                   predict_rows: np.ndarray | None = None) -> ArrayRecord | None:
    """The 'targets' record: encoded targets, and optional 'distill-indices' / 'predict-indices' into U."""
    arrays: dict[str, np.ndarray] = {}
    if targets is not None:
        arrays["targets"] = targets
        if distill_rows is not None:
            arrays["distill-indices"] = distill_rows
    if predict_rows is not None:
        arrays["predict-indices"] = predict_rows
    return protocol.arrays_record(arrays) if arrays else None


# --------------------------------------------------------------------------- FedMD maths


def fedmd_consensus(scores: np.ndarray) -> np.ndarray:
    """Consensus = plain mean over clients of their class scores (clients×n×M → n×M), as in FedMD."""
    if scores.ndim != 3 or scores.shape[0] == 0:
        raise ValueError(f"expected clients×samples×classes with at least one client, got {scores.shape}")
    return scores.astype(np.float64).mean(axis=0).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax (numerically stable)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def alignment_subset(rng: np.random.Generator, public_size: int, size: int) -> np.ndarray | None:
    """Sorted random subset of U's rows of the given size; None (= all of U) when size is 0 or ≥ |U|."""
    if size <= 0 or size >= public_size:
        return None
    return np.sort(rng.choice(public_size, size=size, replace=False))


# --------------------------------------------------------------------------- the strategy


@dataclass
class FedMDParams(DistillParams):
    """FedMD's parameters (beside the shared distillation settings)."""

    scores: str = "logits"  # what clients send and the server averages: logits (original) | probs
    digest_loss: str = "mae"  # mae: L1 on logits (original; needs scores=logits) | kl: KL on softmax targets
    alignment_size: int = 0  # rows of U per round (original: 5,000); 0 = all of U
    pretrain_public_epochs: int = 0  # >0: round 1 first trains on U WITH its true labels (original; off by default)
    pretrain_lr: float = 1e-3  # learning rate of that labelled pre-training


class FedMD(PseudoLabelStrategy):
    """One consensus (mean class scores on an alignment subset of U) for all; digest then revisit."""

    name = "fedmd"
    Params = FedMDParams

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        p: FedMDParams = cfg.strategy.params
        check_distill_params(p)
        if p.scores not in ("logits", "probs"):
            raise ConfigError(f"'strategy.params.scores' is '{p.scores}'; allowed: logits, probs")
        if p.digest_loss not in ("mae", "kl"):
            raise ConfigError(f"'strategy.params.digest_loss' is '{p.digest_loss}'; allowed: mae, kl")
        if p.digest_loss == "mae" and p.scores != "logits":
            raise ConfigError("'strategy.params.digest_loss: mae' regresses logits onto logits; "
                              "set 'scores: logits', or use 'digest_loss: kl' with 'scores: probs'")
        if p.alignment_size < 0:
            raise ConfigError(f"'strategy.params.alignment_size' must be >= 0 (0 = all of U), got {p.alignment_size}")
        if p.pretrain_public_epochs < 0:
            raise ConfigError(f"'strategy.params.pretrain_public_epochs' must be >= 0, got {p.pretrain_public_epochs}")
        if p.pretrain_lr <= 0:
            raise ConfigError(f"'strategy.params.pretrain_lr' must be > 0, got {p.pretrain_lr}")

    def __init__(self, cfg: ExperimentConfig, on_round: Any = None) -> None:
        super().__init__(cfg, on_round)
        p: FedMDParams = self.params
        if p.pretrain_public_epochs > 0 and not self.public_has_labels:
            raise ConfigError("'strategy.params.pretrain_public_epochs' > 0 needs a LABELLED public set, "
                              "but this data source's U has no labels; set it to 0")
        self.subset_rng = np.random.default_rng([cfg.seed, 0xFED3D])
        self.consensus: np.ndarray | None = None  # n_sub×M, on self.consensus_rows
        self.consensus_rows: np.ndarray | None = None  # None = all of U
        self.pending_rows: np.ndarray | None = None  # the subset clients predict on this round

    def round_messages(self, server_round: int, node_ids: list[int], grid: Grid) -> list[Message]:
        p: FedMDParams = self.params
        self.pending_rows = alignment_subset(self.subset_rng, self.public_size, p.alignment_size)
        config = self.message_config(server_round, p.digest_loss, p.scores, p.encoding)
        first: tuple[str, ...] = ()
        if server_round == 1 and p.pretrain_public_epochs > 0:
            first = ("train-public",)
            config.update({"train-public.epochs": int(p.pretrain_public_epochs), "train-public.lr": float(p.pretrain_lr)})
        wire = None
        if self.consensus is not None:
            target = self.consensus if p.digest_loss == "mae" or p.scores == "probs" else softmax(self.consensus)
            wire = pseudolabels.encode(target, p.encoding, self.num_classes)
        targets = targets_record(
            wire,
            None if self.consensus_rows is None else index_array(self.consensus_rows, self.public_size),
            None if self.pending_rows is None else index_array(self.pending_rows, self.public_size),
        )
        ops = self.round_ops(wire is not None, first)
        return [protocol.build_message(n, server_round, ops, config, targets=targets) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        rows = self.public_size if self.pending_rows is None else len(self.pending_rows)
        used, scores = collect_predictions(replies, rows, self.num_classes, self.params.scores, server_round)
        if not used:
            log.warning("round %d: no usable scores; the consensus stays as it was", server_round)
            return {"consensus_clients": 0}
        self.consensus = fedmd_consensus(scores)
        self.consensus_rows = self.pending_rows
        return {"consensus_clients": len(used), "alignment_rows": rows,
                "diag_consensus_acc_on_U": self.oracle_accuracy(self.consensus.argmax(axis=1), self.consensus_rows)}
