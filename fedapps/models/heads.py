"""Classifier heads other than the plain linear one, swapped in by :func:`fedapps.models.build_model` for an
architecture named ``<model>+<head>`` (e.g. ``cnn+cosine``). Strategies that need such a head (FedNH) name the
variant in their messages; ``model.name`` in a config stays a plain zoo name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CosineClassifier(nn.Linear):
    """Cosine logits: ``logits[:, c] = s·cos(z, w_c)`` — the features z and each weight row w_c (the class
    prototype) are L2-normalised in the forward pass; no bias; s (``scale``, shape (1,)) is a parameter.

    An ``nn.Linear`` subclass (weight K × d), so everything that finds a model's classifier keeps working: the
    head is ``weight`` and ``scale``, the body everything else."""

    def __init__(self, in_features: int, out_features: int, scale: float = 1.0) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.scale = nn.Parameter(torch.tensor([float(scale)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.linear(F.normalize(x, dim=-1), F.normalize(self.weight, dim=-1))


HEADS = {"cosine": CosineClassifier}
