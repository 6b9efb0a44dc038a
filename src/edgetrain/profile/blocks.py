"""Profile a chain of module-tree blocks (``Chain.method == "modules"``) in one run of the whole model.

Blocks of a model fx cannot trace cannot run alone (their inputs come from the model's own forward), so
the model runs forward and backward as a whole at the micro-batch size, with hooks that attribute to the
block running at the time: forward seconds (pre- to post-forward hook), the storages ``saved_tensors_hooks``
packs, the output bytes, the resident-memory peak, and backward seconds (from the gradient reaching a block's
output to the gradient of its input). What runs outside the blocks is kept whole by the executor: the
tensors the code before the first block saves and hands to the blocks (embeddings, masks, position
tables) are resident through the micro-batch (``input_bytes``); what the code between and after blocks
saves is resident like the output of the block before it (added to that block's output bytes); its time
goes with the loss's.

A forward may skip blocks at random (LayerDrop: Hugging Face's speech models skip each encoder layer with
probability ``layerdrop`` in training). A run in which a block was not called says nothing about it, so the
model runs again, its random draws going on, until every block has been measured in some run; a plan must
hold for a step that calls every block.
"""

from __future__ import annotations

import time
import logging
from typing import Any, Callable

import torch

from ..batch import slice_batch, tensors_in
from ..capture.modules import BlockCalls, in_backward
from . import memory

__all__ = ["run_blocks"]

log = logging.getLogger(__name__)

