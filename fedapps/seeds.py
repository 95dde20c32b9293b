"""One way to derive seeds: every random stream of a run comes from the experiment seed, a purpose name and
integer parts (round, client id, cluster index, ...), mixed by numpy's ``SeedSequence``.

Distinct purposes or parts give statistically independent streams (no ``seed * 1000 + k`` collisions, no
streams that overlap when one seed is another's neighbour), and the value is the same in every process and
on every machine: the purpose is hashed with CRC-32, never with Python's salted ``hash``.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np

__all__ = ["GLOBAL_RNG_LOCK", "derive_seed", "derive_rng"]

# torch's global CPU generator is one per process. Code that seeds it and draws from it (a seeded model build, a client
# message re-seeding it, dropout during a message) holds this lock, so that clients served on several threads of one
# process (the in-process engine, :mod:`fedapps.flower.inprocess`) draw exactly what they would draw one at a time.
GLOBAL_RNG_LOCK = threading.RLock()


def derive_seed(seed: int, purpose: str, *parts: int) -> int:
    """A non-negative 63-bit integer seed for (seed, purpose, parts): fits ``torch.manual_seed`` and numpy."""
    # fixed-width words: the seed and every part as two 32-bit words (low, high), and the number of parts, so
    # no two argument lists share an entropy pool (SeedSequence alone equates [a] with [a, 0])
    words = [zlib.crc32(purpose.encode("utf-8")), len(parts)]
    for value in (seed, *parts):
        v = int(value) & 0xFFFFFFFFFFFFFFFF
        words += [v & 0xFFFFFFFF, v >> 32]
    state = np.random.SeedSequence(np.array(words, dtype=np.uint32)).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 32 | int(state[1])) & 0x7FFFFFFFFFFFFFFF)


def derive_rng(seed: int, purpose: str, *parts: int) -> np.random.Generator:
    """A numpy Generator seeded with :func:`derive_seed`."""
    return np.random.default_rng(derive_seed(seed, purpose, *parts))
