"""ElasticTrainer selection: exact solver vs brute force, timing model, exact probe restore, runtime."""

import itertools
import json
import logging
import math
import warnings

import pytest
import torch
from _models import convnet, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edgetrain.approx.elastic.select import plan_for_speedup, select_tensors, solve_units
from edgetrain.approx.elastic.selector import ElasticConfig, ElasticSelector, tensor_importance
from edgetrain.approx.elastic.state import TrainingSnapshot
from edgetrain.approx.elastic.timing import TensorTiming, measure_timing
from edgetrain.errors import BudgetError, InputError

FAST = dict(timing_repeats=3, timing_cut_repeats=3, timing_max_cuts=6, calibration_pairs=0)


def synthetic_timing(model, fixed_s=0.010, dw_s=0.0002, dy_s=0.0003):
    """A made-up :class:`TensorTiming` for ``model``'s parameters (in registration order, which is the
    forward order of the test models): every tensor's weight gradient costs ``dw_s``, reaching one
    tensor deeper ``dy_s`` more, and ``fixed_s`` is paid whatever is trained. Tests that inject it
    (instead of measuring) are deterministic whatever the machine's load."""
    names = [n for n, _ in model.named_parameters()]
    n = len(names)
    cum = [dy_s * (n - 1 - k) for k in range(n)]
    return TensorTiming(names=names, layers=[m.rsplit(".", 1)[0] for m in names],
                        numels=[p.numel() for p in model.parameters()], forward_s=[0.0] * n,
                        weight_grad_s=[dw_s] * n, update_s=[0.0] * n, input_grad_s=[dy_s] * n,
                        input_grad_cum_s=cum, forward_graph_cum_s=[0.0] * n, forward_total_s=fixed_s,
                        forward_base_s=fixed_s, backward_base_s=0.0, backward_full_s=n * dw_s + cum[0],
                        update_full_s=0.0)


# ------------------------------------------------------------------------------------------ solver
def _brute_units(values, weights, forced, cap):
    best = -math.inf
    n = len(values)
    for r in range(1, n + 1):
        for s in itertools.combinations(range(n), r):
            cost = forced[s[0]] + sum(weights[k] for k in s[1:])
            if cost <= cap:
                best = max(best, sum(values[k] for k in s))
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_solve_units_matches_brute_force(data):
    n = data.draw(st.integers(1, 7))
    values = data.draw(st.lists(st.floats(-2, 10, allow_nan=False), min_size=n, max_size=n))
    weights = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    forced = data.draw(st.lists(st.integers(0, 25), min_size=n, max_size=n))
    cap = data.draw(st.integers(0, 30))
    chosen, value = solve_units(values, weights, forced, cap)
    expected = _brute_units(values, weights, forced, cap)
    if expected == -math.inf:
        assert chosen == ()
        return
    assert value == pytest.approx(expected, abs=1e-9)
    assert value == pytest.approx(sum(values[k] for k in chosen), abs=1e-9)
    d = min(chosen)
    assert forced[d] + sum(weights[k] for k in chosen if k != d) <= cap


def _real_cost(s, dw, depth, fixed):
    return fixed + depth[min(s)] + sum(dw[k] for k in s)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_select_tensors_exact_on_grid_and_never_over_budget(data):
    n = data.draw(st.integers(1, 7))
    imp = data.draw(st.lists(st.floats(0, 5, allow_nan=False), min_size=n, max_size=n))
    dw = data.draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=n, max_size=n))
    steps = data.draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=n, max_size=n))
    depth = [sum(steps[k + 1:]) for k in range(n)]   # input gradients pile up towards the input
    fixed = data.draw(st.floats(0, 2, allow_nan=False))
    budget = fixed + data.draw(st.floats(0.01, 6, allow_nan=False))
    units = data.draw(st.sampled_from([7, 50, 1000]))
    subsets = [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r)]
    if not any(_real_cost(s, dw, depth, fixed) <= budget for s in subsets):
        with pytest.raises(BudgetError):
            select_tensors(imp, dw, depth, fixed, budget, units)
        return
    sel = select_tensors(imp, dw, depth, fixed, budget, units)
    assert sel.time_s <= budget * (1 + 1e-12)                      # never over the budget
    assert sel.time_s == pytest.approx(_real_cost(sel.indices, dw, depth, fixed))
    unit = (budget - fixed) / units
    on_grid = [s for s in subsets if math.ceil((depth[s[0]] + dw[s[0]]) / unit)
               + sum(math.ceil(dw[k] / unit) for k in s[1:]) <= units]
    best_grid = max((sum(imp[k] for k in s) for s in on_grid), default=None)
    if best_grid is not None:                                       # exact on the grid
        assert sel.importance == pytest.approx(best_grid, abs=1e-9)
    # conservative rounding loses at most one unit per tensor
    slack = [s for s in subsets if _real_cost(s, dw, depth, fixed) <= budget - n * unit]
    assert sel.importance >= max((sum(imp[k] for k in s) for s in slack), default=0) - 1e-9


