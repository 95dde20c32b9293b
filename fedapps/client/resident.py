"""Client data kept on the accelerator, per process.

A client's data lives in host memory, cached per process (:func:`fedapps.data.get_federation`). On a GPU, the training
and evaluation loops of :mod:`fedapps.client.ops` would copy every minibatch from there; instead they index a device
copy of the whole tensor, made once and kept while the host tensor lives and is unchanged (its identity and torch's
version counter are checked), so a process (a Ray actor) serving a client again finds its data on the device. The
copies hold the same values, so results are the same. At most :data:`RESIDENT_BYTES` of device memory is held per
process; past it the least recently used copies go. On the CPU nothing is copied.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

RESIDENT_BYTES = 2 * 2**30  # device memory the copies may hold per process


@dataclass
class _Copy:
    source: weakref.ref  # the host tensor (its copy is reused only while it lives)
    version: int  # torch's version counter of the host tensor when it was copied (an in-place change bumps it)
    copy: Tensor
    nbytes: int


class ResidentData:
    """Device copies of host tensors, reused while the host tensor lives unchanged (see the module docstring)."""

    def __init__(self, budget: int = RESIDENT_BYTES) -> None:
        self.budget = budget
        self._copies: OrderedDict[tuple[int, str], _Copy] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes of device memory the copies hold."""
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    def on(self, x: Tensor, device: torch.device) -> Tensor:
        """``x`` on ``device``: ``x`` itself when it is there, else its kept copy, else a new copy (kept when it fits
        the budget)."""
        if x.device == device:
            return x
        nbytes = x.element_size() * x.numel()
        key = (id(x), str(device))
        with self._lock:
            kept = self._copies.get(key)
            if kept is not None and kept.source() is x and kept.version == version_of(x):
                self._copies.move_to_end(key)
                return kept.copy
        copy = x.to(device)
        if nbytes > self.budget:
            return copy
        with self._lock:
            for gone in [k for k, c in self._copies.items() if c.source() is None]:  # host tensors freed since
                del self._copies[gone]
            self._copies[key] = _Copy(weakref.ref(x), version_of(x), copy, nbytes)
            total = sum(c.nbytes for c in self._copies.values())
            while total > self.budget:
                _, dropped = self._copies.popitem(last=False)
                total -= dropped.nbytes
        return copy


def version_of(x: Tensor) -> int:
    """Torch's version counter of a tensor: bumped by every in-place change."""
    return int(x._version)  # noqa: SLF001 - torch has no public accessor for it


RESIDENT = ResidentData()


def on_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device``, through this process's :data:`RESIDENT` copies."""
    return RESIDENT.on(x, device)
