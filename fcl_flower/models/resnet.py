"""ResNet-18 written for this project, with a CIFAR stem or an ImageNet stem.

STSA [CODE] trains ResNet-18 from scratch in stage 1: 3x3/stride-1 stem without max-pool for
CIFAR-sized images, the standard 7x7/stride-2 + max-pool stem for Tiny-ImageNet; features are
the 512-d output of adaptive average pooling.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import Backbone

__all__ = ["BasicBlock", "ResNet18"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN projection) shortcut."""

    expansion = 1

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(Backbone):
    """ResNet-18 (BasicBlocks [2, 2, 2, 2], widths 64-512) -> 512-d pooled features.

    ``stem="cifar"``: 3x3/stride-1 conv, no max-pool (keeps 32x32 resolution in layer1).
    ``stem="imagenet"``: 7x7/stride-2 conv + 3x3/stride-2 max-pool (Tiny-ImageNet, 64x64).
    """

    def __init__(self, in_channels: int = 3, stem: str = "cifar") -> None:
        super().__init__(feature_dim=512)
        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(inplace=True),
            )
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        else:
            raise ValueError(f"unknown ResNet stem {stem!r}; expected 'cifar' or 'imagenet'")
        widths = (64, 128, 256, 512)
        layers: list[nn.Module] = []
        c_in = 64
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(c_in, width, stride), BasicBlock(width, width, 1)))
            c_in = width
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.pool(x).flatten(1)
