"""Client-level differential privacy of the pseudo-label exchange: the server's mechanisms and their accountant.

The unit of privacy is a whole CLIENT: adding or removing one client's predictions on the public set U must change
what the server releases (the aggregate its clients distil towards) little. The server is trusted with the raw
predictions and adds the noise (central DP); docs/privacy.md derives the sensitivities.

- Soft predictions (FedMD, COMET, COSMOS's cluster sums): each client's n×K matrix is scaled down to Frobenius norm at
  most C (:func:`clip_contribution`), the matrices are summed (adding or removing one client moves the sum by at most
  C in L2: the sensitivity), and Gaussian noise N(0, σ²C²) is added to every entry (:func:`noisy_sum`); the noisy
  mean divides by a public count (the cohort the server sampled, not the number that answered: that count is itself
  private) (:func:`noisy_mean`).
- Hard labels (FedCT, PATE's GNMax): per row of U the clients' votes are counted, Gaussian noise N(0, σ²) is added to
  each count and the noisy arg-max is released (FedCT's vote on its noisy counts). One client casts one vote per row,
  so adding or removing it moves the n×K count matrix by sqrt(n) in L2 (:func:`gnmax_sensitivity`).
- Accounting (:func:`gaussian_epsilon`): the Gaussian mechanism with noise multiplier σ (noise std / sensitivity),
  composed over the rounds, optionally amplified by sampling a fraction of the clients per round, through
  dp-accounting's RDP accountant.

- A run's mechanism (:class:`ClientLevelDP`, ``privacy.mode: client``): the settings, where the noise comes from, and
  per client how many of the server's releases its predictions entered, from which its ε comes; a strategy that
  supports the mode (COSMOS, FedMD, FedCT, COMET) holds one and releases through it. Each client enters at most one
  release per round (the clusters' sums are over disjoint sets of clients), so the releases compose over rounds
  and ``privacy.epsilon_budget`` ends the run before a release could take a client past it
  (:meth:`ClientLevelDP.stop_reason`).

docs/privacy.md says what the guarantee covers per strategy, and what it does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from fedapps.config import PrivacyConfig
from fedapps.seeds import derive_rng

CLIENT_MODE = "client"  # privacy.mode of the server's client-level DP


def clip_contribution(values: np.ndarray, bound: float) -> np.ndarray:
    """One client's contribution scaled down (never up) to Frobenius (whole-array L2) norm at most ``bound``."""
    if bound <= 0:
        raise ValueError(f"the clipping bound must be > 0, got {bound}")
    values = np.asarray(values, dtype=np.float64)
    norm = float(np.linalg.norm(values))
    return values * (bound / norm) if norm > bound else values.copy()


def clipped_sum(contributions: Sequence[np.ndarray], bound: float) -> np.ndarray:
    """The sum of the clients' contributions, each clipped to norm ``bound`` first (no noise)."""
    if not contributions:
        raise ValueError("nothing to sum: no client contributed")
    return np.sum([clip_contribution(c, bound) for c in contributions], axis=0)


