"""Settings of elastic tensor selection (:class:`ElasticConfig`), validated when made."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InputError
from .importance import IMPORTANCE_KINDS

__all__ = ["ElasticConfig"]


@dataclass
class ElasticConfig:
    """Settings of elastic tensor selection.

    Attributes:
        speedup: requested step-time speed-up over full fine-tuning (>= 1; ``math.inf`` asks for the
            largest reachable one). Requests beyond reach are lowered to it with a warning.
        interval_steps: re-evaluate importance and re-select every this many steps.
        probe_batch_size: samples of the current batch used for the importance probe.
        importance: how the probe scores a tensor: ``"gradient"`` (the squared gradient norm, the loss
            decrease of a unit gradient-descent step) or ``"update"`` (the loss decrease of the step the
            optimizer itself would take, ElasticTrainer's); see :mod:`.importance`.
        time_units: resolution of the exact selection (``O(N * time_units)``); costs are rounded up, so
            at most one unit per selected tensor of the budget goes unused.
        timing_repeats: repetitions per isolated layer timing (medians).
        timing_cut_repeats: repetitions per whole-model timing.
        timing_max_cuts: layers at which the frozen model's backward is timed (calibration points).
        timing_max_suffixes: cuts at which the static suffix from that layer up is trained and timed on
            the real model and batch (where weight-gradient times come from; see :mod:`.timing`).
        timing_cache_path: optional JSON file caching measured timings across runs.
        calibration_pairs: back-to-back (full step, selected step) pairs per calibration round at
            attach time; 0 turns calibration off (the plan then rests on the timing model alone).
        calibration_rounds: at most this many measure-and-correct rounds at attach time.
        calibration_tolerance: stop correcting once the measured speed-up is within this fraction of
            the requested one; also the step-time resolution of the planner near the reachable limit
            (selections within it of the fastest count as fastest: see ``plan_for_speedup``'s slack).
        feedback_gain: closed-loop control from training steps: the fraction of the (log) error between
            the requested and the delivered speed-up that each re-selection corrects; 0 turns it off.
        feedback_max_change: one correction moves the planner's target by at most a factor
            ``1 + feedback_max_change`` either way.
        feedback_min_steps: a re-selection corrects only when at least this many steps of the selection
            in force were timed.
        feedback_check_tolerance: once a selection has run ``feedback_min_steps`` timed steps, its
            delivered speed-up is checked; off the wanted one by more than this fraction, the target is
            corrected by the whole ratio (within a factor 1.5) at once and the selection re-solved with
            the same importance (no probe), without waiting for the next re-selection.
        feedback_checks: at most this many such corrections per re-selection interval; 0 turns them off.
    """

    speedup: float = 2.0
    interval_steps: int = 100
    probe_batch_size: int = 32
    importance: str = "gradient"
    time_units: int = 10_000
    timing_repeats: int = 5
    timing_cut_repeats: int = 3
    timing_max_cuts: int = 24
    timing_max_suffixes: int = 8
    timing_cache_path: str | None = None
    calibration_pairs: int = 5
    calibration_rounds: int = 5
    calibration_tolerance: float = 0.05
    feedback_gain: float = 0.5
    feedback_max_change: float = 0.2
    feedback_min_steps: int = 5
    feedback_check_tolerance: float = 0.08
    feedback_checks: int = 3

    def __post_init__(self) -> None:
        if not self.speedup >= 1.0:
            raise InputError(f"speedup must be >= 1.0, got {self.speedup}")
        for name in ("interval_steps", "probe_batch_size", "time_units", "timing_repeats",
                     "timing_cut_repeats", "timing_max_cuts", "timing_max_suffixes", "calibration_rounds",
                     "feedback_min_steps"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.importance not in IMPORTANCE_KINDS:
            raise InputError(f"importance must be one of {', '.join(IMPORTANCE_KINDS)}, got {self.importance!r}")
        if self.calibration_pairs < 0:
            raise InputError(f"calibration_pairs must be >= 0 (0: off), got {self.calibration_pairs}")
        if not 0.0 < self.calibration_tolerance < 1.0:
            raise InputError(f"calibration_tolerance must be in (0, 1), got {self.calibration_tolerance}")
        if not 0.0 <= self.feedback_gain <= 1.0:
            raise InputError(f"feedback_gain must be in [0, 1] (0: off), got {self.feedback_gain}")
        if not self.feedback_max_change > 0.0:
            raise InputError(f"feedback_max_change must be > 0, got {self.feedback_max_change}")
        if not 0.0 < self.feedback_check_tolerance < 1.0:
            raise InputError(f"feedback_check_tolerance must be in (0, 1), got {self.feedback_check_tolerance}")
        if self.feedback_checks < 0:
            raise InputError(f"feedback_checks must be >= 0 (0: off), got {self.feedback_checks}")
