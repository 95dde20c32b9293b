"""Per-group transforms of the clustered-FL settings: `rotated` (IFCA) and `label-swap` (CFL).

Pure functions: how many quarter turns group g's images get, which label permutation group g uses, and
which group's transform each sample of the public set U carries. The federation applies them to its one
sample tensor after gathering (``federation.build_federation``); nothing here touches a data set.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import DataError

ROTATION_GROUPS: tuple[int, ...] = (1, 2, 4)  # group counts whose angles g·360/G are multiples of 90°


def rotation_quarter_turns(groups: int) -> np.ndarray:
    """Quarter turns (counter-clockwise) of each group: group g is rotated by g·360/G degrees = g·4/G turns.

    Only G ∈ {1, 2, 4} keeps every angle a multiple of 90°, so images are rotated exactly (``torch.rot90``,
    no interpolation): G = 4 → 0/90/180/270° (the IFCA paper's MNIST setting), G = 2 → 0/180°."""
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or int(groups) not in ROTATION_GROUPS:
        raise DataError(
            f"data.groups={groups!r} is not allowed with partition 'rotated': group g is rotated by "
            f"g·360/groups degrees, exact only for multiples of 90°; use data.groups=4 "
            f"(0/90/180/270°, the IFCA setting), 2 (0/180°) or 1"
        )
    g = int(groups)
    return (np.arange(g, dtype=np.int64) * 4) // g


def rotate_images(x: torch.Tensor, quarter_turns: int) -> torch.Tensor:
    """N×C×H×W images rotated counter-clockwise by quarter_turns·90° (exact; a new tensor)."""
    return torch.rot90(x, int(quarter_turns) % 4, dims=(-2, -1))


def swap_choices(num_classes: int, pairs: int) -> int:
    """Number of distinct ways to choose `pairs` disjoint label pairs among `num_classes` classes."""
    if 2 * pairs > num_classes:
        return 0
    return math.factorial(num_classes) // (math.factorial(num_classes - 2 * pairs) * math.factorial(pairs) * 2**pairs)


def label_swap_permutations(num_classes: int, groups: int, pairs: int, rng: np.random.Generator) -> np.ndarray:
    """groups × num_classes label maps: row g sends a source label c to group g's label perm[g, c].

    Group 0 keeps the identity; every other group swaps `pairs` disjoint label pairs drawn at random (the CFL
    paper's label swapping), redrawn until it differs from every earlier group's map. Each map is its own
    inverse (a product of disjoint swaps)."""
    if num_classes < 2:
        raise DataError(
            f"partition 'label-swap' needs at least 2 classes, the source has {num_classes}; "
            f"use another data.source (or data.synthetic_classes >= 2)"
        )
    if pairs < 1 or 2 * pairs > num_classes:
        raise DataError(
            f"data.swap_pairs={pairs} must be in 1..{num_classes // 2} (disjoint pairs among {num_classes} classes)"
        )
    if groups - 1 > swap_choices(num_classes, pairs):
        raise DataError(
            f"data.groups={groups} needs {groups - 1} different label swaps, but only "
            f"{swap_choices(num_classes, pairs)} exist with data.swap_pairs={pairs} and {num_classes} "
            f"classes; lower data.groups or change data.swap_pairs"
        )
    perms = np.tile(np.arange(num_classes, dtype=np.int64), (groups, 1))
    seen = {tuple(perms[0])}
    for g in range(1, groups):
        while True:
            chosen = rng.permutation(num_classes)[: 2 * pairs]
            p = np.arange(num_classes, dtype=np.int64)
            a, b = chosen[0::2], chosen[1::2]
            p[a], p[b] = b, a
            if tuple(p) not in seen:
                break
        seen.add(tuple(p))
        perms[g] = p
    return perms


def public_group_shares(labels: np.ndarray, groups: int, rng: np.random.Generator) -> np.ndarray:
    """Group of each public sample: equal shares overall (sizes differ by at most 1) and within every class.

    Samples of a class are shuffled and dealt to the groups in turn; the dealing continues across classes, so
    the totals stay balanced as well."""
    y = np.asarray(labels, dtype=np.int64)
    out = np.empty(y.size, dtype=np.int64)
    offset = 0
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        out[idx] = (offset + np.arange(idx.size)) % groups
        offset += idx.size
    return out
