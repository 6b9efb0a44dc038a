"""Cost model of paging: peak bytes, step seconds and joules of a keep/recompute/page schedule on a device.

This extends :func:`edgetrain.graph.simulate` (which costs ``page`` like ``keep``) with what paging
really does; with no paged stage both give the same peak and time. Everything is per micro-batch of
``m`` samples, stages ``0..n-1``; ``saved_t``, ``out_t``, ``in_t``, ``ws_t`` as in :mod:`edgetrain.graph`.

Memory. A ``page`` stage pages its *pack*: the tensors it saves for backward and, except for the last
stage, its output (the boundary to the next stage), so it adds nothing to the resident prefix ``P``
(the last stage adds its output, which the loss needs at once). Its local peak is that of ``keep``
(``P + saved_t + out_t + in_t + ws_t``: during its backward its tensors are back); the group after a
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
from ..graph import PAGE, RECOMPUTE, CostChain, _check_schedule, micro_batch_sizes, micro_batch_time, singleton_groups

__all__ = ["PagedScheduleCost", "simulate_paged", "stage_transfer_s", "pack_bytes", "PagingArrays",
           "paging_arrays"]


@dataclass(frozen=True)
class PagedScheduleCost:
    """What :func:`simulate_paged` predicts for one schedule.

    Attributes:
        peak_bytes: fixed bytes + activation peak (what the memory budget bounds).
        activation_peak_bytes: the activation peak, in-flight window included.
        inflight_bytes: the in-flight window ``W`` (largest pack of an asynchronous paged stage).
        step_time_s: seconds of one step, stalls included.
        energy_j: joules of one step.
        micro_batch_time_s: seconds of the first (largest) micro-batch.
        compute_time_s: seconds of computation per step (recomputation included, stalls not).
        recompute_time_s: seconds per step spent recomputing.
        transfer_time_s: seconds per step the storage spends paging (writes + reads, hidden or not).
        stall_time_s: the part of ``transfer_time_s`` not hidden behind computation.
        paged_bytes: bytes written out (and read back) per largest micro-batch.
        async_stages: the paged stages that page asynchronously (pack within the window).
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
    async_stages: tuple[int, ...] = ()
    per_stage_peak_bytes: tuple[int, ...] = field(default=())


