"""ResNet-18 (He et al., 2016) defined as torchvision defines it, with a CIFAR-style small-input stem.

The architecture, the parameter names in ``state_dict`` and the initialisation follow torchvision's
``resnet18`` (11,689,512 parameters at 1000 classes). Differences, none visible in ``state_dict``:

* ``flatten`` is a module, so ``forward`` is exactly the children applied in registration order
  (``conv1, bn1, relu, maxpool, layer1..layer4, avgpool, flatten, fc``) and a capture that walks the
  module tree sees every operation.
* None in the arithmetic: ReLUs and the residual addition are in-place as in torchvision; edgetrain's
  capture runs them out of place in its stages (``edgetrain.capture.rewrite``).
* ``small_input=True`` replaces the 7x7 stride-2 stem and the max-pool with a 3x3 stride-1 convolution
  (``maxpool`` becomes ``nn.Identity``), the usual choice for 28-64 pixel inputs such as MNIST/CIFAR.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet", "resnet18"]


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection (projected when the shape changes).

    Args:
        in_channels: channels of the block input.
        out_channels: channels of the block output.
        stride: stride of the first convolution (and of the projection).
    """

    expansion = 1

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # Project the skip last, as torchvision does: its output is not held during the main path.
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet with :class:`BasicBlock` stages; see :func:`resnet18`."""

    def __init__(self, layers: tuple[int, int, int, int] = (2, 2, 2, 2), num_classes: int = 1000,
                 in_channels: int = 3, small_input: bool = False) -> None:
        super().__init__()
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"resnet needs num_classes >= 1 and in_channels >= 1; got "
                             f"num_classes={num_classes}, in_channels={in_channels}")
        self.in_planes = 64
        if small_input:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = (nn.Identity() if small_input
                                   else nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self.layer1 = self._make_layer(64, layers[0], stride=1)
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(512 * BasicBlock.expansion, num_classes)
        # torchvision's initialisation; the head keeps nn.Linear's default.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(self.in_planes, planes, stride)]
        self.in_planes = planes * BasicBlock.expansion
        layers += [BasicBlock(self.in_planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


def resnet18(num_classes: int = 1000, in_channels: int = 3, small_input: bool = False) -> ResNet:
    """Build a randomly initialised ResNet-18.

    The forward takes one tensor ``[B, in_channels, H, W]`` and returns logits ``[B, num_classes]``.
    Every boundary between top-level children and between the residual blocks of ``layer1..layer4``
    carries exactly one tensor (the skip connections stay inside a :class:`BasicBlock`).

    Args:
        num_classes: size of the classification head.
        in_channels: channels of the input image.
        small_input: use a 3x3 stride-1 stem without max-pool (CIFAR style) for 28-64 pixel inputs;
            the ImageNet stem would shrink a 32x32 input to 8x8 before the first residual block.

    Returns:
        The model, in training mode.

    Raises:
        ValueError: when a size is not positive.
    """
    return ResNet((2, 2, 2, 2), num_classes=num_classes, in_channels=in_channels, small_input=small_input)