#: runs after the first for a forward that skipped blocks (a block skipped with probability 0.5 goes
#: unmeasured with probability 2**-16)
RERUNS = 16


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(ts: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``ts``."""
    return sum({_key(t): t.untyped_storage().nbytes() for t in ts}.values())


def run_blocks(chain: Any, inputs_env: dict[str, Any], targets: Any, loss_fn: Callable[..., torch.Tensor], m: int,
               params: set[int], measure_memory: bool, sample_cls: Any) -> tuple[list[Any], float, int]:
    """One forward and backward of the whole model at micro-batch ``m``, measured per block (more where the
    forward skipped blocks: each block's sample comes from the first run that called it).

    Returns:
        Per block a ``sample_cls`` (:class:`edgetrain.profile.stages.StageSample`), the seconds outside the blocks
        (the loss included), and the bytes resident through the micro-batch (``input_bytes``).
    """
    samples, outside_s, resident, called = _run_once(chain, inputs_env, targets, loss_fn, m, params, measure_memory,
                                                     sample_cls)
    for _ in range(RERUNS):
        missing = [i for i in range(len(samples)) if i not in called]
        if not missing:
            break
        more, _, _, again = _run_once(chain, inputs_env, targets, loss_fn, m, params, measure_memory, sample_cls)
        for i in missing:
            if i in again:
                samples[i] = more[i]
                called.add(i)
    else:
        if len(called) < len(samples):
            log.warning("blocks %s were skipped in all %d profiling runs; their costs are unknown and counted as "
                        "zero", ", ".join(chain.stages[i].name for i in range(len(samples)) if i not in called),
                        RERUNS + 1)
    return samples, outside_s, resident


def _run_once(chain: Any, inputs_env: dict[str, Any], targets: Any, loss_fn: Callable[..., torch.Tensor], m: int,
              params: set[int], measure_memory: bool, sample_cls: Any) -> tuple[list[Any], float, int, set[int]]:
    """:func:`run_blocks`'s one run, and the blocks it called."""
    model = chain.model
    n = len(chain.stages)
    env = {k: slice_batch(v, 0, m) for k, v in inputs_env.items()}
    batch_keys = {_key(t) for t in tensors_in(env)} | set(params)
    region = [-1]  # -1: before the first block; i: inside block i; n + i: after block i
    saved: dict[int, dict[int, int]] = {}
    fwd = [0.0] * n
    t_in = [0.0] * n
    out_b = [0] * n
    in_b = [0] * n
    peak = [0] * n
    rss_at = [0] * n
    arg_keys: dict[int, int] = {}
    out_keys: set[int] = set()
    grad_out_t: list[float | None] = [None] * n
    grad_in_t: list[float | None] = [None] * n
    bwd_rss: list[int] = [0] * n
    bwd_peak: list[int] = [0] * n

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in batch_keys:
            saved.setdefault(region[0], {}).setdefault(k, t.untyped_storage().nbytes())
        return t

    called: set[int] = set()

    def pre(i: int):
        def hook(mod: Any, args: Any, kwargs: Any) -> None:
            called.add(i)
            region[0] = i
            ins = tensors_in(args) + tensors_in(kwargs)
            for t in ins:
                if _key(t) not in out_keys and _key(t) not in batch_keys:
                    arg_keys.setdefault(_key(t), t.untyped_storage().nbytes())
            first = next((t for t in ins if t.requires_grad), None)
            in_b[i] = first.numel() * first.element_size() if first is not None else 0
            if first is not None:
                first.register_hook(lambda g, i=i: _grad_in(i))
            if measure_memory:
                memory.reset_peak()
                rss_at[i] = memory.rss_bytes()
            t_in[i] = time.perf_counter()
        return hook

    def post(i: int):
        def hook(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
            fwd[i] = time.perf_counter() - t_in[i]
            if measure_memory:
                peak[i] = max(0, memory.peak_rss_bytes() - rss_at[i])
            outs = tensors_in(out)
            out_keys.update(_key(t) for t in outs)
            out_b[i] = _nbytes(outs)
            diff = next((t for t in outs if t.requires_grad), None)
            if diff is not None:
                diff.register_hook(lambda g, i=i: _grad_out(i))
            region[0] = n + i
        return hook

    def _grad_out(i: int) -> None:
        if grad_out_t[i] is None:
            if measure_memory:
                memory.reset_peak()
                bwd_rss[i] = memory.rss_bytes()
            grad_out_t[i] = time.perf_counter()

    def _grad_in(i: int) -> None:
        if grad_out_t[i] is None:  # a block that returned its input (a skipped layer): its gradient passed through
            _grad_out(i)
        if grad_in_t[i] is None:
            grad_in_t[i] = time.perf_counter()
            if measure_memory:
                bwd_peak[i] = max(0, memory.peak_rss_bytes() - bwd_rss[i])

    calls = BlockCalls(chain)
    current: dict[int, int] = {}

    def pre_any(mod: Any, args: Any, kwargs: Any) -> None:
        if in_backward():  # the model's own reentrant checkpoint: part of the backward being measured
            return
        current[id(mod)] = i = calls.stage(mod)
        pres[i](mod, args, kwargs)

    def post_any(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
        if in_backward():
            return
        posts[current.pop(id(mod))](mod, args, kwargs, out)

    pres, posts = [pre(i) for i in range(n)], [post(i) for i in range(n)]
    handles = []
    for b in calls.blocks:
        handles.append(b.register_forward_pre_hook(pre_any, with_kwargs=True))
        handles.append(b.register_forward_hook(post_any, with_kwargs=True))
    try:
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**{**env, **chain.call_kwargs})
            loss = loss_fn(out, slice_batch(targets, 0, m))
        if loss.requires_grad:
            loss.backward()
        t_end = time.perf_counter()
        del out, loss
    finally:
        for h in handles:
            h.remove()
    samples = []
    bwd = []
    for i in range(n):
        start = grad_out_t[i]
        stop = grad_in_t[i] if grad_in_t[i] is not None else t_end
        bwd.append(max(0.0, stop - start) if start is not None else 0.0)
    for i in range(n):
        own = sum(saved.get(i, {}).values())
        after = sum(saved.get(n + i, {}).values())  # code between this block and the next, or the head
        samples.append(sample_cls(fwd_s=fwd[i], bwd_s=bwd[i], saved_bytes=own, out_bytes=out_b[i] + after,
                                  in_grad_bytes=in_b[i], peak_bytes=max(peak[i], bwd_peak[i])))
    outside_s = max(0.0, (t_end - t0) - sum(fwd) - sum(bwd))
    resident = sum(saved.get(-1, {}).values()) + sum(arg_keys.values())
    return samples, outside_s, resident, called
