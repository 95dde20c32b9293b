"""The two small models of the cwFedAvg / PFLlib experiments: the 4-layer CNN ("FedAvgCNN") and an MLP."""

from __future__ import annotations

import torch
from torch import nn

Shape = tuple[int, int, int]


def _conv_block(c_in: int, c_out: int, padding: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=5, padding=padding, stride=1, bias=True),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=(2, 2)),
    )


def cnn_padding(input_shape: Shape) -> int:
    """Conv padding of FedAvgCNN: 0 as in the papers, 2 for inputs under 16 px (e.g. 8×8 digits),
    where two unpadded k5 convs + pools would shrink the image to nothing."""
    return 0 if min(input_shape[1:]) >= 16 else 2


def cnn_feature_dim(input_shape: Shape) -> int:
    """Flattened size after conv2 (1024 for 1×28×28, 1600 for 3×32×32, 10816 for 3×64×64)."""
    pad = cnn_padding(input_shape)
    sizes = []
    for s in input_shape[1:]:
        for _ in range(2):
            s = (s + 2 * pad - 4) // 2
        sizes.append(s)
    return 64 * sizes[0] * sizes[1]


class FedAvgCNN(nn.Module):
    """PFLlib's FedAvgCNN as used by cwFedAvg: conv(32,k5)-pool → conv(64,k5)-pool → fc1(512) → fc.

    Exactly four children (conv1, conv2, fc1, fc), so cwFedAvg's `last-1` means the classifier only.
    Convs are unpadded as in the papers' code, except for inputs smaller than 16 px (scikit-learn's
    8×8 digits), where both convs use padding 2 so the two k5 convs still fit. PyTorch default init.
    """

    def __init__(self, num_classes: int, input_shape: Shape) -> None:
        super().__init__()
        pad = cnn_padding(input_shape)
        self.conv1 = _conv_block(input_shape[0], 32, pad)
        self.conv2 = _conv_block(32, 64, pad)
        self.fc1 = nn.Sequential(nn.Linear(cnn_feature_dim(input_shape), 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.conv1(x))
        return self.fc(self.fc1(torch.flatten(x, 1)))


class MLP(nn.Module):
    """Flatten → Linear(d→200) ReLU → Linear(200→200) ReLU → fc Linear(200→K); PyTorch default init.

    Children fc1, fc2, fc (flatten happens in forward).
    """

    def __init__(self, num_classes: int, input_shape: Shape, hidden: int = 200) -> None:
        super().__init__()
        d = input_shape[0] * input_shape[1] * input_shape[2]
        self.fc1 = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(inplace=True))
        self.fc2 = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(inplace=True))
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc2(self.fc1(torch.flatten(x, 1))))
