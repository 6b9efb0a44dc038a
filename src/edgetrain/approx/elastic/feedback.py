"""Closed-loop speed-up control for ElasticTrainer: correct the planner's target from real step times.

Framework-free (plain floats, no torch). The timing model that plans a selection is measured on isolated
pieces; calibration at attach time (``ElasticSelector.calibrate``) checks the *first* selection on real
steps, but later selections reach other depths, where the model can be off by a different amount. The
user's own training steps run every selection anyway, so their wall times measure, at no extra cost,
the speed-up actually delivered by the selection in force:

    delivered = full_step_s / median(step times since the last selection)

where ``full_step_s`` is the real full fine-tuning step measured at attach. At the next re-selection the
planner's target is corrected multiplicatively, in log space, by the fraction ``gain`` of the error and
by at most a factor ``1 + max_change`` either way (one noisy interval cannot swing it):

    new_target = target * clamp((wanted / delivered) ** gain, 1 / (1 + max_change), 1 + max_change)

clamped to ``[1, max_target]`` (``max_target`` is the model's reachable speed-up: aiming beyond it
changes nothing, and the clamp keeps the target from winding up while the request is out of reach). A
selection that ran faster than needed raises the budget (the next one goes deeper), a slower one lowers
it. With a steady model error the remaining error shrinks by the power ``gain`` per re-selection.

The medians are over steps of one selection only, so warm-up steps after a change (new optimizer state)
and rare slow steps (an evaluation, a load burst) do not count as long as they are a minority.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from ...errors import InputError

__all__ = ["Correction", "correct_target", "secant_target"]


@dataclass(frozen=True)
class Correction:
    """One closed-loop correction of the planner's target (or a measurement that changed nothing).

    Attributes:
        step: the training step at which it was made (None when unknown).
        steps_timed: how many step times the median is over.
        step_s: median real step time of the selection that was in force.
        full_step_s: the real full fine-tuning step time it is compared with.
        delivered_speedup: ``full_step_s / step_s``.
        wanted_speedup: the speed-up aimed at (the request, or the reachable one when lower).
        old_target: the planner's target before.
        new_target: the planner's target after.
    """

    step: int | None
    steps_timed: int
    step_s: float
    full_step_s: float
    delivered_speedup: float
    wanted_speedup: float
    old_target: float
    new_target: float


def correct_target(target: float, wanted: float, full_step_s: float, step_times_s: Sequence[float], *,
                   gain: float = 0.5, max_change: float = 0.2, min_steps: int = 5,
                   max_target: float = math.inf, step: int | None = None) -> Correction | None:
    """The planner's next target, from the real step times of the selection planned at ``target``.

    Args:
        target: the planner's current target speed-up (what its timing model was aimed at).
        wanted: the speed-up the real steps should deliver (finite, >= 1).
        full_step_s: real step time of full fine-tuning (seconds, > 0).
        step_times_s: real step times (seconds) of the selection in force.
        gain: fraction of the log error corrected (0 < gain <= 1).
        max_change: the target moves by at most a factor ``1 + max_change`` either way (> 0).
        min_steps: fewer step times than this give no correction.
        max_target: upper bound of the target (the timing model's reachable speed-up).
        step: the training step, for the record.

    Returns:
        The :class:`Correction` (``new_target`` is the target to plan with next), or None when there are
        fewer than ``min_steps`` usable (positive, finite) step times.

    Raises:
        InputError: a parameter is out of range.
    """
    if not (0.0 < gain <= 1.0 and max_change > 0.0 and min_steps >= 1):
        raise InputError(f"need 0 < gain <= 1, max_change > 0, min_steps >= 1; got {gain}, {max_change}, "
                         f"{min_steps}")
    if not (math.isfinite(wanted) and wanted >= 1.0 and full_step_s > 0.0 and target >= 1.0):
        raise InputError(f"need a finite wanted >= 1, full_step_s > 0 and target >= 1; got {wanted}, "
                         f"{full_step_s}, {target}")
    times = [float(t) for t in step_times_s if math.isfinite(t) and t > 0.0]
    if len(times) < min_steps:
        return None
    step_s = statistics.median(times)
    delivered = full_step_s / step_s
    factor = (wanted / delivered) ** gain
    factor = min(max(factor, 1.0 / (1.0 + max_change)), 1.0 + max_change)
    new = min(max(target * factor, 1.0), max(max_target, 1.0))
    return Correction(step, len(times), step_s, float(full_step_s), delivered, float(wanted), float(target),
                      new)


def secant_target(rounds: Sequence[tuple[float, float]], want: float) -> float:
    """The planner target to try next, from the calibration rounds so far: ``(target, measured)`` each.

    One round: scale the target by ``want / measured``. Two or more: the secant through the last two
    points in log space, when they differ and the slope is positive (a higher target, a faster step),
    kept within a factor 2 of the last target; otherwise the one-round rule."""
    t1, m1 = rounds[-1]
    ratio = t1 * want / m1
    if len(rounds) < 2:
        return ratio
    t0, m0 = rounds[-2]
    dlt, dlm = math.log(t1 / t0), math.log(m1 / m0)
    if dlt == 0.0 or abs(dlm) < 1e-9 or dlm / dlt <= 0.0:
        return ratio
    guess = t1 * math.exp((math.log(want) - math.log(m1)) * dlt / dlm)
    return min(max(guess, t1 / 2.0), t1 * 2.0)
