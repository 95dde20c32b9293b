"""A user's own models and data loaders, written as a researcher would write them outside this package, named in the
tests' configs by import path (``user_code:tiny_net``, ``user_code:digits_dataset``). The tests put this folder on
the Python path (pytest does; a `flwr run` gets it through PYTHONPATH), as a user puts theirs.

Some are wrong on purpose, one way each: the errors the config check must name."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class TinyNet(nn.Module):
    """A small convolutional net of the user's: conv → pool → hidden linear → classifier ``out``."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int]) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.hidden = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 24), nn.ReLU())
        self.out = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(self.features(x)))


def tiny_net(num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    """The factory a config names: ``model.name: user_code:tiny_net``."""
    return TinyNet(num_classes, input_shape)


class HeadlessNet(nn.Module):
    """Logits straight from a 1×1 convolution, averaged over the image: no nn.Linear, so no classifier head."""

    def __init__(self, num_classes: int, input_shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], 8, 3, padding=1)
        self.logits = nn.Conv2d(8, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(torch.relu(self.conv(x))).mean(dim=(2, 3))


def headless_net(num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    return HeadlessNet(num_classes, input_shape)


def zoo_mlp(num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    """The zoo's MLP built through the user route: under the same seed the same weights as ``model.name: mlp``."""
    from fedapps.models.simple import MLP

    return MLP(num_classes, input_shape)


def digits_arrays(root: str) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (float images N×1×8×8 in [-1, 1], labels): the values of the built-in source
    ``digits``. Takes ``root`` (data.root) to show that it is passed; the data need no folder."""
    assert isinstance(root, str) and root, root
    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 8.0 - 1.0)[:, None]
    return images, bunch.target


class DigitsDataset(torch.utils.data.Dataset):
    """The same digits as a torch Dataset of (C×H×W uint8 tensor, int) pairs, with torchvision's ``classes``."""

    def __init__(self) -> None:
        bunch = load_digits()
        self.images = torch.from_numpy((bunch.images * 15).astype(np.uint8))  # 0..16 -> 0..240
        self.labels = [int(v) for v in bunch.target]
        self.classes = [str(c) for c in range(10)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i].unsqueeze(0), self.labels[i]


def digits_dataset() -> torch.utils.data.Dataset:
    """The loader a config names: ``data.source: user_code:digits_dataset`` (no argument)."""
    return DigitsDataset()


# ---------------------------------------------------------------- wrong on purpose


NOT_CALLABLE = 42


def returns_a_dict(num_classes: int, input_shape: tuple[int, int, int]) -> dict:
    return {"weights": np.zeros(num_classes)}


def wrong_outputs(num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes + 1))


def takes_nothing() -> nn.Module:
    return nn.Linear(1, 1)


def returns_a_string() -> str:
    return "digits"


def channels_last() -> tuple[np.ndarray, np.ndarray]:
    images, labels = digits_arrays("x")
    return np.transpose(images, (0, 2, 3, 1)).copy(), labels


def float_labels() -> tuple[np.ndarray, np.ndarray]:
    images, labels = digits_arrays("x")
    return images, labels.astype(np.float64)


def raises() -> None:
    raise FileNotFoundError("/data/my-set/train.npz")
