"""BatchNorm running statistics that stay exact under recomputation and micro-batching.

Two problems, two mechanisms:

* Recomputation re-runs a stage's forward during backward; a training-mode BatchNorm would update its
  running statistics a second time (pytorch#96136). :class:`RecomputeGuard` is the context entered around
  every recomputation: it snapshots the running statistics of the BatchNorm layers inside the recomputed
  stages and restores them on exit, so each real forward updates them exactly once; the replay runs on
  their values from before the first forward (a layer may read them in training mode: quantization-aware
  ConvBn folds the running variance into its weight). Any other buffer the
  stages write in forward (a counter, a power-iteration vector) may also be *read* by them, so the replay
  must see it as the first forward did: the guard's :meth:`~RecomputeGuard.forward_context`, entered
  around that forward, keeps a copy of those buffers from before it; the replay runs on that copy and the
  buffers get their post-forward values back after it. A ``torch.Generator`` a module of the stages holds
  (a layer drawing from its own generator, which checkpointing's RNG replay does not cover) is replayed
  the same way: the replay draws from its state before the first forward. So are NumPy's and Python's
  global generators (Hugging Face's speech models draw their time masks from ``np.random``).
* Micro-batching normalises each micro-batch with its own statistics (unavoidable without a second pass),
  and would update running statistics once per micro-batch (pytorch#46516). :class:`FullBatchStats`
  accumulates, per channel, the count, mean and squared deviations of every BatchNorm input over the
  logical batch (the statistics the BatchNorm kernel computes, written to one scratch row per micro-batch,
  see :meth:`FullBatchStats._hook`; combined in float64 by Chan et al.'s formula, once per step or, past
  :attr:`FullBatchStats.ROWS` micro-batches, every that many), and at the end of the step sets the running
  statistics to exactly what one
  full-batch forward would have set: ``running = (1 - momentum) * running + momentum * stat`` with the
  unbiased full-batch variance, and ``num_batches_tracked`` advanced once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .._state import batchnorm_modules, host_rng_state, module_generators, put_back, set_host_rng_state

__all__ = ["RecomputeGuard", "FullBatchStats"]

_BN = nn.modules.batchnorm._BatchNorm


def _stats_of(mods: Iterable[nn.Module]) -> list[_BN]:
    out: list[_BN] = []
    seen: set[int] = set()
    for m in mods:
        for sub in m.modules():
            if isinstance(sub, _BN) and sub.track_running_stats and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
    return out


def _running(b: _BN) -> tuple[torch.Tensor | None, ...]:
    """Copies of a BatchNorm layer's running mean, running variance and batch count (None where it has none)."""
    return tuple(None if t is None else t.clone() for t in (b.running_mean, b.running_var, b.num_batches_tracked))


def _put_running(bns: list[_BN], values: list[tuple[torch.Tensor | None, ...]]) -> None:
    with torch.no_grad():
        for b, saved in zip(bns, values):
            for t, v in zip((b.running_mean, b.running_var, b.num_batches_tracked), saved):
                if t is not None and v is not None:
                    t.copy_(v)


