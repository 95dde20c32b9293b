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

Robust option ``consensus`` (default ``mean``, the original: the plain mean of the scores as sent). Raw logits let one
client outvote everybody: logits of ±1e4 on every row of U (inside the validator's bound) make the mean's argmax
that client's class on every row. ``probs`` turns each client's scores into probabilities first (the softmax of its
logits; probabilities as sent) and averages those, so one client of K moves a consensus row by at most 2/K in L1
however large its logits; ``median`` takes their coordinate-wise median (renormalised), which a minority cannot move
beyond the honest clients' range. Either way the consensus is a probability row: the KL digest receives it as it
is, the MAE digest (logits) receives its log (:func:`consensus_logits`), logits whose softmax is the consensus.

Under ``privacy.mode: client`` the consensus is released with client-level DP (:meth:`FedMD.private_consensus`,
docs/privacy.md): each client's scores clipped, Gaussian noise on their sum, the mean over the round's cohort.

The machinery FedMD, FedCT and COMET share is in :mod:`strategies.pseudolabel_base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, client_op
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.seeds import derive_rng
from fedapps.server import client_privacy
from fedapps.server.strategy import RunContext
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from strategies.pseudolabel_base import DistillParams, PseudoLabelStrategy, collect_predictions, index_array

# --------------------------------------------------------------------------- FedMD maths


def fedmd_consensus(scores: np.ndarray) -> np.ndarray:
    """Consensus = plain mean over clients of their class scores (clients×n×M → n×M), as in FedMD."""
    if scores.ndim != 3 or scores.shape[0] == 0:
        raise ValueError(f"expected clients×samples×classes with at least one client, got {scores.shape}")
    return scores.astype(np.float64).mean(axis=0).astype(np.float32)


CONSENSUS_RULES = ("mean", "probs", "median")
LOG_FLOOR = 1e-6  # the smallest probability consensus_logits takes the log of (log 1e-6 ≈ -13.8)


def robust_consensus(scores: np.ndarray, kind: str, rule: str) -> np.ndarray:
    """A consensus on PROBABILITIES (clients×n×M → n×M): each client's rows as probabilities (``kind`` logits: their
    softmax; probs: as sent), then their mean (``probs``) or coordinate-wise median, renormalised (``median``)."""
    if scores.ndim != 3 or scores.shape[0] == 0:
        raise ValueError(f"expected clients×samples×classes with at least one client, got {scores.shape}")
    if rule not in ("probs", "median"):
        raise ValueError(f"robust consensus rule '{rule}'; allowed: probs, median")
    probs = softmax(scores.astype(np.float64)) if kind == "logits" else np.asarray(scores, dtype=np.float32)
    return pseudolabels.aggregate(probs.astype(np.float32), "mean" if rule == "probs" else "median").astype(np.float32)


def consensus_logits(probs: np.ndarray) -> np.ndarray:
    """Logits whose softmax is ``probs``: log(max(p, :data:`LOG_FLOOR`)) (what the MAE digest regresses onto)."""
    return np.log(np.maximum(np.asarray(probs, dtype=np.float64), LOG_FLOOR)).astype(np.float32)


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


# --------------------------------------------------------------------------- client side


TRAIN_PUBLIC = "train-public"  # the operation below and its settings section (train-public.*)


@client_op(TRAIN_PUBLIC)
def train_public(w, tag: str) -> None:
    """CE on U with its TRUE labels (the original's labelled-public pre-training; settings ``train-public.*``)."""
    if w.fed.public_x is None or w.fed.public_y is None:
        raise ProtocolError("train-public needs a labelled public set U (data.public_fraction > 0)")
    result = ops.train(
        w.model, w.fed.public_x, w.fed.public_y, w.settings(TRAIN_PUBLIC), None, w.generator, public=True
    )
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


# --------------------------------------------------------------------------- the strategy


@dataclass
class FedMDParams(DistillParams):
    """FedMD's parameters (beside the shared distillation settings)."""

    scores: str = param(
        "logits",
        choices=("logits", "probs"),
        help="what clients send and the server averages: logits (original) | probs",
    )
    digest_loss: str = param(
        "mae",
        choices=("mae", "kl"),
        help="mae: L1 on logits (original; needs scores=logits) | kl: KL on softmax targets",
    )
    alignment_size: int = param(0, ge=0, help="rows of U per round (original: 5,000); 0 = all of U")
    pretrain_public_epochs: int = param(
        0, ge=0, help="> 0: round 1 first trains on U WITH its true labels (original; off by default)"
    )
    pretrain_lr: float = param(1e-3, gt=0, help="learning rate of that labelled pre-training")
    consensus: str = param(
        "mean",
        choices=CONSENSUS_RULES,
        help="mean: the plain mean of the scores as sent (original) | robust options on "
        "probabilities (each client's softmax): probs, their mean | median, their "
        "coordinate-wise median",
    )


class FedMD(PseudoLabelStrategy):
    """One consensus (mean class scores on an alignment subset of U) for all; digest then revisit."""

    name = "fedmd"
    Params = FedMDParams

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: FedMDParams) -> None:
        super().check_config(cfg, params)
        if params.digest_loss == "mae" and params.scores != "logits":
            raise ConfigError(
                "'strategy.params.fedmd.digest_loss: mae' regresses logits onto logits; "
                "set 'scores: logits', or use 'digest_loss: kl' with 'scores: probs'"
            )
        if cfg.privacy.mode != client_privacy.CLIENT_MODE:
            return
        if params.consensus == "median":
            raise ConfigError(
                "'strategy.params.fedmd.consensus: median' under privacy.mode client: the noise is calibrated to a "
                "sum, in which one client moves the result by at most privacy.clip_norm; use consensus mean or probs"
            )
        if params.scores == "logits" and params.consensus == "mean" and cfg.privacy.clip_norm <= 0:
            raise ConfigError(
                "fedmd averages raw logits ('strategy.params.fedmd.scores: logits', consensus mean), which have no "
                "natural bound: under privacy.mode client set 'privacy.clip_norm' to the Frobenius norm each "
                "client's logits on U are clipped to (e.g. 10), or use consensus probs"
            )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        p: FedMDParams = self.params
        if p.pretrain_public_epochs > 0 and not self.public_has_labels:
            raise ConfigError(
                "'strategy.params.fedmd.pretrain_public_epochs' > 0 needs a LABELLED public set, "
                "but this data source's U has no labels; set it to 0"
            )
        self.subset_rng = derive_rng(cfg.seed, "fedmd-alignment-subset")
        self.consensus: np.ndarray | None = (
            None  # n_sub×M, on self.consensus_rows (probabilities unless consensus mean)
        )
        self.consensus_rows: np.ndarray | None = None  # None = all of U
        self.pending_rows: np.ndarray | None = None  # the subset clients predict on this round

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        p: FedMDParams = self.params
        self.note_cohort(node_ids)
        self.pending_rows = alignment_subset(self.subset_rng, self.public_size, p.alignment_size)
        first: tuple[str, ...] = ()
        sections: dict[str, protocol.Section] = {}
        if server_round == 1 and p.pretrain_public_epochs > 0:
            first = (TRAIN_PUBLIC,)
            sections[TRAIN_PUBLIC] = protocol.Section(epochs=int(p.pretrain_public_epochs), lr=float(p.pretrain_lr))
        wire = None
        if self.consensus is not None:
            if p.consensus != "mean":  # a consensus on probabilities
                target = consensus_logits(self.consensus) if p.digest_loss == "mae" else self.consensus
            else:
                target = self.consensus if p.digest_loss == "mae" or p.scores == "probs" else softmax(self.consensus)
            wire = pseudolabels.encode(target, p.encoding, self.num_classes)
        targets = protocol.Targets(
            wire,
            None if self.consensus_rows is None else index_array(self.consensus_rows, self.public_size),
            None if self.pending_rows is None else index_array(self.pending_rows, self.public_size),
        ).encode()
        request = self.round_request(
            server_round,
            self.round_ops(wire is not None, first),
            p.digest_loss,
            p.scores,
            p.encoding,
            sections=sections,
        )
        return [protocol.Draft(n, request, targets=targets) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        rows = self.public_size if self.pending_rows is None else len(self.pending_rows)
        used, scores = collect_predictions(replies, rows, self.num_classes, self.params.scores)
        if not used:
            self.replies.skip_round(server_round, "no usable scores; the consensus stays as it was")
            return {"consensus_clients": 0}
        p: FedMDParams = self.params
        if self.client_dp is not None:
            self.consensus = self.private_consensus(server_round, scores)
        else:
            self.consensus = (
                fedmd_consensus(scores) if p.consensus == "mean" else robust_consensus(scores, p.scores, p.consensus)
            )
        self.consensus_rows = self.pending_rows
        out = {
            "consensus_clients": len(used),
            "alignment_rows": rows,
            "diag_consensus_acc_on_U": self.oracle_accuracy(self.consensus.argmax(axis=1), self.consensus_rows),
        }
        return out if self.client_dp is None else {**out, **self.client_dp.record(r.client_id for r in used)}

    def private_consensus(self, server_round: int, scores: np.ndarray) -> np.ndarray:
        """privacy.mode client: the consensus as one release of :class:`fedapps.server.client_privacy.ClientLevelDP`:
        each client's scores (consensus probs: their softmax) clipped to privacy.clip_norm, summed, noised, divided by
        the cohort the round's messages went to (a public count); a consensus of probabilities is made probability
        rows again (post-processing)."""
        p: FedMDParams = self.params
        dp = self.client_dp
        assert dp is not None
        if not dp.cohort:
            raise RuntimeError("fedmd: no cohort noted for the round (round_messages notes it)")
        per_client = softmax(scores.astype(np.float64)) if p.consensus == "probs" and p.scores == "logits" else scores
        mean = dp.noisy_mean(list(per_client), len(dp.cohort), dp.noise_rng(server_round))
        probabilities = p.consensus == "probs" or p.scores == "probs"
        return (client_privacy.as_probabilities(mean) if probabilities else mean).astype(np.float32)
