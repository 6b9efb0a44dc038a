"""Micro-batches of one sample for BatchNorm models: allowed where a training-mode forward takes one sample."""

import torch
import transformers
from torch import nn

from edgetrain.capture import bind_inputs
from edgetrain.planning.guards import one_sample_trains


def _resnet() -> nn.Module:
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", num_labels=5)
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(cfg).train()


class PooledBatchNorm(nn.Module):
    """BatchNorm1d after a global pooling: one sample is one value per channel, which training mode refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x).mean((2, 3))))


def test_spatial_batchnorm_takes_one_sample_and_nothing_changes():
    model = _resnet()
    env = bind_inputs(model, torch.randn(4, 3, 16, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert one_sample_trains(model, env)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():  # running statistics and num_batches_tracked put back
        assert torch.equal(v, before[k]), k
    assert model.training


def test_batchnorm_after_global_pooling_needs_two():
    model = PooledBatchNorm().train()
    assert not one_sample_trains(model, bind_inputs(model, torch.randn(4, 3, 8, 8)))
    assert int(model.bn.num_batches_tracked) == 0
