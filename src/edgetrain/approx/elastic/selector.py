"""ElasticTrainer for PyTorch: train only the most important parameter tensors that fit a step-time budget.

At attach time, and again every ``interval_steps`` steps, :class:`ElasticSelector` scores every trainable
tensor by its first-order loss decrease on a small probe batch, then picks exactly the set of maximum
total importance whose predicted step time (measured per tensor on this machine by
:mod:`.timing`, solved by :mod:`.select`) is at most ``1 / speedup`` of a full
fine-tuning step. At attach time the plan is checked against real steps
(:meth:`ElasticSelector.calibrate`: back-to-back full and selected steps) and the planner's target is
corrected by the measured error, so the delivered speed-up, not only the predicted one, is on target.

Later selections reach other depths, where the timing model can be off by another amount, so the
selector keeps closing the loop on the user's own training steps, at no extra cost (closed-loop
control, :mod:`.feedback`): at each re-selection it corrects the planner's target by the ratio
of the speed-up the last selection's steps delivered (the real full step over their median) to the
requested one, damped and clamped. It does not wait for the next re-selection to notice a new set
missing: once a selection has run ``feedback_min_steps`` timed steps it is checked, and one delivering a
speed-up off the wanted one by more than ``feedback_check_tolerance`` is corrected at once (the target in
full, the selection re-solved with the same importance; at most ``feedback_checks`` times per interval).
The full step is measured at attach, and re-anchored whenever the
calibrated selection runs (its speed-up is known): load drift is not read as model error. Step times
reach it in one of two ways:

* automatically: :meth:`ElasticSelector.maybe_reselect`, called once per step as below, records the wall
  time between consecutive calls (consecutive step indices only; the interval after a re-selection
  starts when it returns). That interval holds whatever the loop does besides the step (data loading,
  logging); the median discards rare slow ones (an evaluation), but a loop that spends a steady
  share of its time outside the step should report step times itself;
* explicitly: ``sel.record_step_time(seconds, samples)`` after each step. The first explicit record
  turns the automatic one off. ``edgetrain.prepare(..., speedup=...)``'s ``TrainStep`` does this.

A step on a batch of another size than the attach example (a short last batch, a TrainStep running
several micro-batches) is scaled to the example's size in proportion to its samples.
Unselected tensors get ``requires_grad = False`` and ``grad = None``, so autograd computes nothing
below the deepest selected tensor, layers below it save no activations, and the optimizer (SGD, Adam,
... skip parameters whose ``grad`` is None) neither updates them nor touches their state.
Usage from a plain PyTorch loop (the optimizer holds every parameter; a batch is ``(inputs, target)``
and the loss is ``loss_fn(model(inputs), target)``)::

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sel = ElasticSelector(ElasticConfig(speedup=2.0, interval_steps=200))
    sel.attach(model, optimizer, example_batch=(x0, y0), loss_fn=nn.CrossEntropyLoss())
    for step, (x, y) in enumerate(loader):
        sel.maybe_reselect(step, (x, y))      # also times the steps for closed-loop control
        optimizer.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); optimizer.step()
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from ...errors import EdgetrainError, InputError
from .feedback import Correction, correct_target, secant_target
from .config import ElasticConfig
from .importance import tensor_importance
from .measure import batch_size, measure_speedup, slice_batch
from .select import SpeedupPlan, plan_for_speedup
from .state import TrainingSnapshot
from .timing import TensorTiming, measure_timing

__all__ = ["ElasticConfig", "ElasticSelector", "tensor_importance"]

logger = logging.getLogger(__name__)

#: a per-selection check moves the planner's target by at most this factor plus one either way
_CHECK_MAX_CHANGE = 0.5


class ElasticSelector:
    """Runtime tensor selection for a requested speed-up (ElasticTrainer, MobiSys'23, in PyTorch).

    Args:
        config: the settings (defaults: 2x, re-select every 100 steps).
        clock: seconds-returning clock that :meth:`maybe_reselect` times steps with (default
            ``time.perf_counter``; tests inject one).

    Attributes after :meth:`attach`:
        timing: the measured :class:`TensorTiming`.
        plan: the current :class:`SpeedupPlan`.
        importance: the latest importance of every candidate tensor, by name.
        measured_speedup: the step-time speed-up measured on real steps at attach time (None when
            calibration is off).
        target_speedup: the speed-up the planner aims its *model* at; calibration moves it away from the
            requested one by the ratio the model was measured to be off, and each re-selection corrects
            it again from the training steps (closed-loop control).
        full_step_s: the real full fine-tuning step seconds that training steps are compared with: the
            median full step of calibration (the timing model's when calibration is off).
        delivered_speedup: the speed-up the training steps of the last timed selection delivered
            (None before the first correction).
        corrections: every closed-loop :class:`Correction`, in order.
    """

    def __init__(self, config: ElasticConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config or ElasticConfig()
        self.timing: TensorTiming | None = None
        self.plan: SpeedupPlan | None = None
        self.importance: dict[str, float] = {}
        self.reselections = 0
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._loss_fn: Callable | None = None
        self._tensors: list[nn.Parameter] = []
        self._last_step = 0
        self.measured_speedup: float | None = None
        self._calibrated: tuple[int, ...] | None = None   # the selection calibration measured
        self.target_speedup = self.config.speedup
        self.full_step_s = 0.0
        self.delivered_speedup: float | None = None
        self.corrections: list[Correction] = []
        self._clock = clock
        self._step_times: list[float] = []      # real step seconds of the selection in force
        self._ref_samples: int | None = None    # samples of the attach example (step times scale to it)
        self._explicit = False                   # record_step_time was called: no automatic timing
        self._paused = False                     # released (full fine-tuning): steps are not timed
        self._last_call: tuple[float, int, int | None] | None = None   # (clock, step, samples)
        self._checked = False                    # the selection in force was checked (see _check)
        self._checks_left = 0                    # checks that may still correct in this interval

    # ----------------------------------------------------------------------------------- lifecycle
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, example_batch: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor]) -> "ElasticSelector":
        """Measure the per-tensor costs, make the first selection, calibrate it on real steps, apply it.

        The candidates are the parameters with ``requires_grad`` that the forward pass uses; parameters
        the user froze stay frozen. Measuring runs real steps and then restores the training state.

        Args:
            model: the model, in training mode.
            optimizer: the optimizer over the model's parameters.
            example_batch: a real ``(inputs, target)`` batch of the training batch size.
            loss_fn: ``loss_fn(model(inputs), target) -> scalar``.

        Returns:
            self, for chaining.

        Raises:
            ProfileError: the model has no trainable tensor or could not be timed.
        """
        cfg = self.config
        self._model, self._optimizer, self._loss_fn = model, optimizer, loss_fn
        self.timing = measure_timing(model, example_batch, loss_fn, optimizer, repeats=cfg.timing_repeats,
                                     cut_repeats=cfg.timing_cut_repeats, max_cuts=cfg.timing_max_cuts,
                                     max_suffixes=cfg.timing_max_suffixes, cache_path=cfg.timing_cache_path)
        by_name = dict(model.named_parameters())
        self._tensors = [by_name[n] for n in self.timing.names]
        self._ref_samples = _samples(example_batch)
        self.full_step_s = self.timing.full_step_s
        self.reselect(example_batch, step_idx=0)
        self.calibrate(example_batch)
        return self

    def calibrate(self, batch: Any) -> float | None:
        """Measure the current selection's real speed-up and correct the plan until it is on target.

        Each round times ``calibration_pairs`` back-to-back pairs of real training steps (full, then
        selected) on ``batch``, restoring the training state afterwards. When the median ratio is off
        the requested speed-up by more than ``calibration_tolerance``, the planner's target is corrected
        as :func:`.feedback.secant_target` says (the model's error differs between selections,
        so a fixed ratio can overshoot back and forth) and the selection re-solved with the same
        importance (no new probe); the round measured closest to the request is kept. A request still
        missed at the reachable limit is warned about, never missed silently. The median of the full
        steps becomes :attr:`full_step_s`, the reference of closed-loop control.

        Args:
            batch: a real ``(inputs, target)`` batch of the training batch size.

        Returns:
            The measured speed-up of the kept selection (None when calibration is off).
        """
        timing, model = self._require()
        cfg = self.config
        if cfg.calibration_pairs == 0 or self.plan is None or cfg.speedup == 1.0:
            return None
        chosen = set(self.plan.selection.indices)
        fulls: list[float] = []
        rounds: list[tuple[float, float, SpeedupPlan]] = []    # (target, measured, plan) per round
        for r in range(cfg.calibration_rounds):
            with TrainingSnapshot(model, self._optimizer):
                measured, full_s = measure_speedup(model, self._optimizer, batch, self._loss_fn, self._tensors,
                                                   chosen, cfg.calibration_pairs)
            fulls += full_s
            self.full_step_s = statistics.median(fulls)
            rounds.append((self.target_speedup, measured, self.plan))
            want = min(cfg.speedup, self.plan.reachable_speedup)
            logger.info("elastic calibration %d: predicted %.2fx, measured %.2fx (requested %.2fx, planner "
                        "target %.3fx)", r + 1, self.plan.predicted_speedup, measured, cfg.speedup,
                        self.target_speedup)
            if (abs(measured / want - 1.0) <= cfg.calibration_tolerance or r == cfg.calibration_rounds - 1
                    or math.isinf(self.target_speedup)):
                break
            target = max(1.0, secant_target([(t, m) for t, m, _ in rounds], want))
            if target == self.target_speedup:
                break
            self.target_speedup = target
            self._plan(list(self.importance[n] for n in timing.names), warn=False)
            new = set(self.plan.selection.indices)
            for _ in range(4):       # a move too small to change the set: keep moving the same way
                if new != chosen or target in (1.0, self.plan.reachable_speedup):
                    break
                target = min(max(target * target / rounds[-1][0], 1.0), self.plan.reachable_speedup)
                self.target_speedup = target
                self._plan(list(self.importance[n] for n in timing.names), warn=False)
                new = set(self.plan.selection.indices)
            if new == chosen:
                break
            chosen = new
        target, measured, plan = min(rounds, key=lambda t: abs(math.log(t[1] / want)))
        if plan is not self.plan:
            logger.info("elastic calibration keeps round %d's selection (measured %.2fx)",
                        [t[2] for t in rounds].index(plan) + 1, measured)
        self.target_speedup, self.plan, self.measured_speedup = target, plan, measured
        self._calibrated = plan.selection.indices
        self.apply()
        if math.isfinite(cfg.speedup) and measured < cfg.speedup * (1.0 - 0.15):
            msg = (f"elastic selection reaches a measured {measured:.2f}x step-time speed-up, below the "
                   f"requested {cfg.speedup:.3g}x (the model predicts {self.plan.predicted_speedup:.2f}x, "
                   f"the largest reachable is {self.plan.reachable_speedup:.2f}x); ask for less, or expect "
                   "this speed-up")
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
        return measured

    def _plan(self, imp: list[float], warn: bool) -> SpeedupPlan:
        timing, _ = self._require()
        # speed-ups within calibration_tolerance are equal to the selector: near the reachable limit
        # ("max") it takes the most important selection that fast, not the single fastest tensor
        plan = plan_for_speedup(imp, timing.train_s, timing.depth_s, timing.fixed_s, timing.full_step_s,
                                self.target_speedup, self.config.time_units, warn=warn,
                                slack=self.config.calibration_tolerance)
        self.plan = replace(plan, requested_speedup=float(self.config.speedup),
                            clamped=plan.clamped and self.config.speedup > plan.reachable_speedup)
        return self.plan

    def maybe_reselect(self, step_idx: int, batch: Any) -> bool:
        """Re-select when ``interval_steps`` steps have passed since the last selection.

        Call it once per step, before the step's forward pass, with a global step counter (one that
        restarts lower counts anew from there). Unless :meth:`record_step_time` was ever called, it
        also records the wall time since the previous call (when ``step_idx`` follows the previous
        one) as the previous step's time, for closed-loop control.

        Args:
            step_idx: the global step counter.
            batch: this step's ``(inputs, target)`` batch (probed when re-selecting).

        Returns:
            True when it re-selected.
        """
        now = self._clock()
        last, samples = self._last_call, _samples(batch)
        if not self._explicit and last is not None and step_idx == last[1] + 1:
            self._record(now - last[0], last[2])
        self._last_call = (now, step_idx, samples)
        if step_idx < self._last_step:
            self._last_step = step_idx
        if step_idx - self._last_step < self.config.interval_steps:
            return self._check(step_idx)
        self.reselect(batch, step_idx)
        self._last_call = (self._clock(), step_idx, samples)   # the probe is not part of the step
        return True

    def record_step_time(self, seconds: float, samples: int | None = None) -> None:
        """Report the wall time of one training step run with the selection in force.

        The first call turns off :meth:`maybe_reselect`'s automatic timing: a loop that times its steps
        itself (excluding data loading) should report every step this way.

        Args:
            seconds: the step's wall time: zero_grad, forward, loss, backward and optimizer step.
            samples: the step's batch size; when it differs from the attach example's, the time is
                scaled to the example's size in proportion (None: taken as the example's size).
        """
        self._explicit = True
        self._record(seconds, samples)

    def _record(self, seconds: float, samples: int | None) -> None:
        if self._paused or self.plan is None:
            return
        if samples and self._ref_samples and samples != self._ref_samples:
            seconds *= self._ref_samples / samples
        self._step_times.append(float(seconds))

    def _feedback(self, step_idx: int | None) -> None:
        """Correct the planner's target from the timed steps of the selection in force (closed loop)."""
        cfg, plan, times = self.config, self.plan, self._step_times
        if (cfg.feedback_gain == 0.0 or plan is None or not math.isfinite(cfg.speedup) or cfg.speedup == 1.0
                or math.isinf(self.target_speedup) or not self.full_step_s > 0.0):
            return
        want = min(cfg.speedup, plan.reachable_speedup)
        ok = [t for t in times if math.isfinite(t) and t > 0.0]
        if (plan.selection.indices == self._calibrated and self.measured_speedup
                and len(ok) >= cfg.feedback_min_steps):
            # the calibrated selection's speed-up is known from back-to-back steps: its training steps
            # re-anchor the full step to the machine's speed now (the load may have changed since attach)
            logger.info("elastic feedback: full step reference %.4g s -> %.4g s (the calibrated selection's "
                        "steps x its measured %.2fx)", self.full_step_s, statistics.median(ok) *
                        self.measured_speedup, self.measured_speedup)
            self.full_step_s = statistics.median(ok) * self.measured_speedup
        c = correct_target(self.target_speedup, want, self.full_step_s, times, gain=cfg.feedback_gain,
                           max_change=cfg.feedback_max_change, min_steps=cfg.feedback_min_steps,
                           max_target=plan.reachable_speedup, step=step_idx)
        if c is None:
            logger.info("elastic feedback: %d timed steps of the last selection, fewer than %d; target "
                        "stays %.3fx", len(times), cfg.feedback_min_steps, self.target_speedup)
            return
        self.corrections.append(c)
        self.delivered_speedup, self.target_speedup = c.delivered_speedup, c.new_target
        logger.info("elastic feedback at step %s: %d steps of the last selection took %.4g s (median), "
                    "%.2fx faster than the full step's %.4g s (wanted %.2fx, the model predicted %.2fx); "
                    "planner target %.3fx -> %.3fx", step_idx, c.steps_timed, c.step_s, c.delivered_speedup,
                    c.full_step_s, want, plan.predicted_speedup, c.old_target, c.new_target)

    def _check(self, step_idx: int | None) -> bool:
        """Check the selection in force once it has run ``feedback_min_steps`` timed steps; when its
        delivered speed-up is off the wanted one by more than ``feedback_check_tolerance``, correct the
        target by the whole ratio (within a factor 1.5) and re-solve with the same importance.

        A re-selection changes the set, and the timing model's error differs from set to set (by 10-20%
        on the benches' models), so a target calibrated on one set can miss on the next; waiting a whole
        interval for the closed loop would spend it at the wrong speed. The steps are the user's own, so
        the check costs one re-solve (no probe, no extra step). Returns True when the selection changed.
        """
        cfg, plan, timing = self.config, self.plan, self.timing
        if (self._checked or self._checks_left <= 0 or cfg.feedback_gain == 0.0 or plan is None or self._paused
                or not math.isfinite(cfg.speedup) or cfg.speedup == 1.0 or math.isinf(self.target_speedup)
                or not self.full_step_s > 0.0):
            return False
        ok = [t for t in self._step_times if math.isfinite(t) and t > 0.0]
        if len(ok) < cfg.feedback_min_steps:
            return False
        self._checked = True
        step_s, want = statistics.median(ok), min(cfg.speedup, plan.reachable_speedup)
        if plan.selection.indices == self._calibrated and self.measured_speedup:
            # known from back-to-back steps: its training steps tell only the machine's speed now
            self.full_step_s = step_s * self.measured_speedup
            delivered = self.measured_speedup
        else:
            delivered = self.full_step_s / step_s
        if abs(delivered / want - 1.0) <= cfg.feedback_check_tolerance:
            return False
        # the ratio rule, not the secant: successive checks measure different sets, whose model errors
        # differ, so a secant through them is mostly noise (it swung a 2x target to 4.8x on MobileNetV2)
        old_target = self.target_speedup
        factor = min(max(want / delivered, 1.0 / (1.0 + _CHECK_MAX_CHANGE)), 1.0 + _CHECK_MAX_CHANGE)
        self.target_speedup = min(max(old_target * factor, 1.0), max(plan.reachable_speedup, 1.0))
        self._checks_left -= 1
        self.delivered_speedup = delivered
        self.corrections.append(Correction(step_idx, len(ok), step_s, self.full_step_s, delivered, want,
                                           old_target, self.target_speedup))
        before = plan.selection.indices
        self._plan([self.importance[n] for n in timing.names], warn=False)
        logger.info("elastic check at step %s: %d steps of the selection took %.4g s (median), %.2fx faster "
                    "than the full step (wanted %.2fx); planner target %.3fx -> %.3fx, %s", step_idx, len(ok),
                    step_s, delivered, want, old_target, self.target_speedup,
                    "same selection" if self.plan.selection.indices == before else
                    f"re-solved: {len(self.plan.selection.indices)} tensors, predicted "
                    f"{self.plan.predicted_speedup:.2f}x")
        if self.plan.selection.indices == before:
            return False
        self.apply()
        return True

    def reselect(self, batch: Any, step_idx: int | None = None) -> SpeedupPlan:
        """Re-evaluate importance on the first ``probe_batch_size`` samples of ``batch``, select, apply.

        Before selecting, the planner's target is corrected from the timed steps of the selection in
        force (closed-loop control; see the module docstring).

        Args:
            batch: the ``(inputs, target)`` batch to probe.
            step_idx: the global step counter (None: the interval schedule is not reset).

        Returns:
            The new :class:`SpeedupPlan` (the old one when no tensor's probe update lowers the loss).

        Raises:
            EdgetrainError: :meth:`attach` was not called.
        """
        timing, model = self._require()
        probe = slice_batch(batch, self.config.probe_batch_size)
        imp = tensor_importance(model, self._optimizer, probe, self._loss_fn, timing.names, self.config.importance)
        self.importance = dict(zip(timing.names, imp))
        no_step = all(float(g.get("lr", 1.0)) == 0.0 for g in self._optimizer.param_groups)
        if self.plan is not None and (max(imp) <= 0.0 or no_step):
            # no update lowers the loss (e.g. a learning rate decayed to 0): nothing to rank by
            logger.info("elastic re-selection skipped: no tensor's probe update lowers the loss")
            if step_idx is not None:
                self._last_step = step_idx
            return self.plan
        self._feedback(step_idx)
        # the reachability warning is raised at the first selection, later ones only log it
        self._plan(imp, warn=self.reselections == 0 and self.target_speedup == self.config.speedup)
        self.reselections += 1
        if step_idx is not None:
            self._last_step = step_idx
        self.apply()
        self._checks_left = self.config.feedback_checks
        logger.info("elastic selection %d: %d/%d tensors, deepest %s, predicted %.2fx (requested %.2fx, "
                    "reachable %.2fx)", self.reselections, len(self.plan.selection.indices),
                    len(timing.names), self.deepest_selected, self.plan.predicted_speedup,
                    self.plan.requested_speedup, self.plan.reachable_speedup)
        return self.plan

    def apply(self) -> None:
        """Make exactly the selected tensors trainable; unselected ones get ``grad = None``. Step timing
        for closed-loop control starts anew (and resumes after :meth:`release`)."""
        self._require()
        self._step_times, self._paused, self._checked = [], False, False
        chosen = set(self.plan.selection.indices) if self.plan is not None else set()
        for k, p in enumerate(self._tensors):
            p.requires_grad_(k in chosen)
            if k not in chosen:
                p.grad = None

    def release(self) -> None:
        """Make every candidate tensor trainable again (full fine-tuning) until :meth:`apply` or the next
        re-selection; the current plan is kept. Steps are not timed until then."""
        self._paused = True
        for p in self._tensors:
            p.requires_grad_(True)

    # -------------------------------------------------------------------------------------- report
    @property
    def selected(self) -> list[str]:
        """Names of the selected tensors, in forward order."""
        timing, _ = self._require()
        return [timing.names[k] for k in self.plan.selection.indices] if self.plan else list(timing.names)

    @property
    def predicted_speedup(self) -> float:
        """The timing model's full-step time over selected-step time (after calibration the model is
        aimed at ``target_speedup``, so this may differ from the requested and measured speed-ups)."""
        return self.plan.predicted_speedup if self.plan else 1.0

    @property
    def reachable_speedup(self) -> float:
        """The largest speed-up any selection can reach on this model and machine."""
        return self.plan.reachable_speedup if self.plan else 1.0

    @property
    def deepest_selected(self) -> str | None:
        """Name of the input-most selected tensor (backpropagation stops at its layer)."""
        names = self.selected
        return names[0] if names else None

    @property
    def deepest_layer(self) -> str | None:
        """Qualified name of the module owning the deepest selected tensor (what
        :func:`.memory.first_trained_stage` maps to the memory planner's first trained stage)."""
        timing, _ = self._require()
        return timing.layers[self.plan.selection.indices[0]] if self.plan else None

    def frozen_layers(self) -> list[str]:
        """Modules, in forward order, that run before the deepest selected tensor's layer: they need no
        gradient and save no activations (what the memory planner may drop)."""
        timing, _ = self._require()
        if not self.plan:
            return []
        deepest_layer = timing.layers[self.plan.selection.indices[0]]
        first = timing.layers.index(deepest_layer)
        return list(dict.fromkeys(timing.layers[:first]))

    def _require(self) -> tuple[TensorTiming, nn.Module]:
        if self.timing is None or self._model is None:
            raise EdgetrainError("ElasticSelector is not attached: call attach(model, optimizer, "
                                 "example_batch, loss_fn) first")
        return self.timing, self._model


def _samples(batch: Any) -> int | None:
    """The batch's size, or None when it has no tensor with a batch dimension."""
    try:
        return batch_size(batch)
    except InputError:
        return None
