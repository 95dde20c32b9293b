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
  each count and the noisy arg-max is released (:func:`gnmax_labels`). One client casts one vote per row, so adding
  or removing it moves the n×K count matrix by sqrt(n) in L2 (:func:`gnmax_sensitivity`).
- Accounting (:func:`gaussian_epsilon`): the Gaussian mechanism with noise multiplier σ (noise std / sensitivity),
  composed over the rounds, optionally amplified by sampling a fraction of the clients per round, through
  dp-accounting's RDP accountant.

These are pure functions, not yet wired into a strategy (docs/privacy.md says what is and is not implemented).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


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


def gnmax_labels(labels: np.ndarray, num_classes: int, noise_std: float, rng: np.random.Generator) -> np.ndarray:
    """GNMax (Papernot et al. 2018): per row of U, the arg-max of the clients' vote counts plus N(0, noise_std²) on
    every count. Adding or removing one client moves the count matrix by :func:`gnmax_sensitivity` in L2."""
    counts = vote_counts(labels, num_classes)
    return np.argmax(counts + gaussian_noise(counts.shape, noise_std, rng), axis=1)


def gnmax_sensitivity(queries: int) -> float:
    """L2 sensitivity of the n×K vote counts of ``queries`` rows to one client: one vote per row, so sqrt(n)."""
    return math.sqrt(queries)


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