class RecomputeGuard:
    """Context manager (one per recomputed group) that undoes running-statistics updates on exit.

    Args:
        modules: the modules the recomputed stages run (their BatchNorm layers are guarded).
        owner: the step's :class:`FullBatchStats`, told that a replay is running.
        buffers: other buffers the stages write in forward, replayed from their pre-forward values.
    """

    def __init__(self, modules: Iterable[nn.Module], owner: "FullBatchStats | None" = None,
                 buffers: Iterable[torch.Tensor] = ()) -> None:
        modules = list(modules)
        self.bns = _stats_of(modules)
        self.owner = owner
        self.buffers = list(buffers)
        self.generators = module_generators(*modules)
        self._saved: list[tuple[torch.Tensor | None, ...]] = []
        self._bn_before: list[tuple[torch.Tensor | None, ...]] = []
        self._before: list[torch.Tensor] | None = None
        self._after: list[torch.Tensor] = []
        self._gen_before: list[torch.Tensor] = []
        self._gen_after: list[torch.Tensor] = []
        self._host_before: tuple[Any, Any] | None = None
        self._host_after: tuple[Any, Any] | None = None

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Entered around the first forward: remembers the written buffers, the modules' generators and
        NumPy's and Python's generators as they were before it (any forward may draw from those two; a
        snapshot of both costs microseconds)."""
        self._before = [b.detach().clone() for b in self.buffers]
        self._bn_before = [_running(b) for b in self.bns]
        self._gen_before = [g.get_state() for g in self.generators]
        self._host_before = host_rng_state()
        yield

    def __enter__(self) -> "RecomputeGuard":
        if self._before is not None:
            with torch.no_grad():
                self._after = [b.detach().clone() for b in self.buffers]
                for b, v in zip(self.buffers, self._before):
                    put_back(b, v)
            self._gen_after = [g.get_state() for g in self.generators]
            for g, st in zip(self.generators, self._gen_before):
                g.set_state(st)
        if self._host_before is not None:
            self._host_after = host_rng_state()
            set_host_rng_state(self._host_before)
        if self.owner is not None:
            self.owner.recomputing += 1
        self._saved = [_running(b) for b in self.bns]
        # the replay reads the running statistics as the first forward did: a layer that reads them in training
        # mode (a quantization-aware ConvBn folds running_var into its weight) recomputed other activations
        _put_running(self.bns, self._bn_before)
        return self

    def __exit__(self, *exc: Any) -> None:
        _put_running(self.bns, self._saved)
        with torch.no_grad():
            for b, v in zip(self.buffers, self._after):
                put_back(b, v)
        for g, st in zip(self.generators, self._gen_after):
            g.set_state(st)
        if self._host_after is not None:
            set_host_rng_state(self._host_after)
        self._after, self._gen_after, self._host_after = [], [], None
        if self.owner is not None:
            self.owner.recomputing -= 1


class FullBatchStats:
    """Makes BatchNorm running statistics of a micro-batched step equal those of one full-batch forward."""

    #: its forward hooks keep no reference to a layer's output (the graph rewrite may then let a reader
    #: write over that output, :mod:`edgetrain.capture.rewrite`)
    keeps_outputs = False
    #: scratch rows a layer keeps: past them, the rows written are folded into float64 totals and reused (a row
    #: per micro-batch took MobileNetV2 at 64x64, micro-batches of one, 4.4 MiB beside plain PyTorch's 61.6 MiB)
    ROWS = 8

    def __init__(self, model: nn.Module) -> None:
        self.bns = [m for _, m in batchnorm_modules(model)]
        self.recomputing = 0
        self._active = False
        self._acc: dict[int, list[int]] = {}  # per layer: the sample count of each call this step
        self._slot: dict[int, list[int]] = {}  # per layer and call: which call of its micro-batch's forward it was
        self._calls: dict[int, int] = {}  # per layer: its calls in the current micro-batch's forward so far
        self._snap: dict[int, tuple[torch.Tensor | None, ...]] = {}
        # per layer: one (mean, variance) row per call in a step, [calls, 2, channels] in one tensor: 2 tensors of a
        # few channels per row each cost more in allocator and object overhead than their data (MobileNetV2, 16
        # micro-batches: 3.9 MiB resident as 1,664 tensors, 2.1 MiB of it data)
        self._scratch: dict[int, torch.Tensor] = {}
        self._views: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # per layer: its rows' (mean, variance) views
        # per layer and call slot: (count, mean, sum of squared deviations) of the rows folded so far this step
        self._folded: dict[int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._swapped: dict[int, tuple[Any, ...]] = {}
        self._micro_batches = 1  # in the step begun: how many rows a layer's first call allocates
        self._handles = [b.register_forward_pre_hook(self._hook) for b in self.bns]
        self._handles += [b.register_forward_hook(self._post_hook, always_call=True) for b in self.bns]

    @property
    def has_batchnorm(self) -> bool:
        return any(b.training for b in self.bns)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, mod: _BN, args: tuple[Any, ...]) -> None:
        """Before a micro-batch's BatchNorm forward: let the layer write its batch statistics to scratch.

        With ``momentum = 1`` a training-mode BatchNorm sets its running mean to the batch mean and its
        running variance to the unbiased batch variance, so pointing those buffers at scratch rows for
        one call gets the statistics the kernel computes anyway, for free (a separate ``var_mean`` over the
        input cost 20% of a micro-batched MobileNetV2 step). Each micro-batch writes its own row, kept
        across steps; :meth:`finish` combines the rows of a step at once.
        """
        if not self._active or self.recomputing or not mod.training:
            return
        buffers = mod._buffers  # direct: nn.Module's __getattr__ / __setattr__ cost more than the swap itself
        mean_buf, var_buf = buffers.get("running_mean"), buffers.get("running_var")
        if mean_buf is None or var_buf is None:
            return
        key = id(mod)
        rows = self._scratch.get(key)
        counts = self._acc.setdefault(key, [])
        k = len(counts)
        if rows is not None and k == rows.shape[0] >= self.ROWS:  # full: fold the rows into the totals, reuse them
            self._fold(key)
            counts, k = self._acc[key], 0
        elif rows is None or k == rows.shape[0]:  # the rows are kept: only a step's first run (or more micro-batches)
            # allocates them, all at once (grown a row at a time, the freed smaller tensors fragmented the heap: 1.3
            # MiB for MobileNetV2's 16 micro-batches); a layer called more than once per forward grows again
            size = min(self.ROWS, self._micro_batches if k < self._micro_batches else k + self._micro_batches)
            new = torch.empty((size, 2, *mean_buf.shape), dtype=mean_buf.dtype, device=mean_buf.device)
            new[:, 0] = 0  # momentum 1 multiplies the old value by 0: never leave NaN there
            new[:, 1] = 1
            if rows is not None:
                new[:k] = rows
            rows = self._scratch[key] = new
            self._views[key] = [r.unbind() for r in new]  # (mean, variance) views of each row, made once
        counts.append(args[0].numel() // args[0].shape[1])
        # a layer called twice per forward (shared) updates its statistics twice in plain PyTorch: each call
        # of a micro-batch is combined with the same call of the other micro-batches, in call order
        j = self._calls.get(key, 0)
        self._calls[key] = j + 1
        self._slot.setdefault(key, []).append(j)
        self._swapped[key] = (mean_buf, var_buf, mod.momentum)
        buffers["running_mean"], buffers["running_var"] = self._views[key][k]
        _set_momentum(mod, 1.0)

    def _post_hook(self, mod: _BN, args: tuple[Any, ...], output: Any) -> None:
        swapped = self._swapped.pop(id(mod), None)
        if swapped is None:
            return
        buffers = mod._buffers
        buffers["running_mean"], buffers["running_var"] = swapped[:2]
        _set_momentum(mod, swapped[2])

    def _combined(self, mod: _BN) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per call of the layer in one forward (one for a layer that is not shared), in call order:
        (count, mean, sum of squared deviations) over the step's micro-batches, in float64. Folds the rows
        written since the last fold (the step ends after this)."""
        self._fold(id(mod))
        totals = self._folded[id(mod)]
        return [totals[j] for j in sorted(totals)]

    def _rows_combined(self, key: int) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        """Per call slot, the statistics of the layer's rows written since the last fold.

        Chan et al.'s combination of per-group statistics, for all groups at once:
        ``mean = sum(n_k mean_k) / N``, ``M2 = sum((n_k - 1) var_k) + sum(n_k (mean_k - mean)^2)``.
        """
        counts = self._acc.get(key)
        if not counts:
            return {}
        rows = self._scratch[key][:len(counts)].to(torch.float64)
        slots = self._slot[key]
        out = {}
        for j in sorted(set(slots)):
            mine = [k for k, s in enumerate(slots) if s == j]
            picked = rows if len(mine) == len(slots) else rows[mine]  # a layer called once per forward: all rows
            means, variances = picked[:, 0], picked[:, 1]  # the kernel stores unbiased variances
            n_k = torch.tensor([counts[k] for k in mine], dtype=torch.float64).unsqueeze(1)
            total = sum(counts[k] for k in mine)
            mean = (n_k * means).sum(0) / total
            m2 = ((n_k - 1).clamp_min(0) * variances).sum(0) + (n_k * (means - mean) ** 2).sum(0)
            out[j] = (total, mean, m2)
        return out

    def _fold(self, key: int) -> None:
        """Fold the layer's rows written so far into its totals and free them for the next micro-batches."""
        totals = self._folded.setdefault(key, {})
        with torch.no_grad():
            for j, part in self._rows_combined(key).items():
                totals[j] = _merge(totals[j], part) if j in totals else part
        self._acc[key], self._slot[key] = [], []

    def micro_batch(self) -> None:
        """Before each micro-batch's forward: count each layer's calls from the first again."""
        self._calls = {}

    def begin(self, accumulate: bool = True, micro_batches: int = 1) -> None:
        """Start a step: snapshot running statistics; ``accumulate`` for a micro-batched step of
        ``micro_batches`` micro-batches."""
        self._active = accumulate
        self._micro_batches = max(1, micro_batches)
        self._acc, self._slot, self._calls, self._folded = {}, {}, {}, {}
        self._snap = {id(b): (None if b.running_mean is None else b.running_mean.clone(),
                              None if b.running_var is None else b.running_var.clone(),
                              None if b.num_batches_tracked is None else b.num_batches_tracked.clone())
                      for b in self.bns if b.training}

    def begin_step(self, batch: int, micro_batch_size: int) -> None:
        """:meth:`begin` for a step of ``batch`` samples in micro-batches of ``micro_batch_size``, as the step
        and the planner's validation runs both start one."""
        from ..graph import run_micro_batch_sizes

        self.begin(micro_batch_size < batch and self.has_batchnorm,
                   len(run_micro_batch_sizes(batch, micro_batch_size)))

    def abort(self) -> None:
        """Put the running statistics back as they were at :meth:`begin`."""
        for b in self.bns:  # a forward that raised inside a BatchNorm: give the layer its buffers back
            swapped = self._swapped.pop(id(b), None)
            if swapped is not None:
                b._buffers["running_mean"], b._buffers["running_var"] = swapped[:2]
                _set_momentum(b, swapped[2])
        self._restore()
        self._active = False
        self._acc, self._slot, self._calls, self._folded = {}, {}, {}, {}

    def _restore(self) -> None:
        with torch.no_grad():
            for b in self.bns:
                snap = self._snap.get(id(b))
                if snap is None:
                    continue
                for buf, val in zip((b.running_mean, b.running_var, b.num_batches_tracked), snap):
                    if buf is not None and val is not None:
                        buf.copy_(val)

    def finish(self) -> None:
        """End the step; if micro-batched, replace the per-micro-batch updates by one full-batch update."""
        if not self._active:
            self._snap = {}
            return
        self._restore()
        with torch.no_grad():
            for b in self.bns:
                if id(b) not in self._snap:
                    continue
                for n, mean, m2 in self._combined(b):
                    var = m2 / max(n - 1, 1)  # unbiased, as BatchNorm stores it
                    if b.num_batches_tracked is not None:
                        b.num_batches_tracked.add_(1)
                    momentum = b.momentum
                    if momentum is None:  # cumulative moving average
                        momentum = 1.0 / float(b.num_batches_tracked.item())
                    if b.running_mean is not None:
                        b.running_mean.mul_(1 - momentum).add_(mean.to(b.running_mean.dtype), alpha=momentum)
                    if b.running_var is not None:
                        b.running_var.mul_(1 - momentum).add_(var.to(b.running_var.dtype), alpha=momentum)
        self._active = False
        self._acc, self._slot, self._calls, self._folded = {}, {}, {}, {}


def _merge(a: tuple[int, torch.Tensor, torch.Tensor],
           b: tuple[int, torch.Tensor, torch.Tensor]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Chan et al.'s combination of two groups' (count, mean, sum of squared deviations)."""
    (na, ma, m2a), (nb, mb, m2b) = a, b
    n = na + nb
    d = mb - ma
    return n, ma + d * (nb / n), m2a + m2b + d * d * (na * nb / n)


def _set_momentum(mod: _BN, value: Any) -> None:
    """``mod.momentum = value``, into the instance's ``__dict__`` where it lives there (nn.Module.__setattr__ ends
    there too for a plain value, after checks that cost more than the swap: 20 ms of a MobileNetV2 step of 32
    micro-batches); through ``setattr`` where a subclass makes it a property or leaves it on the class."""
    attrs = mod.__dict__
    if "momentum" in attrs and not hasattr(getattr(type(mod), "momentum", None), "__set__"):
        attrs["momentum"] = value
    else:
        mod.momentum = value
