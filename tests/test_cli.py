"""Helpers of the command-line jobs."""


def test_precise_bn_sets_running_statistics_to_the_average_over_batches():
    import torch
    from torch import nn

    from edgetrain.cli.main import _precise_bn

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


def test_demo_trains_real_digits_inside_its_budget_measured_from_after_the_data():
    """`edgetrain demo` end to end in a fresh process, small: it trains and reports its peak inside the budget,
    measured from after loading the digits (the loader's own peak, ~200 MiB, is not training memory)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "edgetrain.cli.main", "demo", "--epochs", "1", "--batch-size", "64",
                           "--image-size", "16", "--width", "0.5", "--no-progress", "--precise-bn", "2",
                           "--budget-fraction", "2", "--report", ""], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("measured peak")]
    assert verdict and "within budget" in verdict[0], proc.stdout[-2000:]
