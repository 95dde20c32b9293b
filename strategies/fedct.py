"""FedCT (Abourayya et al., AAAI 2025): federated co-training with hard labels only.

Each round every client sends its HARD labels on U (argmax; the smallest unsigned integer type that
holds M classes plus the abstain marker — uint8 for ≤ 255 classes, so |U| bytes). The server takes a
per-sample majority vote (ties → the lowest class id) and broadcasts it; with ``qualified_threshold`` > 0
only samples whose winning class has at least that share of the votes get a label, the rest abstain
(encoded as M) and are left out of every client's loss. Clients fit U with the consensus labels (CE),
then their private data (CE), evaluate their own model, and send fresh labels — one message per round.

Under ``privacy.mode: client`` the server releases the vote as GNMax (Papernot et al. 2018): Gaussian noise of std
σ·sqrt(|U|) on every vote count before the arg-max (and the qualified share) is taken (docs/privacy.md).

Difference from the original, on purpose: the original trains each client on the union of its private
data and the pseudo-labelled U in one pass; here the generic client's ``distill`` (CE on U) runs before
``train`` (CE on private data) in the same message, which keeps the protocol shared with COSMOS and ends
every round on the client's own distribution (what the personalised evaluation measures).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedapps.config import ConfigError, ExperimentConfig
from fedapps.params import param
from fedapps.server import client_privacy
from fedapps.server.strategy import RunContext
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from strategies.pseudolabel_base import DistillParams, PseudoLabelStrategy, collect_predictions

log = logging.getLogger("fedapps")


def vote_counts(votes: np.ndarray, num_classes: int) -> np.ndarray:
    """Votes (clients×n, values 0..M with M = abstain) → per-sample counts per class (n×M); abstentions ignored."""
    votes = np.asarray(votes, dtype=np.int64)
    if votes.ndim != 2:
        raise ValueError(f"expected clients×samples labels, got shape {votes.shape}")
    if votes.size and (votes.min() < 0 or votes.max() > num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}] ({num_classes} = abstain)")
    n = votes.shape[1]
    counts = np.zeros((n, num_classes + 1), dtype=np.int64)
    cols = np.broadcast_to(np.arange(n), votes.shape)
    np.add.at(counts, (cols.ravel(), votes.ravel()), 1)
    return counts[:, :num_classes]


def majority_vote(votes: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample plurality label (ties → lowest class id) and its agreement (winner's share of the votes cast).

    A sample nobody voted on gets the abstain label M and agreement 0.
    """
    return vote_of_counts(vote_counts(votes, num_classes), num_classes)


def vote_of_counts(counts: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`majority_vote` from per-sample counts (n×M; noisy ones too: a negative count counts as none)."""
    counts = np.clip(counts, 0, None)
    labels = counts.argmax(axis=1)  # argmax returns the first maximum: the lowest class id wins ties
    cast = counts.sum(axis=1)
    agreement = np.where(cast > 0, counts.max(axis=1) / np.where(cast > 0, cast, 1), 0.0)
    labels = np.where(cast > 0, labels, num_classes)
    return labels.astype(np.int64), agreement


def qualified(labels: np.ndarray, agreement: np.ndarray, num_classes: int, threshold: float) -> np.ndarray:
    """The vote's labels, but samples whose agreement is below ``threshold`` abstain (label M = ``num_classes``)."""
    return np.where(agreement >= threshold, labels, num_classes)


@dataclass
class FedCTParams(DistillParams):
    """FedCT's parameters (beside the shared distillation settings; 'encoding' is always hard here)."""

    qualified_threshold: float = param(
        0.0, ge=0, le=1, help="0 = plain majority; in (0, 1]: label only samples with this vote share"
    )
    encoding: str = param("hard", choices=("hard",), help="labels on the wire, both directions (fixed: hard)")


class FedCT(PseudoLabelStrategy):
    """Majority (or qualified) vote of hard labels on U; clients train with CE on U's consensus and their data."""

    name = "fedct"
    Params = FedCTParams

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: FedCTParams) -> None:
        super().check_config(cfg, params)
        if cfg.privacy.mode == client_privacy.CLIENT_MODE and cfg.privacy.clip_norm > 0:
            raise ConfigError(
                "'privacy.clip_norm' does not apply to fedct under privacy.mode client: a client casts one vote "
                "per row of U, so its votes move the vote counts by sqrt(rows) whatever their values (GNMax's "
                "noise is σ·sqrt(rows)); remove privacy.clip_norm"
            )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.consensus: np.ndarray | None = None  # hard labels on U (M = abstain)

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        wire = None  # no consensus yet, or all abstain: skip U
        if self.consensus is not None and np.any(self.consensus < self.num_classes):
            wire = pseudolabels.encode(self.consensus, "hard", self.num_classes)
        targets = protocol.Targets(wire).encode()
        request = self.round_request(server_round, self.round_ops(wire is not None), "ce", "probs", "hard")
        return [protocol.Draft(n, request, targets=targets) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        used, votes = collect_predictions(replies, self.public_size, self.num_classes, "hard")
        if not used:
            self.replies.skip_round(server_round, "no usable labels; the consensus stays as it was")
            return {"vote_clients": 0}
        if self.client_dp is None:
            labels, agreement = majority_vote(votes, self.num_classes)
        else:  # GNMax: the vote counts released with Gaussian noise, the vote taken from them
            labels, agreement = vote_of_counts(self.noisy_counts(server_round, votes), self.num_classes)
        if self.params.qualified_threshold > 0:
            labels = qualified(labels, agreement, self.num_classes, self.params.qualified_threshold)
        self.consensus = labels
        abstain = float(np.mean(labels == self.num_classes))
        log.info(
            "round %d: FedCT vote of %d clients, mean agreement %.3f, abstain %.1f%%",
            server_round,
            len(used),
            float(agreement.mean()),
            100 * abstain,
        )
        voted = labels < self.num_classes
        out = {
            "vote_clients": len(used),
            "vote_agreement": float(agreement.mean()),
            "vote_abstain": abstain,
            "diag_vote_acc_on_U": self.oracle_accuracy(labels[voted], np.flatnonzero(voted)),
        }
        return out if self.client_dp is None else {**out, **self.client_dp.record(r.client_id for r in used)}

    def noisy_counts(self, server_round: int, votes: np.ndarray) -> np.ndarray:
        """privacy.mode client: the n×M vote counts plus N(0, σ²·n) on every count (GNMax; one client's votes move
        them by sqrt(n) in L2, :func:`fedapps.server.client_privacy.gnmax_sensitivity`)."""
        assert self.client_dp is not None
        counts = vote_counts(votes, self.num_classes).astype(np.float64)
        std = self.client_dp.vote_noise_std(counts.shape[0])
        return counts + client_privacy.gaussian_noise(counts.shape, std, self.client_dp.noise_rng(server_round))
