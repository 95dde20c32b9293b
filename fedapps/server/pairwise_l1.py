"""Exact pairwise ℓ1 distances between the rows of a large float32 matrix, fast on a few CPU cores.

COSMOS clusters clients by the ℓ1 distance between their predictions on the public set: N clients, each a row
of D = |U|·M values (200 × 10⁶ in the benchmark, 2·10¹⁰ element pairs). Two facts make this fast:

* ``|a − b| = a + b − 2·min(a, b)`` for any reals, so ‖x_i − x_j‖₁ = S_i + S_j − 2·Σ_k min(x_ik, x_jk) with S_i
  the row sums: one ``min`` and one ``add`` per element pair instead of a subtract, an absolute value and an add.
  S_i is taken as Σ_k min(x_ik, x_ik), rounded like the pair sums, so identical rows come out 0 (exactly, unless
  one of them is among the N mod 4 rows left over by the tiling).
* The pair sums are computed in 4×4 tiles of rows (16 running sums held in vector registers, 8 loads per 16
  pairs), over column blocks small enough to stay in cache, so the loop is bound by arithmetic, not memory.

Column blocks are dealt to worker threads as they become free (the kernels release the GIL), each thread
summing into its own matrix. Partial sums are float32 within a block and float64 across blocks, as precise as
a float32 ``pdist``; ``fastmath`` is used only where it cannot hide a NaN or an infinity (the row sums keep
IEEE semantics, so a non-finite input shows as a non-finite row sum and is refused).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

log = logging.getLogger("fedapps")

# reassociation (vectorised reductions) without assuming finite values, so NaN/inf still propagate
_SAFE_FASTMATH = {"reassoc", "nsz", "arcp", "contract"}


def compiled(fastmath: bool | set[str] = False) -> Callable[[Callable], Callable]:
    """numba.njit (GIL released), its machine code cached on disk when a cache directory is writable.

    numba refuses ``cache=True`` at decoration time when neither ``__pycache__`` next to the source nor the
    user's cache directory can be written (a read-only install and home); the kernel is then compiled once per
    process instead of failing the import. ``NUMBA_CACHE_DIR`` names another cache directory.
    """

    def decorate(function: Callable) -> Callable:
        try:
            return numba.njit(nogil=True, fastmath=fastmath, cache=True)(function)
        except RuntimeError as err:
            log.warning("numba cannot cache %s (%s); compiling it in this process", function.__name__, err)
            return numba.njit(nogil=True, fastmath=fastmath)(function)

    return decorate


@compiled(fastmath=True)
def _min_sums_4x4(x: np.ndarray, out: np.ndarray, i: int, j: int, c0: int, c1: int) -> None:
    """out[i+a, j+b] += Σ_{c0≤k<c1} min(x[i+a, k], x[j+b, k]) for a, b in 0..3."""
    r0 = x[i, c0:c1]
    r1 = x[i + 1, c0:c1]
    r2 = x[i + 2, c0:c1]
    r3 = x[i + 3, c0:c1]
    q0 = x[j, c0:c1]
    q1 = x[j + 1, c0:c1]
    q2 = x[j + 2, c0:c1]
    q3 = x[j + 3, c0:c1]
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0.0)
    for k in range(c1 - c0):
        a0, a1, a2, a3 = r0[k], r1[k], r2[k], r3[k]
        b0, b1, b2, b3 = q0[k], q1[k], q2[k], q3[k]
        s00 += min(a0, b0)
        s01 += min(a0, b1)
        s02 += min(a0, b2)
        s03 += min(a0, b3)
        s10 += min(a1, b0)
        s11 += min(a1, b1)
        s12 += min(a1, b2)
        s13 += min(a1, b3)
        s20 += min(a2, b0)
        s21 += min(a2, b1)
        s22 += min(a2, b2)
        s23 += min(a2, b3)
        s30 += min(a3, b0)
        s31 += min(a3, b1)
        s32 += min(a3, b2)
        s33 += min(a3, b3)
    out[i, j] += s00
    out[i, j + 1] += s01
    out[i, j + 2] += s02
    out[i, j + 3] += s03
    out[i + 1, j] += s10
    out[i + 1, j + 1] += s11
    out[i + 1, j + 2] += s12
    out[i + 1, j + 3] += s13
    out[i + 2, j] += s20
    out[i + 2, j + 1] += s21
    out[i + 2, j + 2] += s22
    out[i + 2, j + 3] += s23
    out[i + 3, j] += s30
    out[i + 3, j + 1] += s31
    out[i + 3, j + 2] += s32
    out[i + 3, j + 3] += s33


@compiled(fastmath=True)
def _min_sum_pair(x: np.ndarray, i: int, j: int, c0: int, c1: int) -> np.float32:
    """Σ_{c0≤k<c1} min(x[i, k], x[j, k]) (rows left over when N is not a multiple of 4)."""
    a = x[i, c0:c1]
    b = x[j, c0:c1]
    s = np.float32(0.0)
    for k in range(c1 - c0):
        s += min(a[k], b[k])
    return s


@compiled(fastmath=_SAFE_FASTMATH)
def _add_row_sums(x: np.ndarray, sums: np.ndarray, c0: int, c1: int) -> None:
    """sums[i] += Σ_{c0≤k<c1} x[i, k], NaN and infinity propagating."""
    for i in range(x.shape[0]):
        row = x[i, c0:c1]
        s = np.float32(0.0)
        for k in range(c1 - c0):
            s += row[k]
        sums[i] += s


@compiled()
def _accumulate_block(x: np.ndarray, mins: np.ndarray, sums: np.ndarray, c0: int, c1: int) -> None:
    """Add columns [c0, c1)'s contribution to the row sums and to the min-sum matrix's upper triangle and diagonal."""
    n = x.shape[0]
    tiled = n - n % 4
    for i in range(0, tiled, 4):
        for j in range(i, tiled, 4):  # diagonal tiles also fill a few lower-triangle cells, never read
            _min_sums_4x4(x, mins, i, j, c0, c1)
    for j in range(tiled, n):
        for i in range(j + 1):
            mins[i, j] += _min_sum_pair(x, i, j, c0, c1)
    _add_row_sums(x, sums, c0, c1)


def l1_distance_matrix(x: np.ndarray, threads: int = 1, block: int = 4096) -> np.ndarray:
    """N×N float64 matrix of ‖x_i − x_j‖₁ between the rows of x (N×D), symmetric with a zero diagonal.

    ``block`` columns are processed at a time (a cache-sized slice of all rows); blocks go to ``threads``
    threads dynamically. Raises ValueError when x holds a NaN or an infinity.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D matrix (rows × values), got shape {x.shape}")
    if block < 1 or threads < 1:
        raise ValueError(f"block and threads must be >= 1, got {block} and {threads}")
    n, d = x.shape
    starts = iter(range(0, d, block))
    lock = threading.Lock()

    def work() -> tuple[np.ndarray, np.ndarray]:
        mins, sums = np.zeros((n, n)), np.zeros(n)
        while True:
            with lock:
                c0 = next(starts, None)
            if c0 is None:
                return mins, sums
            _accumulate_block(x, mins, sums, c0, min(c0 + block, d))

    threads = max(1, min(threads, -(-d // block)))
    if threads == 1:
        parts = [work()]
    else:
        with ThreadPoolExecutor(threads) as pool:
            parts = [f.result() for f in [pool.submit(work) for _ in range(threads)]]
    mins = sum(p[0] for p in parts)
    if not np.all(np.isfinite(sum(p[1] for p in parts))):
        raise ValueError("cannot compute ℓ1 distances: the input contains NaN or infinite values")
    # S_i = Σ_k min(x_ik, x_ik), summed in the same order as the pair sums: identical rows give exactly 0
    own = np.diagonal(mins)
    upper = np.triu(own[:, None] + own[None, :] - 2.0 * mins, k=1)
    dist = np.maximum(upper, 0.0)  # rounding can leave -1e-9 where two rows are identical
    return dist + dist.T
