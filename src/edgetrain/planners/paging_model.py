"""Cost model of paging: peak bytes, step seconds and joules of a keep/recompute/page schedule on a device.

This extends :func:`edgetrain.graph.simulate` (which costs ``page`` like ``keep``) with what paging
really does; with no paged stage both give the same peak and time. Everything is per micro-batch of
``m`` samples, stages ``0..n-1``; ``saved_t``, ``out_t``, ``in_t``, ``ws_t`` as in :mod:`edgetrain.graph`.

Memory. A ``page`` stage pages its *pack*: the tensors it saves for backward and, except for the last
stage, its output (the boundary to the next stage), so it adds nothing to the resident prefix ``P``
(the last stage adds its output, which the loss needs at once). Its local peak is that of ``keep``
(``P + saved_t + 2 out_t + in_t + ws_t``: during its backward its tensors are back); the group after a
paged stage ``t`` needs ``out_t`` back during its backward (its input), so every local peak of that group
carries ``+ out_t``.

A paged stage is *asynchronous* when its pack fits the in-flight window ``W`` (a plan parameter):
the pack is written on a background thread behind the next stage's forward (a later paged stage's
forward ends only once earlier writes have finished) and prefetched ahead of the backward that needs
it, so the pager holds at most ``W`` bytes besides the running stage. Otherwise it is *synchronous*:
written before its forward returns and read on demand when backward unpacks it (no bytes in flight).
Every local peak, and the loss, carries the window::

    activation_peak = max(every group's P + local (+ out of a paged stage before it), P_final + out_{n-1}) + W
    W = max(pack_t over asynchronous paged t)

``W`` is an upper bound of the bytes in flight at any moment; ``W = 0`` (all synchronous) gives the
smallest peak.

Time. Transfers run on one background thread; ``write_t = page_out_latency + pack_t /
page_out_throughput`` and ``read_t = page_in_latency + pack_t / page_in_throughput``. An asynchronous
write overlaps the next stage's forward; its read is issued when the backward of stage ``t+2`` starts
and must finish before stage ``t+1``'s backward (which needs the boundary); for the last two stages the
loss is the window (half each). What does not fit is a stall::

    stall_t = max(0, write_t - fwd_{t+1}) + max(0, read_t - bwd_{t+2})     (t < n-2)
    stall_t = max(0, write_t - fwd_{t+1}) + max(0, read_t - loss / 2)      (t = n-2)
    stall_t = max(0, write_t + read_t - loss / 2)                          (t = n-1)
    stall_t = write_t + read_t                                             (synchronous)

A micro-batch costs its compute (forward + backward + recomputed forwards + loss, as ``simulate``) plus
the stalls; a step sums its micro-batches and adds the optimizer seconds.

Energy (POET): ``compute seconds x active_power_w + sum_t paged (write_t + read_t) x memory_power_w``;
recomputation is compute, so it is charged at active power; the optimizer update too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..devices import DeviceProfile
from ..graph import (PAGE, RECOMPUTE, CostChain, _check_schedule, micro_batch_sizes, micro_batch_time,
                     singleton_groups)

__all__ = ["PagedScheduleCost", "simulate_paged", "stage_transfer_s", "PagingArrays", "paging_arrays"]


@dataclass(frozen=True)
class PagedScheduleCost:
    """What :func:`simulate_paged` predicts for one schedule.

    Attributes:
        peak_bytes: fixed bytes + activation peak (what the memory budget bounds).
        activation_peak_bytes: the activation peak, in-flight window included.
        inflight_bytes: the in-flight window ``W`` (largest saved bytes of a paged stage).
        step_time_s: seconds of one step, stalls included.
        energy_j: joules of one step.
        micro_batch_time_s: seconds of the first (largest) micro-batch.
        compute_time_s: seconds of computation per step (recomputation included, stalls not).
        recompute_time_s: seconds per step spent recomputing.
        transfer_time_s: seconds per step the storage spends paging (writes + reads, hidden or not).
        stall_time_s: the part of ``transfer_time_s`` not hidden behind computation.
        paged_bytes: bytes written out (and read back) per largest micro-batch.
        per_stage_peak_bytes: local peak of each group (above the prefix), as ``simulate`` reports.
    """

    peak_bytes: int
    activation_peak_bytes: int
    inflight_bytes: int
    step_time_s: float
    energy_j: float
    micro_batch_time_s: float
    compute_time_s: float
    recompute_time_s: float
    transfer_time_s: float
    stall_time_s: float
    paged_bytes: int
    per_stage_peak_bytes: tuple[int, ...] = field(default=())


def _ints(chain: CostChain, m: int) -> tuple[list[int], list[int], list[int], list[int]]:
    st = chain.stages
    out = [math.ceil(s.out_bytes.at(m)) for s in st]
    saved = [math.ceil(s.saved_bytes.at(m)) for s in st]
    ws = [math.ceil(s.workspace_bytes.at(m)) for s in st]
    inp = [math.ceil(chain.input_bytes.at(m))] + out[:-1]
    return out, saved, ws, inp


def stage_transfer_s(chain: CostChain, device: DeviceProfile, mb: int, t: int) -> tuple[float, float, float]:
    """Write seconds, read seconds and stall seconds of paging stage ``t`` in a micro-batch of ``mb``."""
    saved = math.ceil(chain.stages[t].saved_bytes.at(mb))
    write = device.page_out_s(saved)
    read = device.page_in_s(saved)
    if t + 1 < chain.n:
        nxt = chain.stages[t + 1]
        stall = max(0.0, write - nxt.fwd_s.at(mb)) + max(0.0, read - nxt.bwd_s.at(mb))
    else:
        stall = max(0.0, write + read - chain.loss_s.at(mb))
    return write, read, stall


def simulate_paged(chain: CostChain, device: DeviceProfile, micro_batch_size: int, policies: Sequence[str],
                   groups: Sequence[int] | None = None) -> PagedScheduleCost:
    """Predicted peak bytes, step seconds and joules of a keep/recompute/page schedule (module doc).

    Args:
        chain: the profiled chain.
        device: the device the step runs on (paging speeds and powers).
        micro_batch_size: the largest micro-batch (the batch splits as
            :func:`edgetrain.graph.micro_batch_sizes` says).
        policies: ``keep``/``recompute``/``page`` per stage.
        groups: group ids as in :func:`edgetrain.graph.simulate` (``None``: every stage alone).

    Returns:
        The predicted :class:`PagedScheduleCost`.

    Raises:
        ValueError: the schedule is malformed (as ``simulate``).
    """
    groups = singleton_groups(chain.n) if groups is None else groups
    spans = _check_schedule(chain, policies, groups)
    sizes = micro_batch_sizes(chain.batch_size, micro_batch_size)
    m = sizes[0]
    out, saved, ws, inp = _ints(chain, m)
    prefix, peak, window = inp[0], 0, 0
    locals_: list[int] = []
    for i, j in spans:
        if policies[i] == RECOMPUTE:
            run = worst = 0
            for t in range(i, j + 1):
                run += saved[t] + out[t]
                worst = max(worst, run + out[t] + inp[t] + ws[t])
            local = out[j] + worst
            peak = max(peak, prefix + local)
            prefix += out[j]
        else:
            local = saved[i] + 2 * out[i] + inp[i] + ws[i]
            peak = max(peak, prefix + local)
            if policies[i] == PAGE:
                prefix += out[i]
                window = max(window, saved[i])
            else:
                prefix += saved[i] + out[i]
        locals_.append(local)
    act = max(peak, prefix + out[-1]) + window
    paged = [t for t, p in enumerate(policies) if p == PAGE]
    compute = rec = xfer = stall = 0.0
    first_mb_s = 0.0
    for k, mb in enumerate(sizes):
        c, r = micro_batch_time(chain, mb, policies)
        x = s = 0.0
        for t in paged:
            w, rd, st = stage_transfer_s(chain, device, mb, t)
            x += w + rd
            s += st
        compute, rec, xfer, stall = compute + c, rec + r, xfer + x, stall + s
        if k == 0:
            first_mb_s = c + s
    compute += chain.step_fixed_s
    energy = compute * device.active_power_w + xfer * device.memory_power_w
    return PagedScheduleCost(
        peak_bytes=int(chain.fixed_bytes + act), activation_peak_bytes=int(act), inflight_bytes=int(window),
        step_time_s=compute + stall, energy_j=energy, micro_batch_time_s=first_mb_s, compute_time_s=compute,
        recompute_time_s=rec, transfer_time_s=xfer, stall_time_s=stall,
        paged_bytes=int(sum(saved[t] for t in paged)), per_stage_peak_bytes=tuple(locals_))


@dataclass(frozen=True)
class PagingArrays:
    """The model of the module doc in array form at one micro-batch size, for the planners.

    Byte arrays are for the largest micro-batch ``m`` (they bound the peak); cost arrays are summed over
    every micro-batch of the step. Stage ``t`` kept adds ``keep_add[t]`` to the prefix, paged adds
    ``out[t]``; both need ``P + keep_local[t] + W <= A``; recompute group ``t..j`` needs
    ``P + seg_local[t, j] + W <= A`` and adds ``out[j]``; the loss needs ``P + out[-1] + W <= A``.

    Attributes:
        m: micro-batch size.
        inp0: bytes of the stage-0 input (initial prefix).
        keep_local, keep_add, out, saved: per-stage bytes (int64).
        seg_local: ``[t, j]`` local peak of recompute group ``t..j`` (huge where ``j < t``).
        seg_run: ``[t, u]`` bytes re-materialised by stages ``t..u`` of a group (``sum saved+out``).
        f: per stage ``out + in + ws`` (the rest of a recompute group's local at that stage).
        base_time_s, base_energy_j: step seconds / joules with every stage kept.
        rec_time_s, rec_energy_j: per stage, what recomputing it adds per step.
        page_time_s, page_energy_j: per stage, what paging it adds per step (stall seconds; transfer
            joules).
        page_ok: per stage, whether paging can lower memory (it saves bytes).
    """

    m: int
    inp0: int
    keep_local: np.ndarray
    keep_add: np.ndarray
    out: np.ndarray
    saved: np.ndarray
    seg_local: np.ndarray
    seg_run: np.ndarray
    f: np.ndarray
    base_time_s: float
    base_energy_j: float
    rec_time_s: np.ndarray
    rec_energy_j: np.ndarray
    page_time_s: np.ndarray
    page_energy_j: np.ndarray
    page_ok: np.ndarray

    @property
    def n(self) -> int:
        return len(self.out)


_HUGE = np.int64(2**62)


def paging_arrays(chain: CostChain, device: DeviceProfile, m: int) -> PagingArrays:
    """Build :class:`PagingArrays` for micro-batch size ``m`` (``m`` is clamped to the batch size)."""
    sizes = micro_batch_sizes(chain.batch_size, m)
    m = sizes[0]
    out_l, saved_l, ws_l, inp_l = _ints(chain, m)
    out, saved = np.array(out_l, dtype=np.int64), np.array(saved_l, dtype=np.int64)
    ws, inp = np.array(ws_l, dtype=np.int64), np.array(inp_l, dtype=np.int64)
    n = chain.n
    keep_add = saved + out
    keep_local = saved + 2 * out + inp + ws
    f = out + inp + ws
    s_pref = np.concatenate([[0], np.cumsum(keep_add)]).astype(np.int64)
    tri = np.triu(np.ones((n, n), dtype=bool))
    run = np.where(tri, s_pref[None, 1:] - s_pref[:-1, None], 0)
    worst = np.maximum.accumulate(np.where(tri, run + f[None, :], np.iinfo(np.int64).min), axis=1)
    seg_local = np.where(tri, worst + out[None, :], _HUGE)
    keep = ["keep"] * n
    base = chain.step_fixed_s + sum(micro_batch_time(chain, mb, keep)[0] for mb in sizes)
    rec = np.array([sum(s.fwd_s.at(mb) for mb in sizes) for s in chain.stages], dtype=np.float64)
    stall = np.zeros(n)
    xfer = np.zeros(n)
    for t in range(n):
        for mb in sizes:
            w, r, st = stage_transfer_s(chain, device, mb, t)
            stall[t] += st
            xfer[t] += w + r
    for a in (out, saved, keep_add, keep_local, seg_local, run, f):
        a.setflags(write=False)
    return PagingArrays(
        m=m, inp0=int(inp[0]), keep_local=keep_local, keep_add=keep_add, out=out, saved=saved,
        seg_local=seg_local, seg_run=run, f=f, base_time_s=base, base_energy_j=base * device.active_power_w,
        rec_time_s=rec, rec_energy_j=rec * device.active_power_w, page_time_s=stall,
        page_energy_j=xfer * device.memory_power_w, page_ok=saved > 0)
