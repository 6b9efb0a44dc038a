"""Closed-loop speed-up control of ElasticSelector: deterministic, with injected timings and step times."""

import logging
import math
import warnings

import pytest
import torch
from _models import mlp
from test_elastic import FAST, synthetic_timing
from torch import nn

from edgetrain.approx.elastic.selector import ElasticConfig, ElasticSelector
from edgetrain.approx.elastic.feedback import correct_target, secant_target
from edgetrain.errors import InputError


# ------------------------------------------------------------------------------------ pure function
def test_correct_target_damps_clamps_and_needs_enough_steps():
    # delivered 1.6x (0.1 s full / 0.0625 s steps) for a wanted 2x: half the log error is corrected
    c = correct_target(2.0, 2.0, 0.1, [0.0625] * 9, gain=0.5, max_change=0.5)
    assert c.delivered_speedup == pytest.approx(1.6) and c.steps_timed == 9
    assert c.new_target == pytest.approx(2.0 * math.sqrt(2.0 / 1.6))
    # faster than wanted: the target drops (the next selection may go deeper)
    fast = correct_target(2.0, 2.0, 0.1, [0.04] * 9, gain=1.0, max_change=0.5)
    assert fast.new_target == pytest.approx(2.0 * 2.0 / 2.5)
    # one wild interval moves the target by at most 1 + max_change either way
    assert correct_target(2.0, 2.0, 0.1, [1.0] * 9, max_change=0.2).new_target == pytest.approx(2.0 * 1.2)
    assert correct_target(2.0, 2.0, 0.1, [1e-4] * 9, max_change=0.2).new_target == pytest.approx(2.0 / 1.2)
    # the median ignores a minority of slow steps (an evaluation, a load burst, a warm-up step)
    noisy = correct_target(2.0, 2.0, 0.1, [0.05] * 6 + [5.0, 7.0, 0.9])
    assert noisy.delivered_speedup == pytest.approx(2.0) and noisy.new_target == pytest.approx(2.0)
    # bounds: never below 1, never beyond the model's reachable speed-up
    assert correct_target(1.05, 2.0, 0.1, [0.04] * 9, gain=1.0, max_change=1.0).new_target == 1.0
    assert correct_target(3.9, 2.0, 0.1, [0.2] * 9, max_target=4.0).new_target == 4.0
    # too few usable step times: no correction
    assert correct_target(2.0, 2.0, 0.1, [0.05] * 4 + [float("nan"), -1.0], min_steps=5) is None
    with pytest.raises(InputError):
        correct_target(2.0, 2.0, 0.1, [0.05] * 9, gain=0.0)
    with pytest.raises(InputError):
        correct_target(2.0, math.inf, 0.1, [0.05] * 9)


def test_secant_target_steps_through_the_last_two_rounds():
    assert secant_target([(2.0, 1.6)], 2.0) == pytest.approx(2.5)                 # one round: the ratio
    # the machine delivers 0.5 * target ** 1.6: the ratio rule overshoots, the secant lands on it
    rounds = [(2.0, 0.5 * 2.0 ** 1.6), (2.5, 0.5 * 2.5 ** 1.6)]
    assert secant_target(rounds, 2.0) == pytest.approx(4.0 ** (1 / 1.6))
    # a slope of the wrong sign (noise) or none: back to the ratio rule; never beyond 2x a step
    assert secant_target([(2.0, 1.8), (2.5, 1.6)], 2.0) == pytest.approx(2.5 * 2.0 / 1.6)
    assert secant_target([(2.0, 1.6), (2.0, 1.7)], 2.0) == pytest.approx(2.0 * 2.0 / 1.7)
    assert secant_target([(2.0, 1.0), (2.02, 1.001)], 2.0) == pytest.approx(4.04)


