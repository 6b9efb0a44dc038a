"""Capture: a model and an example batch become a chain of stages the profiler, planners and runtime share.

:func:`capture` traces with torch.fx (:mod:`.trace`, with the graph passes of :mod:`.rewrite` and the lean
ops of :mod:`.lean`) and falls back to the module tree (:mod:`.modules`); :mod:`.chain` holds the types.
"""

from .chain import OUTPUT_KEY, Chain, Stage, bind_inputs, managed_buffer
from .trace import capture

__all__ = ["capture", "Chain", "Stage", "OUTPUT_KEY", "bind_inputs", "managed_buffer"]
