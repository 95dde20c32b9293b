"""The ℓ1 kernel behind COSMOS clustering: exact against a float64 brute force, whatever the shape or values."""

from __future__ import annotations

import numpy as np
import pytest

from fedapps.server.clustering import l2_distance_matrix
from fedapps.server.pairwise_l1 import compiled, l1_distance_matrix


def brute_force(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return np.abs(x[:, None, :] - x[None, :, :]).sum(axis=-1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13])  # tiled, left-over and mixed rows
@pytest.mark.parametrize("threads,block", [(1, 4096), (2, 16), (3, 7)])
def test_matches_brute_force(rows: int, threads: int, block: int) -> None:
    x = np.random.default_rng(rows).normal(size=(rows, 301)).astype(np.float32)  # signed values, odd width
    got = l1_distance_matrix(x, threads=threads, block=block)
    assert got.shape == (rows, rows) and got.dtype == np.float64
    np.testing.assert_allclose(got, brute_force(x), rtol=1e-5, atol=1e-3)
    assert np.array_equal(got, got.T) and np.all(np.diag(got) == 0)


def test_probability_rows_at_scale_and_identical_rows() -> None:
    rng = np.random.default_rng(1)
    x = rng.dirichlet(np.ones(10), size=(9, 2000)).reshape(9, -1).astype(np.float32)
    x[5] = x[2]  # an identical pair must come out as exactly 0, never negative
    got = l1_distance_matrix(x, threads=2, block=1000)
    np.testing.assert_allclose(got, brute_force(x), atol=2e-3)
    assert got[2, 5] == 0.0 and got.min() >= 0.0


def test_float64_and_non_contiguous_input_are_accepted() -> None:
    x = np.random.default_rng(2).random((6, 40))
    np.testing.assert_allclose(l1_distance_matrix(x[:, ::2]), brute_force(x[:, ::2]), atol=1e-4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(bad: float) -> None:
    x = np.ones((5, 50), dtype=np.float32)
    x[3, 17] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        l1_distance_matrix(x, threads=2, block=8)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="2-D"):
        l1_distance_matrix(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="block and threads"):
        l1_distance_matrix(np.zeros((2, 3)), block=0)


def test_kernels_still_compile_where_no_cache_directory_can_be_used(caplog: pytest.LogCaptureFixture) -> None:
    # a function without a source file has no cache locator: numba's cache=True raises at decoration time
    namespace: dict = {}
    exec("def triple(a):\n    return 3 * a\n", namespace)
    with caplog.at_level("WARNING", logger="fedapps"):
        triple = compiled()(namespace["triple"])
    assert triple(7) == 21
    assert "cannot cache triple" in caplog.text


# found by `make mutate`
def test_identical_rows_are_at_distance_zero_and_one_column_blocks_work() -> None:
    x = np.array([[0.2, 0.8, 0.0], [0.2, 0.8, 0.0], [1.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(np.diag(l2_distance_matrix(x)), 0.0)
    assert l2_distance_matrix(x)[0, 1] == 0.0
    np.testing.assert_allclose(l1_distance_matrix(x, block=1), [[0, 0, 1.6], [0, 0, 1.6], [1.6, 1.6, 0]], rtol=1e-6)
    # more threads asked for than there are blocks (3 columns in blocks of 2: 2 blocks): as many threads as blocks
    np.testing.assert_allclose(l1_distance_matrix(x, threads=3, block=2), l1_distance_matrix(x), rtol=1e-6)
