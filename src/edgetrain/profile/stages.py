"""Measure every stage of a captured chain on this machine and fit per-sample costs (a CostChain).

Each stage runs in isolation, one at a time (its input detached, its output gradient all ones), so that
profiling itself needs only one stage's memory, never the whole model's. For two micro-batch sizes we
record forward and backward seconds, the bytes the stage saves for backward (unique storages seen by
``saved_tensors_hooks``, minus parameters, the stage input and the stage output), the output bytes, and
the resident-memory peak of the stage (``VmHWM`` reset before it), whose excess over the tensors we can
name is the stage's transient workspace, the allocator's slack included. Costs are fitted as
``fixed + per_sample * m`` (:class:`edgetrain.graph.Linear`).

Results are cached per model structure, input shape, sizes and machine, in memory and on disk under
``$EDGETRAIN_CACHE_DIR`` (default ``~/.cache/edgetrain``); ``EDGETRAIN_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Container

import torch
from torch import nn

from .. import settings
from .._state import autocast_state, backward_outside_autocast, preserved_model_state
from ..batch import batch_signature, slice_batch
from ..capture import OUTPUT_KEY, Chain
from ..capture.chain import grad_outputs, stage_inputs
from ..capture.lean_bn import available as lean_bn_available
from ..capture.lean_dropout import available as lean_dropout_available
from ..capture.lean import chunk_bytes, memory_format_of
from ..errors import ProfileError
from ..graph import CostChain, Linear, StageCost
from ..runtime import pool
from . import memory
from .blocks import run_blocks

__all__ = ["StageSample", "OptimizerCosts", "profile_chain", "optimizer_costs"]

log = logging.getLogger(__name__)
_MEMO: dict[str, dict[str, Any]] = {}


@dataclass
class StageSample:
    """One measurement of one stage at one micro-batch size."""

    fwd_s: float
    bwd_s: float
    saved_bytes: int
    out_bytes: int
    in_grad_bytes: int
    peak_bytes: int
    carried: tuple[tuple[int, int], ...] = ()  # (producer stage, bytes) crossing the cut after the stage

    @property
    def workspace_bytes(self) -> int:
        return max(0, self.peak_bytes - (self.saved_bytes + 2 * self.out_bytes + self.in_grad_bytes))

    @property
    def local_bytes(self) -> int:
        return max(self.peak_bytes, self.saved_bytes + 2 * self.out_bytes + self.in_grad_bytes)


def _tensor_bytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass(frozen=True)
class OptimizerCosts:
    """Memory an optimizer adds: state still to be allocated, and the transient peak of ``step()``."""

    state_bytes: int
    update_bytes: int
    state_per_param: float
    update_per_param: float


_PROBE_ELEMS = 1 << 18


def _constructor_options(cls: type, group: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of ``group`` that ``cls(params, **options)`` accepts (a param group can hold
    keys the constructor sets itself, e.g. AdamW's ``decoupled_weight_decay``)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = None  # unknown: pass every key
    if params is not None and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params = None
    return {k: v for k, v in group.items() if k != "params" and (params is None or k in params)}


def _probe_step(cls: type, group: dict[str, Any], n_probes: int) -> tuple[float, int]:
    """Step a fresh ``cls`` optimizer over ``n_probes`` probe tensors twice.

    Returns:
        State elements it keeps per parameter element, and the resident-memory peak of the second
        ``step()`` above what the process held before it (bytes).
    """
    probes = [torch.zeros(_PROBE_ELEMS, requires_grad=True) for _ in range(n_probes)]
    for p in probes:
        p.grad = torch.full((_PROBE_ELEMS,), 1e-3)
    opt = cls(probes, **group)
    opt.step()
    per_elem = sum(v.numel() for v in opt.state[probes[0]].values()
                   if isinstance(v, torch.Tensor) and v.numel() == _PROBE_ELEMS) / _PROBE_ELEMS
    memory.reset_peak()
    rss0 = memory.rss_bytes()
    opt.step()
    return per_elem, max(0, memory.peak_rss_bytes() - rss0)


def _probe_in_child(cls: type, group: dict[str, Any]) -> tuple[float, int, int]:
    """:func:`_probe_step` with one and with four probes, in a forked child where possible (the probes and
    their state are tens of MiB for Adam, which must not count against this process's budget)."""
    from . import fork as _fork

    def probe() -> tuple[float, int, int]:
        per_elem, one = _probe_step(cls, group, 1)
        return per_elem, one, _probe_step(cls, group, 4)[1]

    res = _fork.run_in_child(probe) if _fork.available() else None
    if res is not None and res.error is None and res.value is not None:
        return res.value
    return probe()


def optimizer_costs(optimizer: torch.optim.Optimizer) -> OptimizerCosts:
    """Learn the optimizer's memory from probes of the same class and hyper-parameters.

    A fresh optimizer steps a probe parameter of 256K elements twice: per parameter element we count the
    state tensors it keeps, and from the resident-memory peak of the second step the temporaries its
    update allocates, per element. Whether those temporaries are made for the whole model at once
    (foreach kernels, e.g. Adam's square roots of every parameter) or one parameter at a time (the
    for-loop implementations, PyTorch's default on CPU) is read from a second probe with four
    parameters: a peak growing with them (4x) means whole-model temporaries, scaled to every trainable
    byte; one that stays put means per-parameter ones, scaled to the largest parameter by the
    four-parameter peak (it holds what overlaps between consecutive parameters). Counting per-parameter
    temporaries for the whole model would overstate Adam's default step several times over and refuse
    budgets plain PyTorch trains in.
    Falls back to Adam-like numbers (2 state tensors, 2 whole-model temporaries) for an optimizer that
    cannot be replayed on a probe.
    """
    group = _constructor_options(type(optimizer), optimizer.param_groups[0])
    probe_bytes = _PROBE_ELEMS * 4
    try:
        per_elem, one, four = _probe_in_child(type(optimizer), group)
        whole_model = four > 2.5 * one
        # page-granular reading: round up to a quarter of a tensor
        transient = math.ceil((one if whole_model else max(one, four)) / probe_bytes * 4) / 4
        if not memory.can_reset_peak():
            transient, whole_model = 2.0, True
    except Exception as e:  # an optimizer we cannot replay: assume Adam-like state
        log.info("could not probe %s (%s); assuming Adam-like memory", type(optimizer).__name__, e)
        per_elem, transient, whole_model = 2.0, 2.0, True
    state = total = largest = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            if not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            total += nbytes
            largest = max(largest, nbytes)
            if not optimizer.state.get(p):
                state += int(per_elem * nbytes)
    update = int(math.ceil(transient * (total if whole_model else largest)))
    return OptimizerCosts(state_bytes=state, update_bytes=update, state_per_param=per_elem,
                          update_per_param=transient)


def _run_stage(stage: Any, env: dict[str, Any], live: Container[str], params: set[int],
               measure_memory: bool = True) -> tuple[StageSample, dict[str, Any], set[str]]:
    """Forward and backward one stage in isolation; returns its sample, its detached outputs and the names
    of those that carry a gradient (``live``: the earlier stages' such outputs, :func:`stage_inputs`).

    ``measure_memory`` False: times only (no peak reset, which empties the tensor pool: a run that
    keeps it warm times the stage as a training step runs it, without fresh pages to fault in).
    """
    args, grad_inputs = stage_inputs(stage, env, live)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
        return t

    if measure_memory:
        memory.reset_peak()
    rss0 = memory.rss_bytes() if measure_memory else 0
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = stage(*args)
    t1 = time.perf_counter()
    exclude = set(params) | {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
    out_tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    exclude |= {_storage_key(o) for o in out_tensors}
    saved = sum(b for k, b in seen.items() if k not in exclude)
    out_bytes = sum(_tensor_bytes(o) for o in out_tensors)
    diff = [o for o in out_tensors if o.requires_grad]
    bwd = 0.0
    if diff:
        grads = [torch.ones_like(o) for o in diff]
        t2 = time.perf_counter()
        with backward_outside_autocast():  # as the step runs it
            torch.autograd.backward(diff, grads)
        bwd = time.perf_counter() - t2
        del grads
    peak = max(0, memory.peak_rss_bytes() - rss0) if measure_memory else 0
    sample = StageSample(fwd_s=t1 - t0, bwd_s=bwd, saved_bytes=saved, out_bytes=out_bytes,
                         in_grad_bytes=sum(_tensor_bytes(g) for g in grad_inputs), peak_bytes=peak)
    detached = {k: (o.detach() if isinstance(o, torch.Tensor) else o) for k, o in zip(stage.outputs, outs)}
    return sample, detached, grad_outputs(stage, outs)


def _carried(env: dict[str, Any], producer: dict[str, int], stage: Any) -> tuple[tuple[int, int], ...]:
    """Tensors made by earlier stages that cross the cut after ``stage``, bytes summed per producer."""
    per: dict[int, int] = {}
    for k, v in env.items():
        if k in producer and k not in stage.outputs and k != OUTPUT_KEY and isinstance(v, torch.Tensor):
            per[producer[k]] = per.get(producer[k], 0) + _tensor_bytes(v)
    return tuple(sorted(per.items()))


def _count_flops(chain: Chain, inputs_env: dict[str, Any], m: int) -> list[float]:
    """Forward FLOPs of every stage at micro-batch ``m`` (torch's FlopCounterMode; 0 where it counts none)."""
    from torch.utils.flop_counter import FlopCounterMode

    env = {k: slice_batch(v, 0, m) for k, v in inputs_env.items()}
    flops = []
    with torch.no_grad():
        for st in chain.stages:
            counter = FlopCounterMode(display=False)
            with counter:
                outs = st(*(env[k] for k in st.inputs))
            flops.append(float(counter.get_total_flops()))
            env.update(zip(st.outputs, outs))
            chain.release(env, st.index)
    return flops


def _run_chain(chain: Chain, inputs_env: dict[str, Any], targets: Any, loss_fn: Callable[..., torch.Tensor],
               m: int, params: set[int], measure_memory: bool = True) -> tuple[list[StageSample], float, int]:
    """Per-stage samples, the loss's seconds (with a block chain's code outside the blocks), and the bytes
    resident through the micro-batch before the first stage (a block chain's embeddings, masks; else 0)."""
    if chain.method == "modules":
        return run_blocks(chain, inputs_env, targets, loss_fn, m, params, measure_memory, StageSample)
    env = {k: slice_batch(v, 0, m) for k, v in inputs_env.items()}
    producer: dict[str, int] = {}
    live: set[str] = set()
    samples = []
    for st in chain.stages:
        s, outs, with_grad = _run_stage(st, env, live, params, measure_memory)
        live |= with_grad
        env.update(outs)
        producer.update(dict.fromkeys(outs, st.index))
        chain.release(env, st.index)
        s.carried = _carried(env, producer, st)
        samples.append(s)
    out = env[OUTPUT_KEY]
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        out = out.detach().requires_grad_(True)
    t0 = time.perf_counter()
    loss = loss_fn(out, slice_batch(targets, 0, m))
    if loss.requires_grad:
        with backward_outside_autocast():
            loss.backward()
    return samples, time.perf_counter() - t0, 0


def _with_selective(chain: Chain, inputs_env: dict[str, Any], lo: int, hi: int, params: set[int],
                    stages: list[StageCost], s_lo: list[StageSample], s_hi: list[StageSample]) -> list[StageCost]:
    """``stages`` with their per-op (selective) recompute options (:mod:`edgetrain.profile.ops`); best
    effort: a chain whose options cannot be measured keeps whole-stage policies only."""
    from .ops import selective_stages

    try:
        return selective_stages(chain, inputs_env, lo, hi, params, stages,
                                [s.fwd_s for s in s_lo], [s.fwd_s for s in s_hi])
    except Exception as e:
        log.info("selective recompute options not measured (%s: %s); whole-stage policies only",
                 type(e).__name__, e)
        return stages


def _cache_key(chain: Chain, model: nn.Module, inputs_env: dict[str, Any], sizes: tuple[int, ...],
               selective: bool = True) -> str:
    h = hashlib.sha256()
    # the version moves when a graph pass changes what a stage costs (v10: rows of one tensor unbound)
    parts = ["v10" if selective else "v7", chain.method, type(model).__qualname__, torch.__version__, platform.node(),
             platform.machine(), str(torch.get_num_threads()), str(sizes), str(batch_signature(inputs_env)),
             str(memory.allocator_tuned()), "pool" if pool.installed() else "no-pool",
             f"huge:{pool.huge_pages()}", f"conv-chunk:{chunk_bytes()}",  # each changes measured costs
             f"lean-bn:{settings.lean_batchnorm_enabled() and lean_bn_available()}",
             f"lean-dropout:{lean_dropout_available()}", f"autocast:{autocast_state()}"]
    # layouts too: a channels-last model or batch runs other kernels (and no lean BatchNorm) on the same shapes
    parts += [f"layout:{k}:{memory_format_of(v)}" for k, v in inputs_env.items() if isinstance(v, torch.Tensor)]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}:{memory_format_of(p)}"
              for n, p in model.named_parameters()]
    parts += [f"{s.name}|{s.inputs}|{s.outputs}" for s in chain.stages]
    for p in parts:
        h.update(p.encode())
    return h.hexdigest()[:32]


