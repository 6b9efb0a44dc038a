"""Energy of local training: predicted from the plan and a device profile, measured by RAPL where readable."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from ..graph import CostChain, simulate
from ..plan import Plan

__all__ = ["predicted_step_energy_j", "RaplMeter"]

log = logging.getLogger(__name__)


def predicted_step_energy_j(plan: Plan, costs: CostChain, profile_name: str | None) -> tuple[float, float]:
    """``(step seconds, step joules)`` of ``plan`` on a bundled device profile.

    Stage times come from FLOP counts at the profile's compute rate (``edgetrain.devices.scale_chain``) and
    energy is time x the profile's active power (POET's compute-energy model; nothing is paged here). Where
    no profile is named or a stage lacks a FLOP count, returns the host prediction and ``-1.0`` joules.
    """
    if profile_name:
        from ..devices import load_profile, scale_chain
        from ..errors import ProfileError

        try:
            prof = load_profile(profile_name)
            # stages without a FLOP count (pooling, activations) keep their host times: memory-bound and small
            with_flops = tuple(s for s in costs.stages if s.flops.fixed > 0 or s.flops.per_sample > 0)
            rates = {}
            if with_flops:  # a chain of blocks a FLOP counter could not see into has none (a CostChain needs one)
                counted = CostChain(with_flops, 1, costs.input_bytes, 0, costs.loss_s, costs.step_fixed_s)
                rates = {s.name: s for s in scale_chain(counted, None, prof).stages}
            chain = replace(costs, stages=tuple(rates.get(s.name, s) for s in costs.stages))
            t = simulate(chain, plan.micro_batch_size, plan.policies, plan.groups, plan.nested_groups).step_time_s
            return t, t * prof.active_power_w
        except ProfileError as e:
            log.info("no energy prediction on %s: %s", profile_name, e)
    return plan.step_time_s, -1.0


class RaplMeter:
    """Package energy from ``/sys/class/powercap`` (Intel RAPL), or ``-1.0`` where it cannot be read.

    RAPL counts the whole package: on a shared machine it includes other processes' work.
    """

    def __init__(self) -> None:
        self._files = []
        for d in sorted(Path("/sys/class/powercap").glob("intel-rapl:*")):
            if ":" in d.name[len("intel-rapl:"):]:
                continue  # sub-domains (core, dram) are inside the package counter
            f = d / "energy_uj"
            try:
                int(f.read_text())
                wrap = int((d / "max_energy_range_uj").read_text())
            except (OSError, ValueError):
                continue
            self._files.append((f, wrap))
        self._start = self._read()

    def _read(self) -> list[int]:
        return [int(f.read_text()) for f, _ in self._files]

    def joules(self) -> float:
        """Joules since construction (``-1.0`` when RAPL is not readable here)."""
        if not self._files:
            return -1.0
        total = 0
        for (f, wrap), a, b in zip(self._files, self._start, self._read()):
            total += b - a if b >= a else b + wrap - a
        return total * 1e-6
