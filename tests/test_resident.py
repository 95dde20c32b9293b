"""Client data kept on the accelerator per process (fedapps/client/resident.py), checked on torch's ``meta`` device
(a device other than the host's, no accelerator needed): a copy is made once, reused while the host tensor lives
unchanged, and the budget holds."""

from __future__ import annotations

import gc

import torch

from fedapps.client.resident import ResidentData

META = torch.device("meta")


def test_a_host_tensor_is_copied_once_and_reused_while_unchanged():
    cache, x = ResidentData(), torch.zeros(4, 3)
    first = cache.on(x, META)
    assert first.device == META and first.shape == x.shape
    assert cache.on(x, META) is first
    x.add_(1.0)  # changed in place: a fresh copy
    assert cache.on(x, META) is not first
    assert cache.on(x, torch.device("cpu")) is x  # already there: nothing copied


def test_copies_of_freed_tensors_go_and_the_budget_holds():
    cache = ResidentData(budget=100)  # bytes: two tensors of 48
    a, b, c, d = torch.zeros(12), torch.zeros(12), torch.zeros(12), torch.zeros(1)
    cache.on(a, META)
    cache.on(b, META)
    assert cache.held == 96
    kept_c = cache.on(c, META)  # a, the least recently used, goes
    assert cache.held == 96
    del b
    gc.collect()
    cache.on(d, META)  # b's copy goes with b
    assert cache.held == 48 + 4
    assert cache.on(c, META) is kept_c
    assert cache.on(torch.zeros(100), META).device == META  # 400 bytes: copied, not kept
    assert cache.held == 52
