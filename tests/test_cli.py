"""Helpers of the command-line jobs."""


def test_precise_bn_sets_running_statistics_to_the_average_over_batches():
    import torch
    from torch import nn

    from edgetrain.cli import _precise_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model[1].running_mean.fill_(100.0)  # a lagging average
    batches = [(torch.randn(8, 1, 6, 6) * (i + 1), None) for i in range(5)]
    assert _precise_bn(model, iter(batches), 3) == 3
    with torch.no_grad():
        means = [model[0](x).mean(dim=(0, 2, 3)) for x, _ in batches[:3]]
    torch.testing.assert_close(model[1].running_mean, torch.stack(means).mean(0))
    assert model[1].momentum == 0.1 and model.training
    assert _precise_bn(nn.Sequential(nn.Linear(2, 2)), iter(batches), 3) == 0  # no BatchNorm: nothing to do