def test_calibration_steps_by_secant_and_keeps_the_round_closest_to_the_request(monkeypatch):
    import edgetrain.approx.elastic.selector as el
    seen = []

    def steep(model_, opt_, batch_, loss_fn, params, chosen, pairs):
        # the machine's speed-up grows faster than the model's: delivered = 0.5 * predicted ** 1.6
        seen.append(sel.target_speedup)
        pred = timing.full_step_s / timing.step_time_s(sorted(chosen))
        return 0.5 * pred ** 1.6, [timing.full_step_s] * pairs

    sel = ElasticSelector(ElasticConfig(**{**FAST, "calibration_pairs": 3}, speedup=2.0))
    model = mlp(d_in=16, d=32, n_blocks=8, classes=5)
    timing = synthetic_timing(model, dw_s=0.0004, dy_s=0.0001, fixed_s=0.004)
    monkeypatch.setattr(el, "measure_timing", lambda *a, **k: timing)
    monkeypatch.setattr(el, "tensor_importance", lambda m, o, b, f, names, *kind: [1.0] * len(names))
    monkeypatch.setattr(el, "measure_speedup", steep)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sel.attach(model, opt, (torch.randn(8, 16), torch.randint(0, 5, (8,))), nn.CrossEntropyLoss())
    assert len(seen) == 3 and abs(sel.measured_speedup / 2.0 - 1.0) <= 0.05     # on target in 3 rounds
    # scripted measurements that get worse: the first round's selection is the one kept
    script = iter([1.8, 2.6, 2.5])
    monkeypatch.setattr(el, "measure_speedup", lambda *a: (next(script), [timing.full_step_s] * 3))
    sel = ElasticSelector(ElasticConfig(**{**FAST, "calibration_pairs": 3, "calibration_rounds": 3}, speedup=2.0))
    sel.attach(model, opt, (torch.randn(8, 16), torch.randint(0, 5, (8,))), nn.CrossEntropyLoss())
    first = sel.plan
    assert sel.measured_speedup == 1.8 and sel.target_speedup == 2.0
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(sel.selected)
    assert first.predicted_speedup >= 2.0


