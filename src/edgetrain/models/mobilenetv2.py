"""MobileNetV2 (Sandler et al., 2018) defined as torchvision defines it, cut-friendly.

The architecture, the parameter names in ``state_dict`` and the initialisation follow torchvision's
``mobilenet_v2`` (3,504,872 parameters at 1000 classes and ``width_mult=1.0``). One deliberate
difference, invisible to ``state_dict`` and to the numbers the model computes: pooling and flattening
are modules (``pool``, ``flatten``) rather than calls inside ``forward``, so ``forward`` is exactly
``classifier(flatten(pool(features(x))))``: the model's children applied in order, and a capture that
walks the module tree sees every operation. Activations are in-place as in torchvision
(``ReLU6(inplace=True)``), so plain PyTorch gets the memory that saves; edgetrain's capture runs them out
of place inside its stages (``edgetrain.capture.rewrite``), free to keep any stage boundary.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MobileNetV2", "InvertedResidual", "ConvBNActivation", "mobilenet_v2", "make_divisible"]

# (expansion t, output channels c, repeats n, first stride s), Table 2 of the paper.
_INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a channel count to the nearest multiple of ``divisor``, never dropping more than 10%.

    Args:
        value: the unrounded channel count (e.g. ``32 * width_mult``).
        divisor: the multiple to round to.
        min_value: the smallest result allowed (``divisor`` when None).

    Returns:
        The rounded channel count.
    """
    floor = divisor if min_value is None else min_value
    rounded = max(floor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:  # rounding down must not remove more than 10% of the channels
        rounded += divisor
    return rounded


class ConvBNActivation(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> ReLU6, with "same" padding for odd kernels."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 groups: int = 1) -> None:
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (3x3) -> linear project (1x1), with a skip when shapes allow.

    Args:
        in_channels: channels of the block input.
        out_channels: channels of the block output.
        stride: 1 or 2, applied by the depthwise convolution.
        expand_ratio: hidden channels are ``round(in_channels * expand_ratio)``; 1 skips the expansion.

    Raises:
        ValueError: when ``stride`` is not 1 or 2.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"InvertedResidual stride must be 1 or 2, got {stride}")
        hidden = int(round(in_channels * expand_ratio))
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNActivation(in_channels, hidden, kernel_size=1))
        layers += [
            ConvBNActivation(hidden, hidden, stride=stride, groups=hidden),  # depthwise
            nn.Conv2d(hidden, out_channels, 1, 1, 0, bias=False),           # linear bottleneck
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 classifier; see :func:`mobilenet_v2`."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, width_mult: float = 1.0,
                 dropout: float = 0.2, round_nearest: int = 8) -> None:
        super().__init__()
        if num_classes < 1 or in_channels < 1 or width_mult <= 0:
            raise ValueError(
                f"mobilenet_v2 needs num_classes >= 1, in_channels >= 1 and width_mult > 0; got "
                f"num_classes={num_classes}, in_channels={in_channels}, width_mult={width_mult}")
        channels = make_divisible(32 * width_mult, round_nearest)
        self.last_channel = make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [ConvBNActivation(in_channels, channels, stride=2)]
        for t, c, n, s in _INVERTED_RESIDUAL_SETTING:
            out_channels = make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(channels, out_channels, s if i == 0 else 1, t))
                channels = out_channels
        features.append(ConvBNActivation(channels, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
        self._init_weights()

    def _init_weights(self) -> None:
        # torchvision's initialisation: He (fan_out) for convolutions, N(0, 0.01) for the head.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.pool(self.features(x))))


def mobilenet_v2(num_classes: int = 1000, in_channels: int = 3, width_mult: float = 1.0,
                 dropout: float = 0.2) -> MobileNetV2:
    """Build a randomly initialised MobileNetV2.

    The forward takes one tensor ``[B, in_channels, H, W]`` (any ``H, W >= 1``; the stem and four
    stride-2 stages divide by 32, the global pool absorbs the rest) and returns logits
    ``[B, num_classes]``. Every boundary between consecutive entries of ``features`` (and between
    ``features``, ``pool``, ``flatten``, ``classifier``) carries exactly one tensor.

    Args:
        num_classes: size of the classification head.
        in_channels: channels of the input image (1 for MNIST without repeating the channel).
        width_mult: multiplies every layer's channels (rounded to multiples of 8).
        dropout: dropout probability before the head.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: when a size is not positive.
    """
    return MobileNetV2(num_classes=num_classes, in_channels=in_channels, width_mult=width_mult,
                       dropout=dropout)
