"""prepare()'s analysis in a forked child: results, errors and resident memory come back faithfully."""

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.profile import fork as _fork, memory
from edgetrain.errors import BudgetError
from _models import mlp

pytestmark = pytest.mark.skipif(not _fork.available(), reason="no fork() here")


def test_child_returns_value_and_errors():
    assert _fork.run_in_child(lambda: {"a": torch.arange(3).tolist()}).value == {"a": [0, 1, 2]}

    def refuse():
        raise BudgetError("too small", budget_bytes=10, min_feasible_bytes=20)

    res = _fork.run_in_child(refuse)
    assert res.value is None and res.budget_error == ("too small", 10, 20)
    res = _fork.run_in_child(lambda: 1 / 0)
    assert res.error.startswith("ZeroDivisionError")


def test_child_sees_the_parents_resident_memory_and_leaves_the_parents_peak_alone():
    def status():
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                if line.startswith(("VmRSS", "RssFile"))}

    parent = status()
    child = _fork.run_in_child(status).value
    # shared-library pages the parent holds are touched first, so the child's readings are the parent's
    assert abs(child["VmRSS"] - parent["VmRSS"]) < 8 * 2**20
    assert child["RssFile"] >= parent["RssFile"] - 2 * 2**20
    memory.reset_peak()
    before = memory.peak_rss_bytes()
    res = _fork.run_in_child(lambda: torch.ones(64 * 2**20 // 4).sum().item())  # 64 MiB in the child only
    assert res.value == 64 * 2**20 // 4
    assert res.peak_bytes >= 60 * 2**20  # the child counts what it allocated
    assert memory.peak_rss_bytes() - before < 16 * 2**20


@pytest.mark.parametrize("fork", ["1", "0"])
def test_prepare_with_and_without_the_child_plans_alike(monkeypatch, fork):
    monkeypatch.setenv("EDGETRAIN_FORK", fork)
    torch.manual_seed(0)
    model = mlp(d=64, n_blocks=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    # the budget counts from the import baseline, and this test process already holds what earlier tests left
    budget = memory.rss_bytes() - memory.baseline_rss_bytes() + 200 * 2**20
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=budget)
    assert step.plan.budget_bytes == budget and step.plan.peak_bytes <= budget
    losses = [step(x, y) for _ in range(3)]
    assert losses[-1] < losses[0]