# ------------------------------------------------------------------------------------- the selector
def _selector(monkeypatch, speedup=2.0, warn="error", **cfg):
    """An attached selector on an injected timing model with fixed importance (no measurement)."""
    import edgetrain.approx.elastic.selector as el
    model = mlp(d_in=16, d=32, n_blocks=8, classes=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    timing = synthetic_timing(model)
    monkeypatch.setattr(el, "measure_timing", lambda *a, **k: timing)
    monkeypatch.setattr(el, "tensor_importance", lambda m, o, b, f, names, *kind: [1.0] * len(names))
    sel = ElasticSelector(ElasticConfig(**{**FAST, "interval_steps": 10, **cfg}, speedup=speedup))
    batch = (torch.randn(8, 16), torch.randint(0, 5, (8,)))
    with warnings.catch_warnings():
        warnings.simplefilter(warn)
        sel.attach(model, opt, batch, nn.CrossEntropyLoss())
    return sel, timing, batch


def _machine(timing, slowdown):
    """Real step seconds of the selection in force on a machine ``slowdown`` times slower than the model
    predicts for selected steps (the full step is as predicted: the model was checked against it)."""
    return lambda sel: slowdown * timing.step_time_s(sel.plan.selection.indices)


@pytest.mark.parametrize("slowdown", [1.3, 0.8])
def test_feedback_converges_to_the_requested_speedup(monkeypatch, caplog, slowdown):
    sel, timing, batch = _selector(monkeypatch, feedback_checks=0)     # the interval loop alone
    real = _machine(timing, slowdown)
    first = sel.plan.selection.indices
    delivered = [timing.full_step_s / real(sel)]
    assert abs(delivered[0] / 2.0 - 1.0) > 0.1          # the timing model alone misses by over 10%
    with caplog.at_level(logging.INFO, logger="edgetrain.approx.elastic.selector"):
        for step in range(1, 121):
            if sel.maybe_reselect(step, batch):
                delivered.append(timing.full_step_s / real(sel))
            sel.record_step_time(real(sel), samples=8)
    assert sel.reselections == 13 and len(sel.corrections) == 12
    assert all(c.steps_timed == 10 for c in sel.corrections[1:])
    assert abs(delivered[-1] / 2.0 - 1.0) < 0.05         # on target within the selection's granularity
    assert sel.delivered_speedup == pytest.approx(delivered[-2])
    assert caplog.text.count("elastic feedback at step") == 12
    if slowdown > 1:      # slower than the model: the target rises, the selection gets shallower
        assert sel.target_speedup > 2.0 and sel.plan.selection.indices[0] > first[0]
    else:                 # faster: it uses the time it has and goes deeper
        assert sel.target_speedup < 2.0 and sel.plan.selection.indices[0] < first[0]


@pytest.mark.parametrize("slowdown", [1.3, 0.8])
def test_checks_correct_a_missing_selection_within_the_first_interval(monkeypatch, slowdown):
    # the model misses by 20-30% on every set: checks after 5 steps re-solve at once, long before the
    # first re-selection (step 100), and stop once a selection is within the check tolerance
    sel, timing, batch = _selector(monkeypatch, interval_steps=100)
    real = _machine(timing, slowdown)
    assert abs(timing.full_step_s / real(sel) / 2.0 - 1.0) > 0.1
    changed = []
    for step in range(1, 60):
        if sel.maybe_reselect(step, batch):
            changed.append(step)
        sel.record_step_time(real(sel), samples=8)
    assert sel.reselections == 1 and 1 <= len(changed) <= 3 and changed[0] == 6
    assert all(b - a >= 5 for a, b in zip(changed, changed[1:]))     # each set runs 5 steps before a check
    delivered = timing.full_step_s / real(sel)
    assert abs(delivered / 2.0 - 1.0) <= 0.08 or len(sel.corrections) == 3
    assert abs(delivered / 2.0 - 1.0) < 0.05                          # within the selection's granularity
    assert all(c.new_target == pytest.approx(c.old_target * 2.0 / c.delivered_speedup)
               for c in sel.corrections[:1])                          # the first check corrects in full
    # on target (the machine is the model): checks change nothing
    sel, timing, batch = _selector(monkeypatch, interval_steps=100)
    for step in range(1, 60):
        assert not sel.maybe_reselect(step, batch)
        sel.record_step_time(timing.step_time_s(sel.plan.selection.indices), samples=8)
    assert sel.corrections == []
    # at most feedback_checks corrections per interval, however wild the steps
    sel, timing, batch = _selector(monkeypatch, interval_steps=100, feedback_checks=2)
    wild = iter([0.2, 5.0, 0.2, 5.0, 0.2] * 20)
    for step in range(1, 60):
        sel.maybe_reselect(step, batch)
        sel.record_step_time(next(wild) * timing.step_time_s(sel.plan.selection.indices), samples=8)
    assert len(sel.corrections) <= 2
    with pytest.raises(InputError):
        ElasticConfig(feedback_check_tolerance=0.0)
    with pytest.raises(InputError):
        ElasticConfig(feedback_checks=-1)


def test_automatic_timing_between_maybe_reselect_calls(monkeypatch):
    now = [0.0]
    sel, timing, batch = _selector(monkeypatch, interval_steps=20, feedback_checks=0)
    sel._clock = lambda: now[0]
    step_s = 1.3 * timing.step_time_s(sel.plan.selection.indices)
    half = (batch[0][:4], batch[1][:4])
    for step in range(1, 10):
        sel.maybe_reselect(step, half if step == 5 else batch)
        # step 5 ran a half batch in half the time (scaled back to the full batch); step 7 also
        # evaluated (a slow interval the median ignores)
        now[0] += step_s * (0.5 if step == 5 else 1.0) + (2.0 if step == 7 else 0.0)
    sel.maybe_reselect(12, batch)                       # not consecutive: the interval is not a step
    assert sel._step_times == pytest.approx([step_s] * 6 + [step_s + 2.0, step_s])
    assert sel.maybe_reselect(22, batch)                # re-selects and corrects from those steps
    c = sel.corrections[-1]
    assert c.steps_timed == 8 and c.step_s == pytest.approx(step_s)
    assert c.delivered_speedup == pytest.approx(timing.full_step_s / step_s)
    assert sel._step_times == []                        # the new selection is timed anew
    sel.record_step_time(0.01)                          # an explicit record turns automatic timing off
    now[0] += 5.0
    sel.maybe_reselect(23, batch)
    assert sel._step_times == [0.01]


def test_feedback_off_released_and_unreachable(monkeypatch):
    sel, timing, batch = _selector(monkeypatch, feedback_gain=0.0)
    for step in range(1, 12):
        sel.maybe_reselect(step, batch)
        sel.record_step_time(1.0)
    assert sel.corrections == [] and sel.target_speedup == 2.0
    sel, timing, batch = _selector(monkeypatch)
    sel.release()                                       # full fine-tuning steps are not the selection's
    for _ in range(10):
        sel.record_step_time(1.0)
    sel.apply()
    assert sel._step_times == []
    sel, timing, batch = _selector(monkeypatch, speedup=math.inf, warn="ignore")
    assert sel.plan.clamped
    for step in range(1, 12):                           # "as fast as possible" has no target to correct
        sel.maybe_reselect(step, batch)
        sel.record_step_time(1.0)
    assert sel.corrections == [] and math.isinf(sel.target_speedup)
    with pytest.raises(InputError):
        ElasticConfig(feedback_gain=1.5)
    with pytest.raises(InputError):
        ElasticConfig(feedback_max_change=0.0)


def test_prepare_trainstep_reports_its_step_times():
    import edgetrain
    model = mlp(d=64, n_blocks=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y),
                                 speedup=ElasticConfig(speedup=1.5, calibration_pairs=2, interval_steps=50))
    sel = step.elastic
    assert sel.full_step_s > 0
    for _ in range(3):
        step(x, y)
    assert sel._explicit and len(sel._step_times) == 3 and all(t > 0 for t in sel._step_times)


