"""Helpers for the hand computations of the deployed models (tests/test_evaluation_protocol.py).

A strategy whose deployed model travels in a message or lives on the server (``deployed.source`` ``message`` /
``server``) defines, in its own test file, ``DEPLOYED_BY_HAND = {name: fn}``: ``fn(strategy, grid, client id, the
client's data, round)`` evaluates by hand, from the server's and the clients' state right after that round, the model
its protocol defines. ``tests/test_evaluation_protocol.py`` finds every such table and runs each strategy on a
2-client toy against it; a strategy whose deployed model is the client's own (``client``) needs none.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedapps.client import ops
from fedapps.client.worker import STATE_MODEL, optim_settings, part_names
from fedapps.models import build_model
from fedapps.seeds import derive_seed

SHAPE, CLASSES = (1, 8, 8), 10  # digits, as the toy run loads them


def tensors(arrays) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()}


def private(grid, cid: int) -> dict[str, torch.Tensor]:
    """Client ``cid``'s private model as its node keeps it (InProcessGrid: node 100 + cid)."""
    return grid.contexts[100 + cid].state[STATE_MODEL].to_torch_state_dict()


def evaluate(state, data, arch: str = "mlp") -> dict[str, float]:
    """``state`` loaded (strictly) into a fresh ``arch`` and evaluated on ``data``'s test split."""
    model = build_model(arch, CLASSES, SHAPE)
    model.load_state_dict(state, strict=True)
    return ops.evaluate(model, data.test_x, data.test_y)


def finetuned(s, state, data, rnd: int, cid: int, section, keep: str, arch: str = "mlp") -> dict[str, float]:
    """``state`` fine-tuned on the client's train split as its round-(rnd+1) message does it (``section``'s
    optimiser settings over the client's, the part ``keep`` frozen, the same seeded batch order), then evaluated."""
    model = build_model(arch, CLASSES, SHAPE)
    model.load_state_dict(state)
    settings = optim_settings(section, dataclasses.asdict(s.cfg.client))
    gen = torch.Generator().manual_seed(derive_seed(s.cfg.seed, "client-batches", rnd + 1, cid))
    with ops.frozen(model, part_names(model, keep)):
        ops.train(model, data.train_x, data.train_y, settings, None, gen)
    return ops.evaluate(model, data.test_x, data.test_y)
