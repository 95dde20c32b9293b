"""Small-image (28–64 px) variants of the COSMOS architectures, built on torchvision (weights=None).

The ImageNet stems (stride-2 7×7 / 3×3 convs, early max-pools) would shrink a 32 px image to almost
nothing, and the authors' upsampling to 224 px is far too costly, so each variant gets a 3×3 stride-1
stem taking any channel count, and every model ends in ONE nn.Linear whose weight rows are the classes.
Weights are (re)initialised by `kaiming_init` in the registry, not here.
"""

from __future__ import annotations

import torch
from torch import nn

Shape = tuple[int, int, int]

# VGG configurations (torchvision's "A" and "D"); ints are 3×3 conv widths, "M" a 2×2 max-pool.
VGG_CFGS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
# COSMOS's CIFAR AlexNet: 3×3 convs 64-128-256-256-512-512 with 4 max-pools (32 px → 2×2×512 = 2048).
ALEXNET_CFG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M"]


def stem_conv(in_channels: int, out_channels: int, bias: bool = False) -> nn.Conv2d:
    """3×3, stride-1, pad-1 stem conv: keeps the spatial size, accepts 1- or 3-channel input."""
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=bias)


def make_layers(cfg: list[int | str], in_channels: int, batch_norm: bool) -> nn.Sequential:
    """VGG-style conv stack. Pools use ceil_mode so 28 px inputs (28→14→7→4→2→1) never reach 0."""
    layers: list[nn.Module] = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
            continue
        layers.append(nn.Conv2d(in_channels, int(v), kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(int(v)))
        layers.append(nn.ReLU(inplace=True))
        in_channels = int(v)
    return nn.Sequential(*layers)


class _ConvNet(nn.Module):
    """features → avgpool → flatten → classifier (torchvision's VGG/AlexNet module names)."""

    def __init__(self, features: nn.Sequential, pool: int, classifier: nn.Sequential) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg(num_classes: int, input_shape: Shape, cfg_name: str) -> nn.Module:
    """VGG-BN features with a small-image head: adaptive pool 1×1 → Linear(512→512) ReLU → Linear(512→K)."""
    head = nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, num_classes))
    return _ConvNet(make_layers(VGG_CFGS[cfg_name], input_shape[0], batch_norm=True), 1, head)


def alexnet(num_classes: int, input_shape: Shape) -> nn.Module:
    """COSMOS's CIFAR AlexNet (no BN); adaptive pool to 2×2 so 28 and 64 px also give 2048 features."""
    head = nn.Sequential(
        nn.Dropout(0.5),
        nn.Linear(512 * 2 * 2, 4096),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(4096, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )
    return _ConvNet(make_layers(ALEXNET_CFG, input_shape[0], batch_norm=False), 2, head)


def resnet18(num_classes: int, input_shape: Shape) -> nn.Module:
    """torchvision ResNet-18 with a 3×3 stride-1 stem and no initial max-pool (the CIFAR ResNet-18)."""
    import torchvision.models as tvm  # here, not at import: its cost per ClientApp process (docs/performance.md)

    model = tvm.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = stem_conv(input_shape[0], 64)
    model.maxpool = nn.Identity()  # kept as a child so state-dict keys match torchvision's
    return model


# torchvision's MobileNetV2 setting (t, c, n, s) with the 24-channel stage at stride 1 instead of 2:
# with the stride-1 stem the total down-sampling is 8 (32 → 4, 28 → 4, 64 → 8) instead of 32.
MOBILENETV2_SETTING = [
    [1, 16, 1, 1],
    [6, 24, 2, 1],
    [6, 32, 3, 2],
    [6, 64, 4, 2],
    [6, 96, 3, 1],
    [6, 160, 3, 2],
    [6, 320, 1, 1],
]


def mobilenetv2(num_classes: int, input_shape: Shape) -> nn.Module:
    """torchvision MobileNetV2 with a stride-1 first conv and a stride-1 second stage (as CIFAR ports do)."""
    import torchvision.models as tvm  # here, not at import: its cost per ClientApp process (docs/performance.md)

    model = tvm.mobilenet_v2(weights=None, num_classes=num_classes, inverted_residual_setting=MOBILENETV2_SETTING)
    model.features[0][0] = stem_conv(input_shape[0], 32)
    return model


def squeezenet(num_classes: int, input_shape: Shape) -> nn.Module:
    """torchvision SqueezeNet 1.1 with a 3×3 stride-1 stem (its three ceil-mode pools remain: 32 → 4) and a
    global-pool + Linear head instead of the 1×1-conv classifier, so the classifier is an nn.Linear."""
    import torchvision.models as tvm  # here, not at import: its cost per ClientApp process (docs/performance.md)

    model = tvm.squeezenet1_1(weights=None, num_classes=num_classes)
    model.features[0] = stem_conv(input_shape[0], 64, bias=True)
    model.classifier = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Dropout(0.5), nn.Linear(512, num_classes)
    )
    return model


def kaiming_init(model: nn.Module) -> None:
    """COSMOS init: Kaiming-normal (fan-in, ReLU gain) conv/linear weights, zero biases, BN (1, 0)."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
