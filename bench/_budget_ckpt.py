"""bench_budget's ``checkpoint_sequential`` peer: which configuration runs at each budget, measured how often.

A configuration is a (micro-batch, segment count) pair, each measured once (a fresh process) and reused at every
budget. The peer at a budget is the fastest configuration whose measured peak fits, accumulating over micro-batches
only when nothing fits at the full batch; going down in micro-batch, the leanest segment count at the full batch is
tried first and the others only where it fits. It is held to what edgetrain is held to: a configuration that goes
over the budget in one of its repeats gives way to the next fastest that fits (:meth:`CheckpointPeer.hold`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from _budget_report import Entry, fits
from _budget_search import fastest_fitting, hopeless, micro_batch_candidates
from _common import mib

from edgetrain.measure import JobResult

Config = tuple[int, int]  # (micro-batch, segments)


class CheckpointPeer:
    """``checkpoint_sequential`` at one model's batch ``batch``, over the segment counts ``segments``.

    ``measure(micro_batch, segments, seed, label)`` runs one job (a fresh process) and returns what it measured.
    """

    def __init__(self, batch: int, segments: Sequence[int],
                 measure: Callable[[int, int, int, str], JobResult]) -> None:
        self.batch, self.segments, self._measure = batch, list(segments), measure
        self.runs: dict[Config, JobResult] = {}
        for seg in self.segments:
            self.run(batch, seg)
        full = [(r.peak_bytes, seg) for seg in self.segments if (r := self.runs[(batch, seg)]).ok]
        self.any_full = bool(full)
        self.lean_seg = min(full)[1] if full else self.segments[len(self.segments) // 2]

    def run(self, m: int, seg: int) -> JobResult:
        """The table run of a configuration (measured on first use)."""
        if (m, seg) not in self.runs:
            self.runs[(m, seg)] = self._measure(m, seg, 0, f"checkpoint_sequential seg={seg} mb={m}")
        return self.runs[(m, seg)]

    def config(self, k: Config) -> str:
        m, seg = k
        return f"seg={seg}" + (f", mb={m} x{math.ceil(self.batch / m)} accum" if m < self.batch else "")

    def choose(self, budget: int, excluded: frozenset[Config] = frozenset()) -> Config | None:
        """The fastest configuration that fits ``budget``, leaving out ``excluded`` (see the module docstring)."""
        def pool(m: int | None = None) -> dict[Config, JobResult]:
            return {k: v for k, v in self.runs.items() if k not in excluded and m in (None, k[0])}

        if self.any_full and fastest_fitting(pool(self.batch), budget) is None:
            for m in micro_batch_candidates(self.batch)[1:]:
                if fits(self.run(m, self.lean_seg), budget):
                    for seg in self.segments:
                        self.run(m, seg)
                    if fastest_fitting(pool(m), budget) is not None:
                        break
                    continue
                lean = [r.peak_bytes for (_, sg), r in sorted(self.runs.items(), reverse=True)
                        if sg == self.lean_seg and r.ok]
                if hopeless(lean, budget):
                    break
        return fastest_fitting(pool(), budget)

    def entry(self, budget: int) -> tuple[Entry, Config | None]:
        """The table's row at ``budget`` and the configuration in it (None: nothing fits)."""
        best = self.choose(budget)
        e = Entry("checkpoint_sequential", budget, self.batch)
        if best is None:
            low = min((r.peak_bytes for r in self.runs.values() if r.ok), default=None)
            failed = next((r for r in self.runs.values() if not r.ok), None)
            e.note = (f"nothing fits (lowest measured {mib(low)} MiB)" if low is not None else
                      f"failed: {failed.error_type if failed else '?'}")
        else:
            e.result, e.config = self.runs[best], self.config(best)
        return e, best

    def repeat(self, k: Config, i: int, why: str = "") -> JobResult:
        """Repeat ``i`` (0-based) of a configuration, for the interleaved comparison."""
        return self._measure(k[0], k[1], 101 + i, f"checkpoint_sequential seg={k[1]} mb={k[0]} (versus repeat "
                                                  f"{i + 1}{', after ' + why if why else ''})")

    def hold(self, e: Entry, best: Config, repeats: int) -> Config | None:
        """``e`` (``best`` measured ``repeats`` more times) held to the budget in every run: while a run of the
        configuration went over, the next fastest that fits takes its place, measured as many times, and
        ``e.note`` says which gave way. Returns the configuration in force (None: nothing else fits)."""
        excluded: set[Config] = set()
        dropped: list[str] = []
        while e.fits and e.over_budget:
            dropped.append(f"{e.config} over the budget in {e.over_budget} of {1 + len(e.repeats)} runs")
            excluded.add(best)
            nxt = self.choose(e.budget_bytes, frozenset(excluded))
            e.result, e.repeats, e.config = None, [], ""
            if nxt is None:
                break
            best = nxt
            e.result, e.config = self.runs[best], self.config(best)
            e.repeats = [self.repeat(best, i, dropped[-1]) for i in range(repeats)]
        if dropped:
            e.note = "; ".join(dropped + ([] if e.fits else ["nothing else fits"]))
        return best if e.fits else None