def _ints(chain: CostChain, m: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    st = chain.stages
    if any(s.carried for s in st):
        raise ValueError("the paging model has no carried tensors (cuts inside residual blocks); capture "
                         "the model with carry_cuts=False for the paging planners, as prepare() does")
    out = [math.ceil(s.out_bytes.at(m)) for s in st]
    saved = [math.ceil(s.saved_bytes.at(m)) for s in st]
    ws = [math.ceil(s.workspace_bytes.at(m)) for s in st]
    inp = [math.ceil(chain.input_bytes.at(m))] + out[:-1]
    pack = [sv + (o if t + 1 < len(st) else 0) for t, (sv, o) in enumerate(zip(saved, out))]
    return out, saved, ws, inp, pack


def pack_bytes(chain: CostChain, m: int) -> list[int]:
    """Bytes paging each stage writes out at micro-batch ``m`` (saved tensors + output but for the last)."""
    return _ints(chain, m)[4]


def stage_transfer_s(chain: CostChain, device: DeviceProfile, mb: int, t: int) -> tuple[float, float, float, float]:
    """Write seconds, read seconds, asynchronous stall and synchronous stall of paging stage ``t``.

    Args:
        chain: the chain.
        device: the device.
        mb: the micro-batch size.
        t: the stage.

    Returns:
        ``(write_s, read_s, async_stall_s, sync_stall_s)`` per micro-batch of ``mb`` (module doc).
    """
    n = chain.n
    pack = math.ceil(chain.stages[t].saved_bytes.at(mb))
    if t + 1 < n:
        pack += math.ceil(chain.stages[t].out_bytes.at(mb))
    write, read = device.page_out_s(pack), device.page_in_s(pack)
    half_loss = chain.loss_s.at(mb) / 2
    if t == n - 1:
        stall = max(0.0, write + read - half_loss)
    else:
        fwd_next = chain.stages[t + 1].fwd_s.at(mb)
        read_window = chain.stages[t + 2].bwd_s.at(mb) if t + 2 < n else half_loss
        stall = max(0.0, write - fwd_next) + max(0.0, read - read_window)
    return write, read, stall, write + read


def simulate_paged(chain: CostChain, device: DeviceProfile, micro_batch_size: int, policies: Sequence[str],
                   groups: Sequence[int] | None = None, *, inflight_bytes: int | None = None) -> PagedScheduleCost:
    """Predicted peak bytes, step seconds and joules of a keep/recompute/page schedule (module doc).

    Args:
        chain: the profiled chain.
        device: the device the step runs on (paging speeds and powers).
        micro_batch_size: the largest micro-batch (the batch splits as
            :func:`edgetrain.graph.micro_batch_sizes` says).
        policies: ``keep``/``recompute``/``page`` per stage.
        groups: group ids as in :func:`edgetrain.graph.simulate` (``None``: every stage alone).
        inflight_bytes: the in-flight window: paged stages whose pack fits it page asynchronously,
            the others synchronously. ``None``: every paged stage is asynchronous.

    Returns:
        The predicted :class:`PagedScheduleCost`.

    Raises:
        ValueError: the schedule is malformed (as ``simulate``).
    """
    groups = singleton_groups(chain.n) if groups is None else groups
    spans = _check_schedule(chain, policies, groups)
    sizes = micro_batch_sizes(chain.batch_size, micro_batch_size)
    m, n = sizes[0], chain.n
    out, saved, ws, inp, pack = _ints(chain, m)
    paged = [t for t, p in enumerate(policies) if p == PAGE]
    limit = max((pack[t] for t in paged), default=0) if inflight_bytes is None else inflight_bytes
    asyncs = tuple(t for t in paged if pack[t] <= limit)
    window = max((pack[t] for t in asyncs), default=0)
    prefix, peak = inp[0], 0
    locals_: list[int] = []
    for i, j in spans:
        back = out[i - 1] if i > 0 and policies[i - 1] == PAGE else 0
        if policies[i] == RECOMPUTE:
            run = worst = 0
            for t in range(i, j + 1):
                run += saved[t] + out[t]
                worst = max(worst, run + inp[t] + ws[t])
            local = worst
            prefix_add = out[j]
        else:
            local = saved[i] + out[i] + inp[i] + ws[i]
            if policies[i] == PAGE:
                prefix_add = out[i] if i == n - 1 else 0
            else:
                prefix_add = saved[i] + out[i]
        peak = max(peak, prefix + back + local)
        prefix += prefix_add
        locals_.append(local)
    act = max(peak, prefix + out[-1]) + window
    compute = rec = xfer = stall = 0.0
    first_mb_s = 0.0
    for k, mb in enumerate(sizes):
        c, r = micro_batch_time(chain, mb, policies)
        x = s = 0.0
        for t in paged:
            w, rd, st_async, st_sync = stage_transfer_s(chain, device, mb, t)
            x += w + rd
            s += st_async if t in asyncs else st_sync
        compute, rec, xfer, stall = compute + c, rec + r, xfer + x, stall + s
        if k == 0:
            first_mb_s = c + s
    compute += chain.step_fixed_s
    energy = compute * device.active_power_w + xfer * device.memory_power_w
    return PagedScheduleCost(
        peak_bytes=int(chain.fixed_bytes + act), activation_peak_bytes=int(act), inflight_bytes=int(window),
        step_time_s=compute + stall, energy_j=energy, micro_batch_time_s=first_mb_s, compute_time_s=compute,
        recompute_time_s=rec, transfer_time_s=xfer, stall_time_s=stall,
        paged_bytes=int(sum(pack[t] for t in paged)), async_stages=asyncs, per_stage_peak_bytes=tuple(locals_))


@dataclass(frozen=True)
class PagingArrays:
    """The model of the module doc in array form at one micro-batch size, for the planners.

    Byte arrays are for the largest micro-batch ``m`` (they bound the peak); cost arrays are summed over
    every micro-batch of the step. From a boundary with prefix ``P`` whose previous stage was paged
    (``back = out`` of that stage, else 0): keeping stage ``t`` needs ``P + back + keep_local[t] + W <= A``
    and adds ``keep_add[t]``; paging it needs the same and adds ``page_add[t]``; recompute group ``t..j``
    needs ``P + back + seg_local[t, j] + W <= A`` and adds ``out[j]``; the loss needs
    ``P + out[-1] + W <= A``. An asynchronous page needs ``W >= pack[t]``.

    Attributes:
        m: micro-batch size.
        inp0: bytes of the stage-0 input (initial prefix).
        keep_local, keep_add, page_add, out, saved, pack: per-stage bytes (int64).
        seg_local: ``[t, j]`` local peak of recompute group ``t..j`` (huge where ``j < t``).
        f: per stage ``out + in + ws`` (the rest of a recompute group's local at that stage).
        base_time_s, base_energy_j: step seconds / joules with every stage kept.
        rec_time_s, rec_energy_j: per stage, what recomputing it adds per step.
        async_time_s, sync_time_s: per stage, the stall seconds per step of paging it (a)synchronously.
        page_energy_j: per stage, the joules per step of its transfers.
        page_ok: per stage, whether paging it lowers memory (its pack is not empty).
    """

    m: int
    inp0: int
    keep_local: np.ndarray
    keep_add: np.ndarray
    page_add: np.ndarray
    out: np.ndarray
    saved: np.ndarray
    pack: np.ndarray
    seg_local: np.ndarray
    f: np.ndarray
    base_time_s: float
    base_energy_j: float
    rec_time_s: np.ndarray
    rec_energy_j: np.ndarray
    async_time_s: np.ndarray
    sync_time_s: np.ndarray
    page_energy_j: np.ndarray
    page_ok: np.ndarray

    @property
    def n(self) -> int:
        return len(self.out)


_HUGE = np.int64(2**62)


def paging_arrays(chain: CostChain, device: DeviceProfile, m: int) -> PagingArrays:
    """Build :class:`PagingArrays` for micro-batch size ``m`` (``m`` is clamped to the batch size)."""
    sizes = micro_batch_sizes(chain.batch_size, m)
    m, n = sizes[0], chain.n
    out, saved, ws, inp, pack = (np.array(a, dtype=np.int64) for a in _ints(chain, m))
    keep_add = saved + out
    keep_local = saved + out + inp + ws
    page_add = np.zeros(n, dtype=np.int64)
    page_add[-1] = out[-1]
    f = inp + ws
    s_pref = np.concatenate([[0], np.cumsum(keep_add)]).astype(np.int64)
    tri = np.triu(np.ones((n, n), dtype=bool))
    run = np.where(tri, s_pref[None, 1:] - s_pref[:-1, None], 0)
    worst = np.maximum.accumulate(np.where(tri, run + f[None, :], np.iinfo(np.int64).min), axis=1)
    seg_local = np.where(tri, worst, _HUGE)
    keep = ["keep"] * n
    base = chain.step_fixed_s + sum(micro_batch_time(chain, mb, keep)[0] for mb in sizes)
    rec = np.array([sum(s.fwd_s.at(mb) for mb in sizes) for s in chain.stages], dtype=np.float64)
    st_a, st_s, xfer = np.zeros(n), np.zeros(n), np.zeros(n)
    for t in range(n):
        for mb in sizes:
            w, r, a, y = stage_transfer_s(chain, device, mb, t)
            st_a[t] += a
            st_s[t] += y
            xfer[t] += w + r
    for a in (out, saved, pack, keep_add, keep_local, page_add, seg_local, f):
        a.setflags(write=False)
    return PagingArrays(
        m=m, inp0=int(inp[0]), keep_local=keep_local, keep_add=keep_add, page_add=page_add, out=out,
        saved=saved, pack=pack, seg_local=seg_local, f=f, base_time_s=base,
        base_energy_j=base * device.active_power_w, rec_time_s=rec, rec_energy_j=rec * device.active_power_w,
        async_time_s=st_a, sync_time_s=st_s, page_energy_j=xfer * device.memory_power_w,
        page_ok=(keep_add - page_add) > 0)
