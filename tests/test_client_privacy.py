"""Client-level differential privacy of the pseudo-label exchange (fedapps/server/client_privacy.py): the clip bounds
one client's contribution, the noise's scale, GNMax, and the accountant against another library's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedapps.server import client_privacy as cp

dp_accounting = pytest.importorskip("dp_accounting", reason="the accountant comes with the extra privacy")


def honest_clients(k=6, n=40, classes=5, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.dirichlet(np.ones(classes), size=n) for _ in range(k)]


def test_clipping_scales_down_to_the_bound_and_never_up():
    x = np.full((4, 3), 2.0)  # norm sqrt(12 * 4) ≈ 6.93
    clipped = cp.clip_contribution(x, 1.5)
    assert np.linalg.norm(clipped) == pytest.approx(1.5)
    np.testing.assert_allclose(clipped / np.linalg.norm(clipped), x / np.linalg.norm(x))  # the direction is kept
    small = np.full((4, 3), 0.01)
    np.testing.assert_array_equal(cp.clip_contribution(small, 1.5), small)
    with pytest.raises(ValueError):
        cp.clip_contribution(x, 0.0)


@pytest.mark.parametrize("adversary", ["huge", "negative", "one-hot-flip", "nan-free-spike"])
def test_an_adversarial_client_moves_the_clipped_sum_by_at_most_c(adversary):
    """Whatever one client sends (added to the others', or replacing its honest predictions), the noiseless clipped sum
    moves by at most C (add/remove) or 2C (replace) in L2: the sensitivity the noise is calibrated to."""
    bound = 1.0
    clients = honest_clients()
    n, k = clients[0].shape
    rng = np.random.default_rng(1)
    evil = {
        "huge": np.full((n, k), 1e6),
        "negative": -50 * rng.random((n, k)),
        "one-hot-flip": np.eye(k)[rng.integers(0, k, n)] * 1e3,
        "nan-free-spike": np.pad(np.array([[1e9]]), ((0, n - 1), (0, k - 1))),
    }[adversary]
    base = cp.clipped_sum(clients, bound)
    added = cp.clipped_sum([*clients, evil], bound)
    assert np.linalg.norm(added - base) <= bound * (1 + 1e-12)
    assert np.linalg.norm(added - base) == pytest.approx(bound)  # the bound is reached: the clip binds
    replaced = cp.clipped_sum([evil, *clients[1:]], bound)
    assert np.linalg.norm(replaced - base) <= 2 * bound * (1 + 1e-12)


def test_the_noise_has_standard_deviation_sigma_times_c():
    """Zero contributions: the noisy sum is the noise alone; 100,000 entries tell σ·C = 3.0 from σ = 1.5, σ·C² = 6,
    σ²·C = 4.5 and σ·C/n (±2 %)."""
    zeros = [np.zeros((500, 10)) for _ in range(20)]
    noise = cp.noisy_sum(zeros, 2.0, 1.5, np.random.default_rng(0))
    assert abs(noise.mean()) < 0.05
    assert noise.std() == pytest.approx(3.0, rel=0.02)
    mean = cp.noisy_mean(zeros, 2.0, 1.5, np.random.default_rng(0), denominator=20)
    np.testing.assert_allclose(mean, noise / 20)  # the mean is the noisy sum over the public count
    with pytest.raises(ValueError):
        cp.noisy_mean(zeros, 2.0, 1.5, np.random.default_rng(0), denominator=0)


def test_gnmax_counts_votes_with_sensitivity_sqrt_n():
    labels = np.array([[0, 1, 2, 2], [0, 1, 2, 1], [0, 2, 2, 1]])  # 3 clients, 4 rows of U, 3 classes
    counts = cp.vote_counts(labels, 3)
    np.testing.assert_array_equal(counts, [[3, 0, 0], [0, 2, 1], [0, 0, 3], [0, 2, 1]])
    # one client more or less moves the n×K counts by sqrt(n) in L2: one vote per row
    fewer = cp.vote_counts(labels[:2], 3)
    assert np.linalg.norm(counts - fewer) == pytest.approx(cp.gnmax_sensitivity(4))
    with pytest.raises(ValueError):
        cp.vote_counts(np.array([[0, 3]]), 3)


@pytest.mark.parametrize(
    "sigma, rounds, delta, rate",
    [(1.0, 1, 1e-5, 1.0), (2.0, 50, 1e-5, 1.0), (1.2, 100, 1e-6, 0.1), (5.0, 20, 1e-5, 1.0)],
)
def test_the_accountant_matches_opacus(sigma, rounds, delta, rate):
    """dp-accounting's ε of the Gaussian mechanism over rounds against Opacus's RDP accountant (another
    implementation), on the same RDP orders."""
    pytest.importorskip("opacus", reason="the reference accountant comes with the extra privacy")
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    got = cp.gaussian_epsilon(sigma, rounds, delta, rate)
    rdp = compute_rdp(q=rate, noise_multiplier=sigma, steps=rounds, orders=DEFAULT_RDP_ORDERS)
    reference, _ = get_privacy_spent(orders=DEFAULT_RDP_ORDERS, rdp=rdp, delta=delta)
    # the Gaussian alone: the same closed form in both; subsampled, their fractional-order series differ by ~1e-4
    assert got == pytest.approx(reference, rel=1e-9 if rate == 1.0 else 1e-3)
    assert (
        cp.gaussian_epsilon(sigma, rounds + 1, delta, rate)
        > got
        > cp.gaussian_epsilon(sigma * 1.05, rounds, delta, rate)
    )


def test_one_gaussian_release_is_close_to_the_classical_bound():
    """One release with σ = sqrt(2 ln(1.25/δ))/ε is (ε, δ)-DP (Dwork & Roth, Thm A.1, ε < 1); RDP's ε is at most
    that."""
    eps, delta = 0.5, 1e-5
    sigma = math.sqrt(2 * math.log(1.25 / delta)) / eps
    assert cp.gaussian_epsilon(sigma, 1, delta) <= eps
    assert cp.gaussian_epsilon(sigma, 0, delta) == 0.0
