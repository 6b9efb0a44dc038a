"""Paging and budget changes while training keep the maths exact and the state safe."""

import copy
from pathlib import Path

import pytest
import torch
from _models import convnet, mlp
from torch import nn

import edgetrain
from edgetrain.graph import simulate
from edgetrain.planners import min_feasible_bytes


def plain_step(model, opt, loss_fn, x, y, seed=0):
    torch.manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_paging_is_bit_exact_and_cleans_its_files(tmp_path: Path):
    ref = convnet(width=16)
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 5, (16,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, o_ours, loss_fn, (x, y), paging=True, page_dir=str(tmp_path))
    n = step.plan.num_stages
    paged = tuple("page" if 0 < i < n - 1 and i % 2 else p for i, p in enumerate(step.plan.policies))
    step.set_plan(step.plan.replace(policies=paged, metadata={"async_stages": [i for i in range(n) if i % 4 == 1]}))
    assert "page" in step.plan.policies
    for i in range(2):
        lr = plain_step(ref, o_ref, loss_fn, x, y, i)
        torch.manual_seed(i)
        assert step(x, y) == lr
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    assert step._pager.stats.written_bytes > 0
    assert list(tmp_path.glob("edgetrain-pages-*"))
    step.close()
    assert not list(tmp_path.glob("edgetrain-pages-*"))


def _budgets(step):
    lo = min_feasible_bytes(step.costs)
    hi = simulate(step.costs, step.costs.batch_size, ["keep"] * step.costs.n).peak_bytes
    return lo, hi


def test_budget_drop_and_rise_match_final_plans_exactly():
    torch.manual_seed(0)
    ref = mlp(d=256, n_blocks=6)  # activations well above the margin (2% of a test process's fixed bytes)
    ours = copy.deepcopy(ref)
    # SGD: Adam's normalisation turns the float32 summation-order differences of micro-batching in gradients
    # near 0 into relative differences of the update far above the float32 rounding this test compares at
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(2048, 16), torch.randint(0, 5, (2048,))
    step = edgetrain.prepare(ours, o_ours, loss_fn, (x, y))
    lo, hi = _budgets(step)
    plans, low = [], lo + (hi - lo) // 100
    for i, budget in enumerate([hi, lo + (hi - lo) // 2, low, hi]):
        try:
            plans.append(step.set_memory_budget(int(budget)))
        except edgetrain.BudgetError as e:  # the margin and a new size's first run may not fit just above lo:
            assert i == 2 and e.min_feasible_bytes is not None, str(e)  # the named budget does
            low = e.min_feasible_bytes
            plans.append(step.set_memory_budget(low))
        xb, yb = torch.randn(2048, 16), torch.randint(0, 5, (2048,))
        plain_step(ref, o_ref, loss_fn, xb, yb)
        step(xb, yb)
    assert plans[2].peak_bytes <= low and plans[2].peak_bytes < plans[0].peak_bytes
    assert plans[2].num_micro_batches > 1 or "recompute" in plans[2].policies
    # micro-batches sum each gradient over the 2048 samples in another order: float32 rounding, ~1e-7 here, and
    # where it moves a pre-activation across ReLU's zero, one sample's contribution to a layer (up to 1.9e-6 seen
    # over seeds 0-3); the parameters are ~3e-2 and a step moves them by ~1e-4
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_budget_change_that_splits_the_batch_says_what_splitting_changes():
    """prepare warns when its plan splits the batch of a model with BatchNorm or dropout (each micro-batch
    normalised with its own statistics, drawing its own masks); a budget drop that split a batch kept whole
    did the same silently."""
    torch.manual_seed(0)
    model = convnet(width=16)  # BatchNorm and dropout
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 5, (32,))
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y))
    assert step.plan.micro_batch_size == 32
    step(x, y)
    lo, _ = _budgets(step)
    with pytest.warns(UserWarning) as record:
        try:
            plan = step.set_memory_budget(lo)
        except edgetrain.BudgetError as e:  # the margin and a new size's first run: the named budget works
            plan = step.set_memory_budget(e.min_feasible_bytes)
    assert plan.num_micro_batches > 1 and plan.bn_micro_batched
    said = " ".join(str(w.message) for w in record)
    assert "BatchNorm normalises each micro-batch" in said and "draws random numbers" in said, said


def _bn_convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))


def _hf_resnet() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1],
                                    layer_type="basic", num_labels=5)
    from edgetrain.spec.models import _PixelLogits  # what `edgetrain train model=hf:...` trains on images

    return _PixelLogits(transformers.ResNetForImageClassification(cfg))