def test_input_most_tensor_is_selectable():
    # tensor 0 is by far the most important and fits alone: the original's loop could never pick it
    sel = select_tensors([10.0, 1.0, 1.0], [0.1, 0.1, 0.1], [0.5, 0.2, 0.0], 1.0, budget_s=1.65)
    assert sel.indices == (0,)


def test_deepest_tensor_own_input_gradient_not_charged():
    # depth_s[0] covers the input gradients of layers 1 and 2 only; charging layer 0's own (0.3 s)
    # as the original did would make {0} infeasible at this budget.
    sel = select_tensors([5.0, 1.0, 1.0], [0.1, 0.1, 0.1], [0.5, 0.2, 0.0], 1.0, budget_s=1.6)
    assert 0 in sel.indices and sel.time_s == pytest.approx(1.6)


def test_slack_takes_the_most_important_selection_about_as_fast_as_the_fastest():
    # tensors 1 and 2 share the output layer (no depth cost); 2 (a bias) is the fastest alone, 1 (the
    # weight) costs 4% more and matters far more: "max" with 5% slack trains both, with none only 2
    imp, dw, depth = [3.0, 5.0, 0.1], [0.2, 0.05, 0.01], [0.6, 0.0, 0.0]
    full = 1.0 + 0.6 + 0.26
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = plan_for_speedup(imp, dw, depth, 1.0, full, speedup=math.inf)
        slack = plan_for_speedup(imp, dw, depth, 1.0, full, speedup=math.inf, slack=0.05)
    assert exact.selection.indices == (2,) and slack.selection.indices == (1, 2)
    assert slack.reachable_speedup == exact.reachable_speedup == pytest.approx(full / 1.01)
    assert slack.predicted_speedup >= slack.reachable_speedup / 1.05
    # the budget never shrinks as the request grows: 1.8x (just under the 1.84x reachable) plans alike
    near = plan_for_speedup(imp, dw, depth, 1.0, full, speedup=1.8, slack=0.05)
    assert near.selection.indices == (1, 2) and not near.clamped
    # far from the limit the slack changes nothing
    assert (plan_for_speedup(imp, dw, depth, 1.0, full, speedup=1.2, slack=0.05).selection
            == plan_for_speedup(imp, dw, depth, 1.0, full, speedup=1.2).selection)
    with pytest.raises(InputError):
        plan_for_speedup(imp, dw, depth, 1.0, full, speedup=2.0, slack=-0.1)


def test_infeasible_request_warns_and_uses_reachable(caplog):
    imp, dw, depth = [1.0, 2.0, 3.0], [0.2, 0.2, 0.1], [0.6, 0.3, 0.0]
    full = 1.0 + 0.6 + 0.5
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match=r"requested speed-up 3x is "
                                                        r"beyond the reachable 1\.91x"):
        plan = plan_for_speedup(imp, dw, depth, 1.0, full, speedup=3.0)
    assert plan.clamped and plan.selection.indices == (2,)
    assert plan.predicted_speedup == pytest.approx(plan.reachable_speedup) == pytest.approx(full / 1.1)
    assert "beyond the reachable" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a reachable request does not warn
        ok = plan_for_speedup(imp, dw, depth, 1.0, full, speedup=1.5)
    assert not ok.clamped and ok.predicted_speedup >= 1.5
    with pytest.raises(InputError):
        plan_for_speedup(imp, dw, depth, 1.0, full, speedup=0.5)


