"""A small convolutional backbone for tiny images (e.g. 1x8x8 digits) that trains fast on CPU."""

from __future__ import annotations

from torch import Tensor, nn

from .base import Backbone

__all__ = ["SmallCNN"]


def _conv_bn_relu(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SmallCNN(Backbone):
    """Three 3x3 conv-BN-ReLU layers (32, 64, 128 channels; the last two stride 2) + global
    average pooling, giving 128-d features.

    Global pooling makes it independent of the input size (8x8 digits -> 2x2 maps, 32x32 -> 8x8),
    and ~93k parameters keep local training quick on a laptop CPU.
    """

    def __init__(self, in_channels: int = 3, widths: tuple[int, int, int] = (32, 64, 128)) -> None:
        super().__init__(feature_dim=widths[-1])
        w1, w2, w3 = widths
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, w1, stride=1),
            _conv_bn_relu(w1, w2, stride=2),
            _conv_bn_relu(w2, w3, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.features(x)).flatten(1)