def gaussian_noise(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Independent N(0, std²) entries."""
    if std < 0:
        raise ValueError(f"the noise's standard deviation must be >= 0, got {std}")
    return rng.normal(0.0, std, size=shape)


def noisy_sum(
    contributions: Sequence[np.ndarray], bound: float, noise_multiplier: float, rng: np.random.Generator
) -> np.ndarray:
    """The clipped sum (:func:`clipped_sum`) plus N(0, σ²C²) on every entry: the Gaussian mechanism with sensitivity
    C = ``bound`` (one client added or removed) and noise multiplier σ."""
    total = clipped_sum(contributions, bound)
    return total + gaussian_noise(total.shape, noise_multiplier * bound, rng)


def noisy_mean(
    contributions: Sequence[np.ndarray],
    bound: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    denominator: int,
) -> np.ndarray:
    """:func:`noisy_sum` divided by a PUBLIC count ``denominator`` (e.g. the clients the server sampled this round):
    post-processing, so it costs no privacy; dividing by the number that answered would leak it."""
    if denominator <= 0:
        raise ValueError(f"the mean's denominator must be a positive count, got {denominator}")
    return noisy_sum(contributions, bound, noise_multiplier, rng) / denominator


def as_probabilities(rows: np.ndarray) -> np.ndarray:
    """A noisy aggregate of probability rows made a probability row again (post-processing, no privacy cost): negative
    entries set to 0, each row renormalised to sum 1; a row with nothing positive left becomes uniform."""
    rows = np.clip(np.asarray(rows, dtype=np.float64), 0.0, None)
    total = rows.sum(axis=-1, keepdims=True)
    uniform = np.full_like(rows, 1.0 / rows.shape[-1])
    return np.where(total > 0, rows / np.where(total > 0, total, 1.0), uniform)


def vote_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Clients' hard labels (clients × n, each in [0, K)) -> per row of U the votes per class (n × K)."""
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise ValueError(f"labels must be clients × samples, got shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    counts = np.zeros((labels.shape[1], num_classes), dtype=np.float64)
    rows = np.broadcast_to(np.arange(labels.shape[1]), labels.shape)
    np.add.at(counts, (rows.ravel(), labels.ravel()), 1.0)
    return counts


def gnmax_sensitivity(queries: int) -> float:
    """L2 sensitivity of the n×K vote counts of ``queries`` rows to one client: one vote per row, so sqrt(n)."""
    return math.sqrt(queries)


@lru_cache(maxsize=256)
def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float, sample_rate: float = 1.0) -> float:
    """ε at ``delta`` of the Gaussian mechanism with noise multiplier σ (noise std / L2 sensitivity) released
    ``rounds`` times, each round's participants drawn with probability ``sample_rate`` (1: every client every round,
    no amplification); dp-accounting's RDP accountant. 0 for no round."""
    if rounds <= 0:
        return 0.0
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        event = dp_accounting.PoissonSampledDpEvent(sample_rate, event)
    accountant = RdpAccountant()
    accountant.compose(event, int(rounds))
    return float(accountant.get_epsilon(delta))


@dataclass
class ClientLevelDP:
    """The server's client-level DP of one run (``privacy.mode: client``): the settings, the noise's source and the
    ledger ``releases`` (client id -> how many releases its predictions entered), from which each client's ε comes.

    ``clip_norm`` C: each client's n×K contribution is clipped to Frobenius norm C (0: sqrt(n), the largest norm of
    probability or one-hot rows, so that valid probabilities are never scaled); every release adds N(0, σ²·S²) to each
    entry, S its sensitivity (C for sums, sqrt(n) for vote counts). ``cohort``: the client ids the round's messages
    went to (the public count a mean divides by). The noise is drawn from the operating system's entropy, or with
    ``reproducible_noise`` from the run's ``seed`` (repeatable; no protection against whoever knows the seed)."""

    noise_multiplier: float
    clip_norm: float
    delta: float
    epsilon_budget: float
    reproducible_noise: bool
    seed: int
    releases: dict[int, int] = field(default_factory=dict)
    cohort: list[int] = field(default_factory=list)

    @classmethod
    def for_run(cls, privacy: PrivacyConfig, seed: int) -> ClientLevelDP | None:
        """The mechanism of a run whose ``privacy.mode`` is client; None for any other mode."""
        if privacy.mode != CLIENT_MODE:
            return None
        p = privacy
        return cls(p.noise_multiplier, p.clip_norm, p.delta, p.epsilon_budget, p.reproducible_noise, seed)

    def bound(self, rows: int) -> float:
        """C for an n-row contribution: ``clip_norm``, or sqrt(n) when it is 0."""
        return self.clip_norm if self.clip_norm > 0 else math.sqrt(rows)

    def noise_rng(self, server_round: int, *parts: int) -> np.random.Generator:
        """Where a release's noise comes from (see the class docstring); ``parts`` tell a round's releases apart."""
        if self.reproducible_noise:
            return derive_rng(self.seed, "client-level-dp-noise", server_round, *parts)
        return np.random.default_rng()

    def noisy_mean(self, contributions: Sequence[np.ndarray], denominator: int, rng: np.random.Generator) -> np.ndarray:
        """:func:`noisy_mean` of the contributions with this run's C (for their rows) and σ: one release."""
        if not contributions:
            raise ValueError("a release needs at least one contribution")
        rows = int(np.shape(contributions[0])[0])
        return noisy_mean(contributions, self.bound(rows), self.noise_multiplier, rng, denominator)

    def vote_noise_std(self, rows: int) -> float:
        """The std of GNMax's noise on n rows' vote counts: σ·sqrt(n) (:func:`gnmax_sensitivity`)."""
        return self.noise_multiplier * gnmax_sensitivity(rows)

    def epsilon(self, releases: int) -> float:
        """ε at δ of a client whose predictions entered ``releases`` releases."""
        return gaussian_epsilon(self.noise_multiplier, int(releases), self.delta)

    def record(self, clients: Iterable[int]) -> dict[str, Any]:
        """The round's release took these clients' predictions: count it; the round's rounds.csv columns, as sample
        mode names them: ``epsilon_client_<i>`` (ε so far of each client in the release) and ``epsilon_max`` (the
        largest ε of any client so far)."""
        ids = sorted({int(c) for c in clients})
        for cid in ids:
            self.releases[cid] = self.releases.get(cid, 0) + 1
        out: dict[str, Any] = {"epsilon_max": self.epsilon(max(self.releases.values(), default=0))}
        out.update({f"epsilon_client_{cid}": self.epsilon(self.releases[cid]) for cid in ids})
        return out

    def stop_reason(self, server_round: int) -> str:
        """Why no round may follow round ``server_round`` (the budget: one more release could take a client past
        it); '' when one may."""
        most = max(self.releases.values(), default=0)
        if self.epsilon_budget <= 0 or self.epsilon(most + 1) <= self.epsilon_budget:
            return ""
        return (
            f"privacy budget reached: after round {server_round} a client's predictions have entered {most} "
            f"release(s), ε = {self.epsilon(most):.4g} (δ = {self.delta:g}, σ = {self.noise_multiplier:g}); "
            f"one more would take it to ε = {self.epsilon(most + 1):.4g}, past privacy.epsilon_budget = "
            f"{self.epsilon_budget:g}, so the run ends here"
        )