@pytest.mark.parametrize("make, size, batch", [(_bn_convnet, 48, 64), (_hf_resnet, 112, 32)])
def test_a_budget_change_keeps_batchnorm_exact_where_a_whole_batch_plan_fits(make, size, batch):
    """prepare keeps a BatchNorm model's batch whole wherever a plan fits (exact_batchnorm); a budget change
    took the fastest plan of any micro-batch size instead, splitting the batch (each micro-batch normalised on
    its own) where a whole-batch plan recomputing a little fitted. It now keeps the whole batch there, and
    trains as plain PyTorch's full-batch step."""
    torch.manual_seed(0)
    ref = make().train()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 5, (batch,))
    step = edgetrain.prepare(ours, o_ours, loss_fn, (x, y), memory_budget="2GiB")
    assert step.plan.micro_batch_size == batch and "recompute" not in step.plan.policies
    assert step(x, y) == plain_step(ref, o_ref, loss_fn, x, y)
    step.budget_table()  # its first-run probe leaves kernels resident: the drift read below counts them
    whole = min_feasible_bytes(step.costs, micro_batch_sizes=[batch])
    _, keep_all = _budgets(step)
    budget = int((whole + (keep_all - whole) // 3 + step.budget.drift()) / (1 - step.margin_share)) + 2**20
    plan = step.set_memory_budget(budget)
    assert plan.micro_batch_size == batch and not plan.bn_micro_batched and "recompute" in plan.policies, \
        plan.summary()
    for i in range(2):
        xb, yb = torch.randn(batch, 3, size, size), torch.randint(0, 5, (batch,))
        assert step(xb, yb) == pytest.approx(plain_step(ref, o_ref, loss_fn, xb, yb, i), rel=1e-6)
    # the layers past 8 MiB of input and output are lean convolutions: weight gradients summed over slices
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_budget_drop_between_micro_batches_loses_no_sample():
    ref = mlp(d=64, n_blocks=6)
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    o_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(30, 16), torch.randint(0, 5, (30,))
    step = edgetrain.prepare(ours, o_ours, loss_fn, (x, y), micro_batch_size=10)
    lo, hi = _budgets(step)
    calls = []

    def source():
        calls.append(1)
        return lo + (hi - lo) // 100 if len(calls) >= 2 else None  # drops after the first micro-batch

    step.budget_source = source
    loss = step(x, y)
    assert len(calls) >= 2 and step.plan.peak_bytes <= lo + (hi - lo) // 100 and step.plan.micro_batch_size < 10
    assert loss == pytest.approx(plain_step(ref, o_ref, loss_fn, x, y), rel=1e-6)
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_infeasible_budget_change_leaves_model_and_optimizer_untouched():
    model = mlp(d=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(20, 16), torch.randint(0, 5, (20,))
    step = edgetrain.prepare(model, opt, loss_fn, (x, y), micro_batch_size=5)
    step(x, y)
    params = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    plan = step.plan
    with pytest.raises(edgetrain.BudgetError) as e:
        step.set_memory_budget(1000)
    assert e.value.min_feasible_bytes and e.value.min_feasible_bytes > 1000
    assert step.plan is plan
    calls = []
    step.budget_source = lambda: (calls.append(1), 1000 if len(calls) >= 2 else None)[1]
    with pytest.raises(edgetrain.BudgetError):
        step(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k])
    assert all(p.grad is None for p in model.parameters())
    after = opt.state_dict()
    for k, st in opt_state["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(after["state"][k][name]), torch.as_tensor(v))


def test_system_budget_source_reads_this_machine():
    from edgetrain.adaptation.sources import available_bytes, system_budget_source

    src = system_budget_source(reserve_bytes=0, cap_bytes=10 << 30)
    first = src()
    assert first is not None and 0 < first <= 10 << 30
    assert available_bytes() is None or first <= available_bytes() + (1 << 30)
    assert src() is None  # unchanged budgets are not reported again


def test_refused_budget_change_under_a_budget_names_one_that_works():
    from edgetrain.models import mobilenet_v2

    torch.manual_seed(0)
    model = mobilenet_v2(num_classes=10, width_mult=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    from edgetrain.profile import memory

    budget = memory.rss_bytes() - memory.baseline_rss_bytes() + 300 * 2**20  # earlier tests' leftovers count
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=budget)
    step(x, y)
    plan = step.plan
    with pytest.raises(edgetrain.BudgetError, match="smallest this process can train in now") as e:
        step.set_memory_budget("1MiB")
    assert step.plan is plan
    least = e.value.min_feasible_bytes
    assert least > 2**20
    assert step.set_memory_budget(least).peak_bytes <= least
    assert step.budget.seen_micro  # the sizes run so far are known, so the next change plans with them
    step(x, y)


def test_a_new_budget_holds_back_the_margin_prepare_did():
    """The safety margin of a new budget is prepare's share of it, with the same floor, and it is the margin
    the step then works with (the tensor pool's cap included)."""
    from edgetrain.planning.budgets import MIN_MARGIN_BYTES

    model = mlp(d=64, n_blocks=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="400MiB", safety_margin=0.001)
    assert step.margin_bytes == MIN_MARGIN_BYTES  # 0.1% of 400 MiB is below the floor
    with pytest.raises(edgetrain.BudgetError) as err:
        step.set_memory_budget(2**20)
    least = err.value.min_feasible_bytes  # what this process needs now (it depends on what else it loaded)
    assert least is not None and least < 400 * 2**20
    step.set_memory_budget(least)  # the old margin's share of it would hold back a quarter of the floor
    assert step.budget_bytes == least and step.margin_bytes == MIN_MARGIN_BYTES
    assert step.plan.peak_bytes <= least - MIN_MARGIN_BYTES
    step(x, y)
