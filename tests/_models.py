"""Small models for tests (the in-project zoo lives in edgetrain.models)."""

import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(self.norm(x)))))


def mlp(d_in: int = 16, d: int = 32, n_blocks: int = 4, classes: int = 5, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, d), *[Residual(d, dropout) for _ in range(n_blocks)], nn.Linear(d, classes))


def convnet(classes: int = 5, width: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Dropout(0.1),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))
