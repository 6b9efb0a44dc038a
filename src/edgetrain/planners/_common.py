"""Shared pieces of the keep/recompute planners: per-micro-batch sizes, exact feasibility, errors.

Everything here restates :mod:`edgetrain.graph`'s memory model in array form so the planners can search
it quickly; :func:`edgetrain.graph.simulate` stays the reference, and the planners' tests brute-force it.
For one micro-batch size ``m`` a schedule is a path through the *group boundaries* ``0..n``: from boundary
``t`` with resident prefix ``P`` a keep group ``t`` needs ``P + keep_local[t] <= A`` and moves to ``t+1``
with ``P + keep_add[t]``; a recompute group ``t..j`` needs ``P + seg_local[t, j] <= A`` and moves to
``j+1`` with ``P + seg_add[t, j]`` (its output plus the carried tensors made inside it); at ``n`` the
loss needs ``P + out[n-1] <= A``. ``A`` is the budget minus the
chain's fixed bytes. Per-op (selective) options add, per option ``k`` of the chain, a selective group
``t..j`` (every stage in it has option ``k``): ``P + sel_local[k, t, j] <= A``, then ``j+1`` with
``P + sel_add[k, t, j]``, at the cost of the stages' ``recompute_s`` for that option.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..graph import (
    KEEP, RECOMPUTE, CostChain, StageCost, candidate_micro_batch_sizes, micro_batch_sizes, micro_batch_time, simulate,
)

__all__ = [
    "NESTED", "TIME_RTOL", "Sizes", "Schedule", "candidate_micro_batches", "sizes_at", "recompute_costs",
    "keep_time_s", "schedule_from_groups", "min_prefix_path", "min_peak_schedule", "better",
    "hashable", "selective_costs", "selective_names", "without_selective",
]

#: Step times within this relative distance count as ties (then fewer recomputed stages win, then a
#: larger micro-batch), so that float summation order never decides a plan.
TIME_RTOL = 1e-9

# Larger than any byte count a chain can produce; marks impossible (stage, segment) pairs.
_BIG = np.int64(2**62)


@dataclass(frozen=True)
class Sizes:
    """Integer byte costs of one micro-batch of ``m`` samples, in the path form of the module doc.

    Attributes:
        m: micro-batch size.
        inp0: bytes of the stage-0 input (the initial resident prefix).
        keep_local: per stage, the local peak of keeping it (above the prefix).
        keep_add: per stage, what keeping it adds to the prefix (saved + output).
        out: per stage, output bytes.
        seg_add: ``[t, j]`` what recompute group ``t..j`` adds to the prefix (``_BIG`` where ``j < t``).
        seg_local: ``[t, j]`` local peak of recompute group ``t..j`` (``_BIG`` where ``j < t``).
        seg_worst: ``[t, j]`` the re-materialised part of ``seg_local`` (non-decreasing in ``j``; once
            it exceeds the budget every longer segment from ``t`` does too).
        nseg_local, nseg_worst: the same for the group run with two-level checkpointing (only its
            stages' outputs re-materialised at once; ``_BIG`` on and below the diagonal, where it equals
            the one-level group).
        sel_local, sel_add: ``[k, t, j]`` local peak and prefix growth of the selective group ``t..j`` run
            with option ``sel_names[k]`` (``_BIG`` where not allowed); shape ``(K, n, n)``, ``K >= 0``.
        sel_names: the chain's selective option names (every name some stage has).
    """

    m: int
    inp0: int
    keep_local: np.ndarray
    keep_add: np.ndarray
    out: np.ndarray
    seg_add: np.ndarray
    seg_local: np.ndarray
    seg_worst: np.ndarray
    nseg_local: np.ndarray | None = None
    nseg_worst: np.ndarray | None = None
    sel_local: np.ndarray | None = None
    sel_add: np.ndarray | None = None
    sel_names: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return len(self.out)

    def gcd(self) -> int:
        """Greatest common divisor of every size the constraints use (0 when all are zero)."""
        valid = self.seg_local[self.seg_local < _BIG]
        parts = [np.array([self.inp0], dtype=np.int64), self.keep_local, self.keep_add, self.out, valid,
                 self.seg_add[self.seg_add < _BIG]]
        if self.nseg_local is not None:
            parts.append(self.nseg_local[self.nseg_local < _BIG])
        if self.sel_local is not None:
            parts += [self.sel_local[self.sel_local < _BIG], self.sel_add[self.sel_add < _BIG]]
        return int(np.gcd.reduce(np.concatenate(parts)))


@dataclass(frozen=True)
class Schedule:
    """A keep/recompute schedule as the planners pass it around."""

    m: int
    policies: tuple[str, ...]
    groups: tuple[int, ...]
    nested_groups: tuple[int, ...] = ()

    @property
    def recomputed(self) -> int:
        return sum(p == RECOMPUTE for p in self.policies)


def candidate_micro_batches(chain: CostChain, micro_batch_sizes: Sequence[int] | None = None) -> list[int]:
    """Micro-batch sizes to search for ``chain``, largest first (see :func:`~edgetrain.graph.candidate_micro_batch_sizes`)."""
    return candidate_micro_batch_sizes(chain.batch_size, micro_batch_sizes)


def hashable(chain: CostChain) -> CostChain:
    """``chain`` with its stages as a tuple, so the per-(chain, m) caches below can key on it."""
    if isinstance(chain.stages, tuple):
        return chain
    return dataclasses.replace(chain, stages=tuple(chain.stages))


def _activations_key(chain: CostChain) -> CostChain:
    """``chain`` without what activation sizes do not depend on (fixed bytes, name), as a cache key.

    The planner re-plans one chain with many fixed-byte figures (one per micro-batch size validation
    measured); keyed on the whole chain, every figure filled the caches below again, and the memory
    they held grew the process by ~1 MiB per re-plan *after* the plan's validation run, which then
    under-measured the real steps (transformer at 40 MiB: 38.1 MiB validated, 40.8 MiB real).
    """
    chain = hashable(chain)
    if chain.fixed_bytes == 0 and chain.name == "":
        return chain
    return dataclasses.replace(chain, fixed_bytes=0, name="")


def sizes_at(chain: CostChain, m: int) -> Sizes:
    """The integer costs of :func:`edgetrain.graph.activation_profile` at micro-batch ``m`` (cached per
    stages and ``m``: the fixed bytes do not enter them)."""
    return _sizes_at(_activations_key(chain), m)


# Each entry holds eight n x n int64 matrices: 80 KB for a 41-stage chain, 640 KB for 100 stages.
@functools.lru_cache(maxsize=64)
def _sizes_at(chain: CostChain, m: int) -> Sizes:
    st = chain.stages
    out = np.array([math.ceil(s.out_bytes.at(m)) for s in st], dtype=np.int64)
    saved = np.array([math.ceil(s.saved_bytes.at(m)) for s in st], dtype=np.int64)
    carried = [s.carried_at(m) for s in st]
    # a carried tensor's gradient waits while the stages it crosses run backward
    ws = np.array([math.ceil(s.workspace_bytes.at(m)) + sum(b for _, b in c) for s, c in zip(st, carried)],
                  dtype=np.int64)
    inp0 = int(math.ceil(chain.input_bytes.at(m)))
    inp = np.concatenate([[inp0], out[:-1]]).astype(np.int64)
    keep_add = saved + out
    keep_local = saved + out + inp + ws
    # Recompute group t..j: worst over u in t..j of run(t..u) - out_u + out_u + in_u + ws_u, where
    # run(t..u) = S[u+1] - S[t]; so worst = cummax_u(S[u+1] + in_u + ws_u) - S[t].
    n = len(out)
    tri = np.triu(np.ones((n, n), dtype=bool))
    add = np.tile(out, (n, 1))
    for j, c in enumerate(carried):
        for p, b in c:  # made by stage p: retained by groups t..j that start at or before p
            add[: p + 1, j] += b
    seg_add = np.where(tri, add, _BIG)
    s_pref = np.concatenate([[0], np.cumsum(keep_add)]).astype(np.int64)
    f = s_pref[1:] + inp + ws
    fm = np.where(tri, f[None, :], np.iinfo(np.int64).min)
    worst = np.maximum.accumulate(fm, axis=1) - s_pref[:-1, None]
    seg_worst = np.where(tri, worst, _BIG)
    seg_local = np.where(tri, worst, _BIG)
    # Two-level group t..j: worst over u of sum(out_t..out_{u-1}) + saved_u + out_u + in_u + ws_u.
    o_pref = np.concatenate([[0], np.cumsum(out)]).astype(np.int64)
    fn = o_pref[:-1] + saved + out + inp + ws
    strict = np.triu(np.ones((n, n), dtype=bool), k=1)
    fnm = np.where(tri, fn[None, :], np.iinfo(np.int64).min)
    nworst = np.maximum.accumulate(fnm, axis=1) - o_pref[:-1, None]
    nseg_worst = np.where(strict, nworst, _BIG)
    nseg_local = np.where(strict, nworst, _BIG)
    names, sel_local, sel_add = _selective_sizes(st, m, out, seg_add, seg_local)
    for a in (out, keep_add, keep_local, seg_add, seg_local, seg_worst, nseg_local, nseg_worst, sel_local, sel_add):
        a.setflags(write=False)
    return Sizes(m, inp0, keep_local, keep_add, out, seg_add, seg_local, seg_worst, nseg_local, nseg_worst,
                 sel_local, sel_add, names)


def selective_names(stages: Sequence[StageCost]) -> tuple[str, ...]:
    """Every selective option name some stage has, in first-seen order."""
    return tuple(dict.fromkeys(o.name for s in stages for o in s.selective))


def _option_table(stages: Sequence[StageCost], name: str, value: Callable[[Any], float]) -> np.ndarray:
    """Per stage ``value(option)`` of option ``name`` (nan where the stage lacks it)."""
    out = np.full(len(stages), np.nan)
    for t, s in enumerate(stages):
        for o in s.selective:
            if o.name == name:
                out[t] = value(o)
    return out


def _selective_sizes(st: Sequence[StageCost], m: int, out: np.ndarray, seg_add: np.ndarray,
                     seg_local: np.ndarray) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """``sel_local``, ``sel_add`` of :class:`Sizes` (graph's memory model of a selective group)."""
    n = len(st)
    names = selective_names(st)
    sel_local = np.full((len(names), n, n), _BIG, dtype=np.int64)
    sel_add = np.full((len(names), n, n), _BIG, dtype=np.int64)
    mut = np.array([s.mutates_input for s in st] + [False], dtype=bool)
    tri = np.triu(np.ones((n, n), dtype=bool))
    for k, name in enumerate(names):
        kept = _option_table(st, name, lambda o: math.ceil(o.kept_bytes.at(m)))
        extra = _option_table(st, name, lambda o: math.ceil(o.extra_bytes.at(m)))
        keeps = _option_table(st, name, lambda o: float(o.keeps_output))
        has = ~np.isnan(kept)
        kept, extra = np.nan_to_num(kept).astype(np.int64), np.nan_to_num(extra).astype(np.int64)
        outk = np.where(np.nan_to_num(keeps) > 0, out, 0).astype(np.int64)
        k_pref = np.concatenate([[0], np.cumsum(kept)])
        e_pref = np.concatenate([[0], np.cumsum(extra)])
        o_pref = np.concatenate([[0], np.cumsum(outk)])
        missing = np.concatenate([[0], np.cumsum(~has)])
        # group t..j: every stage has the option, and no stage in t+1..j+1 writes its input in place
        muts = np.concatenate([[0], np.cumsum(mut[1:])])   # muts[u] = # mutating stages in 1..u
        t_idx, j_idx = np.arange(n)[:, None], np.arange(n)[None, :]
        ok = tri & (missing[j_idx + 1] - missing[t_idx] == 0) & (muts[j_idx + 1] - muts[t_idx] == 0)
        add = seg_add + (k_pref[j_idx + 1] - k_pref[t_idx]) + (o_pref[j_idx] - o_pref[t_idx])
        loc = seg_local + (e_pref[j_idx + 1] - e_pref[t_idx])
        sel_add[k] = np.where(ok, add, _BIG)
        sel_local[k] = np.where(ok, loc, _BIG)
    return names, sel_local, sel_add


def selective_costs(chain: CostChain, m: int) -> np.ndarray:
    """``[k, t]``: seconds per step that stage ``t`` adds run with the chain's ``k``-th selective option
    (:func:`selective_names`; ``inf`` where the stage lacks it)."""
    sizes = micro_batch_sizes(chain.batch_size, m)
    names = selective_names(chain.stages)
    out = np.full((len(names), chain.n), np.inf)
    for k, name in enumerate(names):
        out[k] = np.nan_to_num(_option_table(chain.stages, name, lambda o: sum(o.recompute_s.at(mb) for mb in sizes)),
                               nan=np.inf)
    return out


def without_selective(chain: CostChain) -> CostChain:
    """``chain`` with every stage's selective options removed (whole-stage policies only)."""
    if not any(s.selective for s in chain.stages):
        return chain
    return dataclasses.replace(chain, stages=tuple(dataclasses.replace(s, selective=()) for s in chain.stages))


def recompute_costs(chain: CostChain, m: int) -> np.ndarray:
    """Seconds per step that recomputing each stage adds (its forward, summed over the micro-batches)."""
    sizes = micro_batch_sizes(chain.batch_size, m)
    return np.array([sum(s.fwd_s.at(mb) for mb in sizes) for s in chain.stages], dtype=np.float64)


def keep_time_s(chain: CostChain, m: int) -> float:
    """Predicted step seconds with nothing recomputed: a lower bound for every schedule at ``m``."""
    keep = [KEEP] * chain.n
    return chain.step_fixed_s + sum(micro_batch_time(chain, mb, keep)[0]
                                    for mb in micro_batch_sizes(chain.batch_size, m))


NESTED = "nested"  # span kind only: a recompute group run with two-level checkpointing


def schedule_from_groups(m: int, n: int, spans: Sequence[tuple[int, int, str]]) -> Schedule:
    """Turn ``(first, last, policy)`` spans covering ``0..n-1`` in order into a :class:`Schedule`.

    A span of kind :data:`NESTED` becomes a recompute group listed in ``nested_groups``.
    """
    policies: list[str] = []
    groups: list[int] = []
    nested: list[int] = []
    for gid, (i, j, pol) in enumerate(spans):
        if pol == NESTED:
            nested.append(gid)
            pol = RECOMPUTE
        policies.extend([pol] * (j - i + 1))
        groups.extend([gid] * (j - i + 1))
    if len(policies) != n:
        raise AssertionError(f"spans cover {len(policies)} of {n} stages")
    return Schedule(m, tuple(policies), tuple(groups), tuple(nested))


def min_prefix_path(sz: Sizes, act_budget: int, allow_segments: bool = True) -> Schedule | None:
    """Exact feasibility of activation budget ``act_budget`` at ``sz.m``, with a witness schedule.

    Because every constraint is ``P + local <= A`` and ``P`` only grows, a smaller prefix at a group
    boundary is never worse for the rest of the chain; so the smallest reachable prefix at each
    boundary (a shortest path over boundaries, ``O(n^2)``) decides feasibility exactly. Selective groups
    never enter: each retains and holds at least what the plain recompute group over the same stages does,
    so they never reach a boundary with a smaller prefix (they only save time).

    Returns:
        The schedule reaching the last boundary with the smallest prefix, or ``None`` if none fits.
    """
    n = sz.n
    act_budget = min(int(act_budget), int(_BIG) - 1)   # keeps int64 sums from overflowing
    pmin = np.full(n + 1, _BIG, dtype=np.int64)
    pmin[0] = sz.inp0
    pred = np.full(n + 1, -1, dtype=np.int64)   # start boundary of the group ending at each boundary
    pkeep = np.zeros(n + 1, dtype=bool)
    pnest = np.zeros(n + 1, dtype=bool)
    for s in range(n):
        p = pmin[s]
        if p >= _BIG:
            continue
        if allow_segments:
            flat_ok = p + sz.seg_local[s, s:] <= act_budget
            ok = flat_ok
            if sz.nseg_local is not None:
                ok = flat_ok | (p + sz.nseg_local[s, s:] <= act_budget)
            cand = np.where(ok, p + sz.seg_add[s, s:], _BIG)
            better_ = cand < pmin[s + 1:]
            pmin[s + 1:] = np.where(better_, cand, pmin[s + 1:])
            pred[s + 1:][better_] = s
            pkeep[s + 1:][better_] = False
            pnest[s + 1:][better_] = ~flat_ok[better_]
        elif p + sz.seg_local[s, s] <= act_budget and p + sz.seg_add[s, s] < pmin[s + 1]:
            pmin[s + 1], pred[s + 1], pkeep[s + 1] = p + sz.seg_add[s, s], s, False
        # Keep wins ties against a recompute group ending at s (fewer recomputed stages).
        if p + sz.keep_local[s] <= act_budget and p + sz.keep_add[s] <= pmin[s + 1]:
            pmin[s + 1], pred[s + 1], pkeep[s + 1], pnest[s + 1] = p + sz.keep_add[s], s, True, False
    if pmin[n] + sz.out[-1] > act_budget:
        return None
    spans: list[tuple[int, int, str]] = []
    t = n
    while t > 0:
        s = int(pred[t])
        spans.append((s, t - 1, KEEP if pkeep[t] else NESTED if pnest[t] else RECOMPUTE))
        t = s
    return schedule_from_groups(sz.m, n, spans[::-1])


def min_peak_schedule(chain: CostChain, m: int, allow_segments: bool = True) -> tuple[int, Schedule]:
    """The smallest activation peak of any keep/recompute schedule at ``m``, and one that reaches it.

    Bisection over the integer budget with :func:`min_prefix_path` as the exact oracle; every feasible
    probe tightens the upper end to the witness's own peak. Cached per (stages, m).
    """
    return _min_peak_schedule(_activations_key(chain), m, allow_segments)


@functools.lru_cache(maxsize=512)
def _min_peak_schedule(chain: CostChain, m: int, allow_segments: bool) -> tuple[int, Schedule]:
    sz = sizes_at(chain, m)
    best = min_prefix_path(sz, int(_BIG) - 1, allow_segments)
    assert best is not None
    hi = simulate(chain, m, best.policies, best.groups, best.nested_groups).activation_peak_bytes
    lo = -1   # infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        sched = min_prefix_path(sz, mid, allow_segments)
        if sched is None:
            lo = mid
        else:
            best = sched
            hi = simulate(chain, m, sched.policies, sched.groups, sched.nested_groups).activation_peak_bytes
    return hi, best


def better(time_a: float, rec_a: int, m_a: int, time_b: float, rec_b: int, m_b: int) -> bool:
    """Whether plan a beats plan b: faster (beyond :data:`TIME_RTOL`), then fewer recomputed, then larger m."""
    tol = TIME_RTOL * max(abs(time_a), abs(time_b))
    if time_a < time_b - tol:
        return True
    if time_a > time_b + tol:
        return False
    return (rec_a, -m_a) < (rec_b, -m_b)