# ------------------------------------------------------------------------------------------ timing
class _Reordered(nn.Module):
    """Parameters registered in the opposite order to the one forward uses them in."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.mid = nn.Linear(16, 16)
        self.stem = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.stem(x)))))


class _NoInputGrad(nn.Linear):
    """A layer that refuses to be differentiated w.r.t. its input (cannot be timed in isolation)."""

    def forward(self, x):
        if x.requires_grad:
            raise RuntimeError("input gradients are not supported by this layer")
        return super().forward(x)


def test_timing_forward_order_fallback_cache_and_json(tmp_path):
    model = nn.Sequential(_NoInputGrad(8, 16), nn.ReLU(), _Reordered())
    batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cache = tmp_path / "timing.json"
    t = measure_timing(model, batch, nn.CrossEntropyLoss(), opt, repeats=1, cut_repeats=1, cache_path=cache)
    assert t.names == ["0.weight", "0.bias", "2.stem.weight", "2.stem.bias", "2.mid.weight", "2.mid.bias",
                       "2.head.weight", "2.head.bias"]
    assert t.fallback_layers == ["0"]                  # FLOPs estimate for the layer that raised
    assert all(v >= 0 for k in ("weight_grad_s", "update_s", "input_grad_s", "depth_s")
               for v in getattr(t, k))
    assert t.forward_total_s > 0 and t.backward_full_s > 0 and t.update_full_s > 0
    assert all(a >= b for a, b in zip(t.depth_s, t.depth_s[1:]))   # deeper costs at least as much
    # the deepest tensor's own layer input gradient is excluded from what reaching it costs
    for k in range(len(t.names)):
        assert t.input_grad_cum_s[k] == pytest.approx(sum(t.input_grad_s[k + 1:]), abs=1e-12)
    assert t.full_step_s == pytest.approx(t.forward_total_s + t.backward_full_s + t.update_full_s)
    assert measure_timing(model, batch, nn.CrossEntropyLoss(), opt) is t          # in-memory cache
    stored = json.loads(cache.read_text())
    assert list(stored) == [t.key] and stored[t.key]["names"] == t.names
    assert type(t).from_json(t.to_json()) == t


# --------------------------------------------------------------------------------- probe restoring
def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [p.requires_grad for p in model.parameters()],
            [b.clone() for b in model.buffers()],
            {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _assert_same(a, b):
    for x, y in zip(a[:4], b[:4]):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            assert (u is None and v is None) or (torch.is_tensor(u) and torch.equal(u, v)) or u == v
    assert a[4].keys() == b[4].keys()
    for k in a[4]:
        assert a[4][k].keys() == b[4][k].keys()
        for n in a[4][k]:
            u, v = a[4][k][n], b[4][k][n]
            assert torch.equal(u, v) if torch.is_tensor(u) else u == v
    assert a[5] == b[5]


@pytest.mark.parametrize("make_opt,warm_steps", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3), 2),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2), 0),       # probe creates state that must vanish again
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 3),
])
def test_importance_probe_restores_everything_bit_exactly(make_opt, warm_steps):
    model = convnet(classes=4)                           # BatchNorm buffers and dropout RNG
    opt = make_opt(model.parameters())
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    for _ in range(warm_steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model[0].weight.requires_grad_(False)                # a user-frozen tensor stays frozen
    nn.functional.cross_entropy(model(x), y).backward()  # leave some gradients lying around
    before = _state(model, opt)
    rng = torch.get_rng_state()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for kind in ("gradient", "update"):
        imp = tensor_importance(model, opt, (x, y), nn.CrossEntropyLoss(), names, kind)
        _assert_same(before, _state(model, opt))
        assert torch.equal(torch.get_rng_state(), rng)
        assert len(imp) == len(names) and sum(imp) > 0   # the probe step lowers the loss
    with TrainingSnapshot(model, opt):                   # and the snapshot itself is reusable
        opt.step()
    _assert_same(before, _state(model, opt))


# ------------------------------------------------------------------------------------------ runtime
def _attach(model, opt, batch, **cfg):
    sel = ElasticSelector(ElasticConfig(**{**FAST, **cfg}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sel.attach(model, opt, batch, nn.CrossEntropyLoss())


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
])
def test_unselected_tensors_untouched_by_real_steps(make_opt):
    model = mlp(d_in=16, d=32, n_blocks=4, classes=5)
    opt = make_opt(model.parameters())
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    for _ in range(2):                                   # every tensor gets optimizer state first
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sel = ElasticSelector(ElasticConfig(speedup=math.inf, **FAST))   # as fast as possible: few tensors
    with pytest.warns(UserWarning, match=r"requested speed-up infx is beyond the reachable"):
        sel.attach(model, opt, (x, y), nn.CrossEntropyLoss())
    assert sel.plan.clamped        # "max": within calibration_tolerance (5%) of the reachable speed-up
    assert sel.reachable_speedup / 1.05 * (1 - 1e-9) <= sel.predicted_speedup <= sel.reachable_speedup
    chosen = set(sel.selected)
    names = dict(model.named_parameters())
    assert 0 < len(chosen) < len(names)
    frozen = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for n, p in names.items() if n not in chosen}
    trained = {n: names[n].detach().clone() for n in chosen}
    for _ in range(3):
        opt.zero_grad(set_to_none=False)                 # even zeroing in place resurrects nothing
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for n, (value, state) in frozen.items():
        assert names[n].grad is None and torch.equal(names[n], value)
        assert all(torch.equal(state[k], opt.state[names[n]][k]) for k in state)
    assert any(not torch.equal(names[n], v) for n, v in trained.items())


def test_backprop_stops_at_deepest_selected_tensor():
    model = convnet(classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,))
    sel = _attach(model, opt, (x, y), speedup=1.6)
    deepest_module = sel.deepest_selected.rsplit(".", 1)[0]
    assert sel.deepest_layer == deepest_module
    order = [str(i) for i in range(len(model))]
    below = order[:order.index(deepest_module)]
    assert sel.frozen_layers() == [m for m in below if list(model[int(m)].parameters())]
    input_needs_grad, fired = {}, []
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda mod, args, i=str(i): input_needs_grad.__setitem__(
            i, args[0].requires_grad))
        if str(i) in below:
            layer.register_full_backward_hook(lambda *a, i=str(i): fired.append(i))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.functional.cross_entropy(model(x), y).backward()
    assert fired == []
    assert not any(input_needs_grad[m] for m in below + [deepest_module])   # no input gradient below
    assert input_needs_grad[order[-1]] or deepest_module == order[-1]
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in sel.selected)


def test_frozen_batchnorm_still_tracks_running_statistics():
    # as in full fine-tuning in train mode: a BatchNorm whose tensors are not selected keeps updating
    # its running mean/var (the frozen prefix runs forward in train mode), but its affine tensors stay
    model = convnet(classes=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 3, 8, 8) * 3 + 1, torch.randint(0, 4, (32,))
    sel = _attach(model, opt, (x, y), speedup=math.inf)
    bn = model[1]
    assert "1.weight" not in sel.selected and "1.bias" not in sel.selected
    mean, var, w = bn.running_mean.clone(), bn.running_var.clone(), bn.weight.detach().clone()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not torch.equal(bn.running_mean, mean) and not torch.equal(bn.running_var, var)
    assert torch.equal(bn.weight, w) and bn.num_batches_tracked.item() >= 1


def test_selector_reselects_on_interval_and_reports():
    model = mlp(d_in=16, d=32, n_blocks=3, classes=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(32, 16), torch.randint(0, 5, (32,))) for _ in range(4)]
    sel = _attach(model, opt, data[0], speedup=1.5, interval_steps=3, probe_batch_size=8)
    assert sel.reselections == 1 and sel.reachable_speedup >= sel.predicted_speedup - 1e-9
    if sel.plan.clamped:     # only when a noisy measurement says 1.5x is out of reach
        assert sel.predicted_speedup == pytest.approx(sel.reachable_speedup) and sel.reachable_speedup < 1.5
    else:
        assert sel.predicted_speedup >= 1.5 - 1e-9
    assert not sel.maybe_reselect(1, data[1]) and not sel.maybe_reselect(2, data[2])
    assert sel.maybe_reselect(3, data[3]) and sel.reselections == 2
    assert set(sel.importance) == set(sel.timing.names)
    assert sel.selected == [n for n in sel.timing.names if n in set(sel.selected)]
    kept = sel.plan
    for g in opt.param_groups:                           # no update lowers the loss: keep the plan
        g["lr"] = 0.0
    assert sel.reselect(data[0]) is kept and sel.reselections == 2
    sel.release()
    assert all(p.requires_grad for p in model.parameters())
    sel.apply()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(sel.selected)


def test_config_validation_and_unattached_use():
    with pytest.raises(InputError):
        ElasticConfig(speedup=0.9)
    with pytest.raises(InputError):
        ElasticConfig(interval_steps=0)
    with pytest.raises(InputError):
        ElasticConfig(calibration_pairs=-1)
    with pytest.raises(InputError):
        ElasticConfig(calibration_tolerance=0.0)
    with pytest.raises(InputError):
        ElasticConfig(calibration_rounds=0)
    from edgetrain.errors import EdgetrainError
    with pytest.raises(EdgetrainError, match="attach"):
        _ = ElasticSelector().selected


def test_calibration_corrects_a_timing_model_that_is_off(monkeypatch):
    # Deterministic: the timing model is injected (not measured) and the "machine" delivers exactly 75%
    # of the speed-up the model predicts, so nothing here depends on the machine's load.
    import edgetrain.approx.elastic.selector as el
    model = mlp(d_in=16, d=64, n_blocks=8, classes=5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randn(64, 16), torch.randint(0, 5, (64,)))
    timing = synthetic_timing(model)
    monkeypatch.setattr(el, "measure_timing", lambda *a, **k: timing)
    calls = []
    real = el.measure_speedup

    def slow_machine(model_, opt_, batch_, loss_fn, params, chosen, pairs):
        # the real machine delivers 25% less speed-up than the timing model predicts
        calls.append(set(chosen))
        assert pairs == 3
        full = timing.full_step_s
        return 0.75 * full / timing.step_time_s(sorted(chosen)), [1.1 * full] * pairs

    sel = ElasticSelector(ElasticConfig(**{**FAST, "calibration_pairs": 3}, speedup=1.5))
    monkeypatch.setattr(el, "measure_speedup", slow_machine)
    before = TrainingSnapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # on target after correcting: no warning
        sel.attach(model, opt, batch, nn.CrossEntropyLoss())
    assert sel.reachable_speedup > 2.0                   # the injected model can reach 1.5 / 0.75
    first_predicted = timing.full_step_s / timing.step_time_s(sorted(calls[0]))
    assert 0.75 * first_predicted < 1.5 * 0.95           # the first selection misses on the machine
    assert len(calls) >= 2 and sel.target_speedup > 1.5
    assert sel.plan.requested_speedup == 1.5 and sel.predicted_speedup > 1.5 / 0.75 * 0.95
    assert sel.measured_speedup == pytest.approx(0.75 * sel.predicted_speedup)
    assert abs(sel.measured_speedup / 1.5 - 1.0) <= 0.05
    assert sel.full_step_s == pytest.approx(1.1 * timing.full_step_s)   # the reference for the loop
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(sel.selected)
    # the real measurement runs real steps and restores everything they touched
    monkeypatch.setattr(el, "measure_speedup", real)
    for p, (q, value, _, _) in zip(model.parameters(), before._params):
        assert torch.equal(p.detach(), value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the injected model says nothing of this machine
        assert sel.calibrate(batch) > 0 and not opt.state   # Adam had no state before: none after
    for p, (q, value, _, _) in zip(model.parameters(), before._params):
        assert torch.equal(p.detach(), value)


def test_calibration_warns_when_the_request_stays_out_of_reach(monkeypatch):
    import edgetrain.approx.elastic.selector as el
    model = mlp(d_in=16, d=32, n_blocks=3, classes=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(32, 16), torch.randint(0, 5, (32,)))
    monkeypatch.setattr(el, "measure_speedup", lambda *a, **k: (1.1, [0.01]))
    sel = ElasticSelector(ElasticConfig(**{**FAST, "calibration_pairs": 2}, speedup=2.0))
    with pytest.warns(UserWarning, match=r"measured 1\.10x .* below the requested 2x"):
        sel.attach(model, opt, batch, nn.CrossEntropyLoss())
    assert sel.measured_speedup == 1.1


# ----------------------------------------------------------------------------- memory planner hand-off
def _chain(n=5):
    from edgetrain.graph import CostChain, Linear, StageCost
    stages = tuple(StageCost(f"s{i}", fwd_s=Linear(1e-3, 1e-4 * (i + 1)), bwd_s=Linear(2e-3, 2e-4),
                             saved_bytes=Linear(100, 1000 * (i + 1)), out_bytes=Linear(0, 500 + 100 * i),
                             workspace_bytes=Linear(0, 50)) for i in range(n))
    return CostChain(stages, batch_size=8, input_bytes=Linear(0, 300), fixed_bytes=10_000,
                     loss_s=Linear(1e-4, 0.0), step_fixed_s=5e-3, name="toy")


def test_stage_saved_bytes_zero_below_first_trained_stage():
    from edgetrain.approx.elastic.memory import stage_saved_bytes
    chain = _chain()
    assert stage_saved_bytes(chain, 0, 4) == [100 + 4000 * (i + 1) for i in range(5)]
    got = stage_saved_bytes(chain, 3, 4)
    assert got[:3] == [0.0, 0.0, 0.0] and got[3:] == [chain.stages[3].saved_bytes.at(4),
                                                     chain.stages[4].saved_bytes.at(4)]
    with pytest.raises(InputError):
        stage_saved_bytes(chain, 5, 4)


def test_elastic_chain_plans_the_trained_suffix_only():
    from edgetrain.approx.elastic.memory import elastic_chain, first_trained_stage
    from edgetrain.graph import KEEP, simulate
    chain = _chain()
    same = elastic_chain(chain, 0)
    assert same.chain == chain and same.prefix == () and same.prefix_peak_bytes(4) == 0.0
    ec = elastic_chain(chain, 2)
    assert ec.chain.n == 3 and ec.chain.stages == chain.stages[2:]
    assert ec.chain.input_bytes == chain.stages[1].out_bytes          # the frozen prefix's output
    full = simulate(chain, 8, [KEEP] * 5)
    part = simulate(ec.chain, 8, [KEEP] * 3)
    # the prefix saves nothing: peak drops by exactly its saved bytes and retained outputs
    dropped = sum(st.saved_bytes.at(8) + st.out_bytes.at(8) for st in chain.stages[:2]) \
        + chain.input_bytes.at(8) - chain.stages[1].out_bytes.at(8)
    assert full.activation_peak_bytes - part.activation_peak_bytes == pytest.approx(dropped, abs=2)
    # forward time of the prefix is kept, its backward is gone
    bwd_prefix = sum(st.bwd_s.at(8) for st in chain.stages[:2])
    assert full.step_time_s - part.step_time_s == pytest.approx(bwd_prefix)
    # transient prefix peak: the busiest forward-only stage (input + output + workspace)
    assert ec.prefix_peak_bytes(8) == max(300 * 8 + 500 * 8 + 50 * 8, 500 * 8 + 600 * 8 + 50 * 8)
    assert first_trained_stage([["a", "b"], ["c"], ["d"]], "c") == 1
    assert first_trained_stage([["a"]], None) == 0
    with pytest.raises(InputError):
        first_trained_stage([["a"]], "z")
    with pytest.raises(InputError):
        elastic_chain(chain, -1)