def _load_cached(key: str) -> dict[str, Any] | None:
    if not settings.cache_enabled():
        return None
    if key in _MEMO:
        return _MEMO[key]
    path = settings.cache_dir() / "profiles" / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    _MEMO[key] = data
    return data


def _store_cached(key: str, data: dict[str, Any]) -> None:
    _MEMO[key] = data
    if not settings.cache_enabled():
        return
    path = settings.cache_dir() / "profiles" / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home is no reason to fail
        log.debug("profile cache not written (%s)", e)


def _fit(chain: Chain, lo: int, s_lo: list[StageSample], hi: int, s_hi: list[StageSample]) -> list[StageCost]:
    costs = []
    for st, a, b in zip(chain.stages, s_lo, s_hi):
        costs.append(StageCost(
            name=st.name,
            fwd_s=Linear.fit(lo, a.fwd_s, hi, b.fwd_s),
            bwd_s=Linear.fit(lo, a.bwd_s, hi, b.bwd_s),
            saved_bytes=Linear.fit(lo, a.saved_bytes, hi, b.saved_bytes),
            out_bytes=Linear.fit(lo, a.out_bytes, hi, b.out_bytes),
            workspace_bytes=Linear.fit(lo, a.workspace_bytes, hi, b.workspace_bytes),
            carried=tuple((p, Linear.fit(lo, x, hi, y)) for (p, x), (_, y) in zip(a.carried, b.carried))))
    return costs