def test_calibrated_selection_reanchors_the_full_step_to_load_drift(monkeypatch):
    # calibration measures the selection exactly on target; then the whole machine runs 1.6x slower
    # (full steps too): that is drift, not model error, and must not move the planner's target
    import edgetrain.approx.elastic.selector as el
    model = mlp(d_in=16, d=32, n_blocks=8, classes=5)
    timing = synthetic_timing(model)
    monkeypatch.setattr(el, "measure_timing", lambda *a, **k: timing)
    monkeypatch.setattr(el, "tensor_importance", lambda m, o, b, f, names, *kind: [1.0] * len(names))
    monkeypatch.setattr(el, "measure_speedup", lambda m, o, b, f, params, chosen, pairs: (
        timing.full_step_s / timing.step_time_s(sorted(chosen)), [timing.full_step_s] * pairs))
    sel = ElasticSelector(ElasticConfig(**{**FAST, "calibration_pairs": 3, "interval_steps": 10}, speedup=2.0))
    batch = (torch.randn(8, 16), torch.randint(0, 5, (8,)))
    sel.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), batch, nn.CrossEntropyLoss())
    measured, target, first = sel.measured_speedup, sel.target_speedup, sel.plan.selection.indices
    slow = 1.6 * timing.step_time_s(first)
    for step in range(1, 10):
        assert not sel.maybe_reselect(step, batch)
        sel.record_step_time(slow, samples=8)
    assert sel.maybe_reselect(10, batch)
    c = sel.corrections[-1]
    assert sel.full_step_s == pytest.approx(1.6 * timing.full_step_s)      # the reference follows the machine
    assert c.delivered_speedup == pytest.approx(measured)                  # not 2 / 1.6
    assert sel.target_speedup == pytest.approx(target * (2.0 / measured) ** 0.5)
