"""Cost chains the planner tests share."""

from __future__ import annotations

from edgetrain.graph import CostChain, Linear, StageCost

MIB = 2**20


def per_call_chain(fixed: int) -> CostChain:
    """Six stages of 4 MiB saved and 1 MiB out per sample, batch 8, with a per-call cost, so that splitting the
    batch costs time as it does on a CPU; ``fixed`` bytes held throughout."""
    stages = tuple(StageCost(f"s{i}", fwd_s=Linear(0.002, 0.01), bwd_s=Linear(0.004, 0.02),
                             saved_bytes=Linear(0, 4 * MIB), out_bytes=Linear(0, MIB)) for i in range(6))
    return CostChain(stages, 8, Linear(0, MIB), fixed)