def _min_samples(runs: list[list[StageSample]]) -> list[StageSample]:
    """Per stage: fastest times, largest bytes over repeated runs (robust to noise, conservative in memory)."""
    out = []
    for per in zip(*runs):
        out.append(StageSample(fwd_s=min(s.fwd_s for s in per), bwd_s=min(s.bwd_s for s in per),
                               saved_bytes=max(s.saved_bytes for s in per), out_bytes=max(s.out_bytes for s in per),
                               in_grad_bytes=max(s.in_grad_bytes for s in per),
                               peak_bytes=max(s.peak_bytes for s in per), carried=per[0].carried))
    return out


def profile_chain(chain: Chain, model: nn.Module, inputs_env: dict[str, Any], targets: Any,
                  loss_fn: Callable[..., torch.Tensor], *, batch_size: int, fixed_bytes: int,
                  budget_bytes: int | None = None, repeats: int = 2, use_cache: bool = True,
                  name: str = "", min_micro_batch: int = 1, selective: bool | None = None,
                  memo: dict[str, Any] | None = None) -> CostChain:
    """Profile ``chain`` on this machine and return its :class:`CostChain`.

    Args:
        chain: the captured chain of ``model``.
        model: the model (its buffers, gradients and the RNG are restored afterwards, bit for bit).
        inputs_env: the example inputs by name (a full logical batch; slices of it are profiled).
        targets: the example targets, batched like the inputs.
        loss_fn: ``loss_fn(output, targets) -> scalar``.
        batch_size: the logical batch size.
        fixed_bytes: bytes independent of the schedule (parameters, gradients, optimizer state, batch).
        budget_bytes: the memory budget; profiling sizes are chosen so no profiled stage exceeds it.
        repeats: timed repetitions per size (the fastest is kept).
        use_cache: read/write the profile cache.
        name: model name for reports.
        min_micro_batch: the smallest micro-batch the model accepts (2 with training-mode BatchNorm,
            which cannot normalise a single sample of 1x1 maps).
        selective: also measure each stage's per-op (selective) recompute options, each checked bit-exact
            against a plain run of the stage (:mod:`edgetrain.profile.ops`); ``None`` reads
            ``EDGETRAIN_SELECTIVE`` (on unless ``0``).
        memo: profiles already taken by this caller, by cache key; read like the on-disk cache (whether or
            not that is used) and given what this call profiles. A prepare profiling the same sizes again
            (re-profiling for another budget) then measures them once, as it does with the cache on.

    Returns:
        The fitted cost chain.

    Raises:
        ProfileError: a stage failed to run forward or backward.
    """
    if selective is None:
        from ..runtime.selective import enabled

        selective = enabled()
    params = {_storage_key(p) for p in model.parameters()}
    with preserved_model_state(model):
        try:
            # Warm-up at the smallest size allocates parameter gradients and loads kernels; then two small
            # sizes give per-sample bytes, to choose profiling sizes that keep profiling inside the budget.
            m0 = min(min_micro_batch, batch_size)
            m1 = min(2 * m0, batch_size)
            _run_chain(chain, inputs_env, targets, loss_fn, m0, params)
            small = [_run_chain(chain, inputs_env, targets, loss_fn, m, params)[0] for m in (m0, m1)]
        except Exception as e:
            raise ProfileError(f"profiling failed: {type(e).__name__}: {e}") from e
        per_sample = [max(0, b.local_bytes - a.local_bytes) / (m1 - m0) for a, b in zip(*small)] \
            if m1 > m0 else [a.local_bytes / m0 for a in small[0]]
        base = [a.local_bytes for a in small[0]]
        hi = batch_size
        if budget_bytes is not None:
            room = budget_bytes - fixed_bytes
            while hi > m0 and max(b + (hi - m0) * p for b, p in zip(base, per_sample)) * 1.5 > room:
                hi = max(m0, hi // 2)
        lo = min(m1, hi)  # reuse a size already run: every new shape costs kernel-cache memory
        sizes = (lo, hi)
        key = _cache_key(chain, model, inputs_env, sizes, selective)
        log.debug("profiling sizes %s (budget %s, fixed %s): key %s", sizes, budget_bytes, fixed_bytes, key)
        cached = _load_cached(key) if use_cache else None
        if cached is None and memo is not None:
            cached = memo.get(key)
        if cached is None:
            try:
                # the first run of a size measures memory too; the others time it with the pool warm
                runs_lo = [_run_chain(chain, inputs_env, targets, loss_fn, lo, params, i == 0) for i in range(repeats)]
                runs_hi = [_run_chain(chain, inputs_env, targets, loss_fn, hi, params, i == 0) for i in range(repeats)]
            except Exception as e:
                raise ProfileError(f"profiling failed at micro-batch {hi}: {type(e).__name__}: {e}") from e
            s_lo, s_hi = _min_samples([r[0] for r in runs_lo]), _min_samples([r[0] for r in runs_hi])
            loss_lo, loss_hi = min(r[1] for r in runs_lo), min(r[1] for r in runs_hi)
            stages = _fit(chain, lo, s_lo, hi, s_hi)
            if selective:
                stages = _with_selective(chain, inputs_env, lo, hi, params, stages, s_lo, s_hi)
            resident = Linear.fit(lo, max(r[2] for r in runs_lo), hi, max(r[2] for r in runs_hi))
            try:  # FLOPs scale costs to devices we are not running on (edgetrain.devices.scale_chain)
                if chain.method == "modules":
                    raise ValueError("blocks of the module tree run only inside the model's forward")
                f0, f1 = _count_flops(chain, inputs_env, m0), _count_flops(chain, inputs_env, m1)
                stages = [replace(s, flops=Linear.fit(m0, a, m1, b)) if m1 > m0 else
                          replace(s, flops=Linear(0.0, a / m0)) for s, a, b in zip(stages, f0, f1)]
            except Exception as e:  # counting is best effort; timing-based scaling still works
                log.debug("FLOP counting failed: %s", e)
            cached = {"stages": [CostChain(tuple(stages), 1, Linear(), 0).to_dict()["stages"]][0],
                      "loss_s": Linear.fit(lo, loss_lo, hi, loss_hi).__dict__, "sizes": list(sizes),
                      "input_bytes": resident.__dict__}
            if use_cache:
                _store_cached(key, cached)
            if memo is not None:
                memo[key] = cached
        else:
            log.debug("profile cache hit %s", key)
    data = {"stages": cached["stages"], "batch_size": batch_size,
            "input_bytes": cached.get("input_bytes", {"fixed": 0, "per_sample": 0}),
            "fixed_bytes": fixed_bytes, "loss_s": cached["loss_s"], "name": name}
    return CostChain.from_dict(data)
