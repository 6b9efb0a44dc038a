"""Profile: measure a captured chain on this machine, and the process's resident memory.

:mod:`.stages` runs each stage at two micro-batch sizes and fits per-sample costs (time, bytes saved for
backward, workspace); :mod:`.blocks` does the same for module-tree chains in one whole-model run;
:mod:`.memory` reads resident memory (the budget's zero point, peaks) and tunes glibc; :mod:`.fork` runs
profiling, planning and loss checks in a forked child so that their memory never counts in the process.
"""

from __future__ import annotations

from .memory import measure_peak
from .stages import OptimizerCosts, StageSample, optimizer_costs, profile_chain

__all__ = ["profile_chain", "optimizer_costs", "measure_peak", "StageSample", "OptimizerCosts"]
