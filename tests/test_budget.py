"""Budgets are promises: measured in a fresh process, no prepared step exceeds its memory budget."""

import pytest

from edgetrain.measure import Job, run_isolated

KW_MB = {"num_classes": 10, "in_channels": 3, "width_mult": 0.5}
KW_TR = {"num_classes": 10, "input_dim": 28, "d_model": 64, "num_layers": 2, "dim_feedforward": 128}


def _plain_peak(job: Job) -> int:
    res = run_isolated(Job(job.model, job.input_shape, job.batch_size, mode="plain",
                           model_kwargs=job.model_kwargs, steps=2, threads=1,
                           env={"EDGETRAIN_ALLOCATOR": "system"}))
    assert res.ok, res.error
    return res.peak_bytes


@pytest.mark.parametrize("model,shape,batch,kw,fraction", [
    ("mobilenet_v2", (3, 64, 64), 16, KW_MB, 0.7),
    ("transformer", (28, 28), 64, KW_TR, 0.7),
])
def test_measured_peak_within_budget(model, shape, batch, kw, fraction):
    base = Job(model, shape, batch, model_kwargs=kw, steps=2, threads=1)
    budget = int(_plain_peak(base) * fraction)
    res = run_isolated(Job(model, shape, batch, model_kwargs=kw, budget=budget, steps=3, threads=1))
    assert res.ok, res.error
    assert res.peak_bytes <= budget, f"peak {res.peak_bytes} above budget {budget}"
    assert res.plan["peak_bytes"] <= budget
    assert res.losses[-1] < res.losses[0] * 1.5  # it really trained


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,batch,kw", [
    ("mobilenet_v2", (3, 64, 64), 32, {"num_classes": 10, "in_channels": 3}),
    ("resnet18", (3, 32, 32), 32, {"num_classes": 10, "in_channels": 3, "small_input": True}),
    ("transformer", (28, 28), 64, {"num_classes": 10, "input_dim": 28}),
])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_measured_peak_within_budget_full_models(model, shape, batch, kw, fraction):
    budget = int(_plain_peak(Job(model, shape, batch, model_kwargs=kw)) * fraction)
    res = run_isolated(Job(model, shape, batch, model_kwargs=kw, budget=budget, steps=3, threads=1))
    if res.error_type == "BudgetError":
        assert res.min_feasible_bytes > budget
        return
    assert res.ok, res.error
    assert res.peak_bytes <= budget, f"peak {res.peak_bytes} above budget {budget}"


def test_infeasible_budget_fails_before_training_with_smallest_feasible():
    job = Job("mobilenet_v2", (3, 32, 32), 16, model_kwargs=KW_MB, budget="4MiB", steps=1, threads=1)
    res = run_isolated(job)
    assert res.error_type == "BudgetError"
    assert res.min_feasible_bytes > 4 * 2**20
    assert not res.losses  # nothing trained
    retry = run_isolated(Job(job.model, job.input_shape, job.batch_size, model_kwargs=KW_MB,
                             budget=int(res.min_feasible_bytes * 1.25), steps=2, threads=1))
    assert retry.ok, retry.error
    # Between what the model itself holds and the smallest feasible budget, finding that out (profiling,
    # running plans above the budget) happens in a forked child: this process never exceeds the budget.
    tight = int(res.min_feasible_bytes * 0.8)
    refused = run_isolated(Job(job.model, job.input_shape, job.batch_size, model_kwargs=KW_MB, budget=tight,
                               steps=1, threads=1))
    assert refused.error_type == "BudgetError" and refused.min_feasible_bytes > tight
    assert refused.peak_bytes <= tight, f"prepare peaked at {refused.peak_bytes}, over the budget {tight}"


@pytest.mark.parametrize("model,shape,batch,kw,fraction", [
    ("mobilenet_v2", (3, 64, 64), 16, KW_MB, 0.7),
    ("transformer", (28, 28), 64, KW_TR, 0.6),
])
def test_peak_after_a_budget_drop_stays_within_the_new_budget(model, shape, batch, kw, fraction):
    plain = _plain_peak(Job(model, shape, batch, model_kwargs=kw))
    high, low = plain, int(plain * fraction)

    def drop(to: int):
        return run_isolated(Job(model, shape, batch, model_kwargs=kw, budget=high, budget_after=to, steps=3,
                                threads=1))

    res = drop(low)
    if res.error_type == "BudgetError":  # the new budget is refused: the smallest it names must work
        assert res.min_feasible_bytes > low and len(res.losses) == 1, res.error
        low = res.min_feasible_bytes
        res = drop(low)
    assert res.ok, res.error
    assert res.plan["budget_bytes"] == low
    assert len(res.losses) == 3
    assert res.peak_bytes <= low, f"peak {res.peak_bytes} after the drop, above the new budget {low}"


def _many_params():
    import torch

    # one 1 MiB parameter and fifteen more of 256 KiB: per-parameter temporaries scale with the largest,
    # whole-model (foreach) ones with all 4.75 MiB
    return torch.nn.ModuleList([torch.nn.Linear(512, 512, bias=False)]
                               + [torch.nn.Linear(256, 256, bias=False) for _ in range(15)])


@pytest.mark.parametrize("cls_name", ["Adam", "AdamW"])
def test_optimizer_update_temporaries_scale_with_what_the_implementation_allocates_at_once(cls_name):
    """For-loop optimizers (PyTorch's default on CPU) make their temporaries one parameter at a time;
    foreach ones for the whole model. Counting the first kind for the whole model refused budgets plain
    PyTorch trains in (Adam on ResNet-18: 85 MiB predicted for 18 MiB of temporaries)."""
    import torch

    from edgetrain.profile.stages import optimizer_costs
    from edgetrain.runtime import pool

    pool.install()  # as prepare() does; the probe reads resident memory
    model = _many_params()
    cls = getattr(torch.optim, cls_name)
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = 512 * 512 * 4
    loop = optimizer_costs(cls(model.parameters(), foreach=False))
    each = optimizer_costs(cls(model.parameters(), foreach=True))
    assert loop.state_per_param == each.state_per_param == 2.0
    assert loop.state_bytes == 2 * total
    assert largest <= loop.update_bytes <= 4 * largest  # a few temporaries of the largest parameter
    assert each.update_bytes >= 0.5 * total  # at least one temporary per parameter element, at once
    assert loop.update_bytes < each.update_bytes
