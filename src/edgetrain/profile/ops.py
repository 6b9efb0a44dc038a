"""Per op class in a stage: the bytes a selective checkpoint keeps and the forward time it re-runs.

For every stage the profiler already measured, one more forward under a dispatch mode records each op's
class (:func:`edgetrain.runtime.selective.op_class`), its seconds and the storages of its outputs, beside
``saved_tensors_hooks`` recording what autograd saves. An option keeping classes ``C`` then keeps the
outputs of the ops in ``C`` (storages of the stage input, its outputs and the parameters excluded: they are
resident anyway), of which those autograd does not save only add to the backward peak; its replay re-runs
every other op, whose share of the op time scales the stage's measured forward seconds, plus what the
selective checkpoint's machinery costs per op in forward and replay (measured once per process against
whole-stage recomputation of a chain of tiny ops).

Each option is then run once for real, forward and backward under the selective checkpoint, against a
plain run from the same RNG state: an option whose outputs or gradients differ in any bit, or that raises
(a kept output mutated in place), is dropped, so plans only carry options shown exact on this stage.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ..batch import tensors_in
from ..capture.chain import grad_outputs, stage_inputs
from ..graph import Linear, SelectiveOption
from ..runtime.selective import OP_CLASSES, op_class, option_name, recording, selective_context_fn

__all__ = ["OpSample", "record_ops", "candidate_options", "option_is_exact", "fit_option", "selective_stages"]

log = logging.getLogger(__name__)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class OpSample:
    """One recorded forward of one stage at one micro-batch size."""

    seconds: dict[str, float] = field(default_factory=dict)   # per op class
    calls: int = 0
    kept: dict[str, dict[int, int]] = field(default_factory=dict)  # class -> storage -> bytes
    saved: set[int] = field(default_factory=set)
    resident: set[int] = field(default_factory=set)
    outputs: set[int] = field(default_factory=set)
    mutates_input: bool = False

    def keeps_output(self, classes: Sequence[str]) -> bool:
        """Whether a kept op made (a storage of) the stage's output."""
        return any(k in self.kept.get(c, {}) for c in classes for k in self.outputs)

    def bytes_of(self, classes: Sequence[str]) -> tuple[int, int]:
        """(kept bytes, the part of them autograd does not save) of an option keeping ``classes``."""
        store: dict[int, int] = {}
        for c in classes:
            store.update(self.kept.get(c, {}))
        kept = {k: b for k, b in store.items() if k not in self.resident}
        return sum(kept.values()), sum(b for k, b in kept.items() if k not in self.saved)

    def rerun_share(self, classes: Sequence[str]) -> float:
        total = sum(self.seconds.values())
        if total <= 0:
            return 0.0
        return sum(s for c, s in self.seconds.items() if c not in classes) / total


class _Recorder(TorchDispatchMode):
    def __init__(self, sample: OpSample) -> None:
        super().__init__()
        self.sample = sample
        self.hold: list[torch.Tensor] = []  # kept-class outputs stay referenced: no storage key reused
        self.frame: Any = None              # the composite-op frame (its kernels' outputs are not kept)

    def kept(self, cls: str, t: torch.Tensor) -> None:
        self.sample.kept.setdefault(cls, {}).setdefault(_key(t), t.untyped_storage().nbytes())
        self.hold.append(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        cls = op_class(func)
        s = self.sample
        s.seconds[cls] = s.seconds.get(cls, 0.0) + dt
        s.calls += 1
        if cls in OP_CLASSES and not (self.frame is not None and self.frame.suppress):
            for t in tensors_in(out):
                if t.device.type != "meta":
                    self.kept(cls, t)
        return out


@contextlib.contextmanager
def _inputs_restored(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Puts the values of ``tensors`` back after the block: a stage's backward may write its input gradient
    over an input it owns (:mod:`edgetrain.capture.rewrite`), and the profiler runs a stage again on the
    same inputs."""
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, v in zip(tensors, saved):
                t.copy_(v)


def record_ops(run: Callable[[], Any], inputs: Sequence[Any], params: set[int], restore: bool = False) -> OpSample:
    """Record one forward ``run()`` (then free its graph by a backward of ones).

    Args:
        run: runs the stage forward on fixed inputs and returns its outputs.
        inputs: the stage inputs (their storages are resident anyway).
        params: storage keys of the model's parameters.
        restore: the stage owns an input (its backward writes there): put the inputs back after it.
    """
    sample = OpSample()

    def pack(t: torch.Tensor) -> torch.Tensor:
        sample.saved.add(_key(t))
        return t

    rec = _Recorder(sample)
    ins = tensors_in(list(inputs))
    versions = [t._version for t in ins]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recording(rec.kept) as frame:
        rec.frame = frame
        with rec:
            outs = run()
    outs_t = tensors_in(outs)
    sample.mutates_input = any(t._version != v for t, v in zip(ins, versions))
    sample.outputs = {_key(t) for t in outs_t}
    sample.resident = set(params) | {_key(t) for t in ins} | sample.outputs
    rec.hold.clear()
    diff = [o for o in outs_t if o.requires_grad]
    if diff:
        with _inputs_restored([t for t in ins if t.is_floating_point()] if restore else []):
            torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    return sample


def candidate_options(samples: Sequence[OpSample]) -> list[tuple[str, ...]]:
    """Kept-class sets to offer across a chain: its convolutions and matrix products, then those and its
    normalisations (the classes some stage runs; an empty or repeated set is left out)."""
    present = {c for s in samples for c in OP_CLASSES if s.kept.get(c)}
    heavy = tuple(c for c in OP_CLASSES if c in present and c != "norm")
    both = tuple(c for c in OP_CLASSES if c in present)
    return [c for c in dict.fromkeys((heavy, both)) if c]


def option_is_exact(run: Callable[..., Any], args: Sequence[Any], grad_inputs: Sequence[torch.Tensor],
                    params: Sequence[torch.Tensor], name: str, restore: bool = False) -> bool:
    """Whether option ``name`` gives bit-identical outputs and gradients to a plain run (and does not raise).
    ``restore``: the stage owns an input, so each run starts from the inputs as they were."""
    def once(selective: bool) -> list[torch.Tensor | None]:
        state = torch.get_rng_state()
        try:
            with _inputs_restored(list(grad_inputs) if restore else []):
                if selective:
                    outs = checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                      context_fn=selective_context_fn(name))
                else:
                    outs = run(*args)
                outs_t = tensors_in(outs)
                diff = [o for o in outs_t if o.requires_grad]
                wrt = list(grad_inputs) + list(params)
                grads = torch.autograd.grad(diff, wrt, [torch.ones_like(o) for o in diff], allow_unused=True) \
                    if diff and wrt else ()
                # an owned input's gradient lies in the input's storage, which the block puts back
                return [o.detach() for o in outs_t] + [g.clone() if restore and g is not None else g for g in grads]
        finally:
            torch.set_rng_state(state)

    # torch.fx prints the traceback of an exception raised in a traced stage to stderr before re-raising it: a
    # refused option (a TorchScript module inside, which the selective policy cannot run) is no error of the user's
    printed = io.StringIO()
    try:
        plain = once(False)
        with contextlib.redirect_stderr(printed):
            sel = once(True)
    except Exception as e:  # a kept output mutated in place, an op sequence that differs in the replay
        log.info("selective option %s refused (whole-stage policies stay): %s: %s", name, type(e).__name__, e)
        log.debug("%s", printed.getvalue())
        return False
    same = len(plain) == len(sel) and all(
        (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
        for a, b in zip(plain, sel))
    if not same:
        log.info("selective option %s refused (whole-stage policies stay): outputs or gradients differ from a "
                 "plain run", name)
    return same


@functools.lru_cache(maxsize=1)
def dispatch_overhead_s() -> float:
    """Seconds the selective checkpoint adds per op of a region, forward and replay together, on this
    machine: a chain of 64 tiny matrix products and ReLUs under it against whole-stage recomputation of
    the same chain (which re-runs every op, so the difference is the machinery; best of 5 rounds)."""
    x = torch.randn(2, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def chain(v: torch.Tensor) -> torch.Tensor:
        for _ in range(32):
            v = torch.relu(v @ w)
        return v

    def once(selective: bool) -> float:
        kw = {"context_fn": selective_context_fn("mm")} if selective else {}
        t0 = time.process_time()   # this process's CPU time: robust to other processes on the machine
        for _ in range(8):
            checkpoint(chain, x, use_reentrant=False, **kw).sum().backward()
        return (time.process_time() - t0) / 8

    once(True), once(False)
    sel, whole = min(once(True) for _ in range(5)), min(once(False) for _ in range(5))
    return max(0.0, (sel - whole) / 64)


def fit_option(classes: Sequence[str], lo: int, s_lo: OpSample, fwd_lo: float, hi: int, s_hi: OpSample,
               fwd_hi: float) -> SelectiveOption:
    """One stage's option keeping ``classes``, fitted over two micro-batch sizes."""
    overhead = dispatch_overhead_s()
    (k_lo, x_lo), (k_hi, x_hi) = s_lo.bytes_of(classes), s_hi.bytes_of(classes)
    r_lo = fwd_lo * s_lo.rerun_share(classes) + overhead * s_lo.calls
    r_hi = fwd_hi * s_hi.rerun_share(classes) + overhead * s_hi.calls
    return SelectiveOption(option_name(classes), kept_bytes=Linear.fit(lo, k_lo, hi, k_hi),
                           extra_bytes=Linear.fit(lo, x_lo, hi, x_hi), recompute_s=Linear.fit(lo, r_lo, hi, r_hi),
                           keeps_output=s_lo.keeps_output(classes) or s_hi.keeps_output(classes))


def _fx_stage_inputs(chain: Any, inputs_env: dict[str, Any], m: int) -> list[tuple[list[Any], list[torch.Tensor]]]:
    """Per stage of a traced chain: its inputs at micro-batch ``m`` (detached; the float ones an earlier
    stage made with a gradient require gradients, as when the stage runs alone in profiling) and those
    gradient leaves. Each stage runs with autograd on, so that which outputs carry a gradient is autograd's
    answer (:func:`~edgetrain.capture.chain.stage_inputs`); its graph is dropped right after."""
    from ..batch import slice_batch

    env = {k: slice_batch(v, 0, m) for k, v in inputs_env.items()}
    live: set[str] = set()
    per = []
    for st in chain.stages:
        args, leaves = stage_inputs(st, env, live)
        per.append((args, leaves))
        outs = st(*args)  # forward only: a stage writes over an input it owns in its backward, not here
        live |= grad_outputs(st, outs)
        env.update((k, o.detach() if isinstance(o, torch.Tensor) else o) for k, o in zip(st.outputs, outs))
        del args, outs
        chain.release(env, st.index)
    return per


def _block_inputs(chain: Any, inputs_env: dict[str, Any], m: int) -> list[tuple[list[Any], list[torch.Tensor]]]:
    """Per block of a module-tree chain: the ``(args, kwargs)`` the model's forward calls it with at ``m``
    (detached; tensors that required gradients become gradient leaves)."""
    from ..batch import slice_batch
    from ..capture.modules import BlockCalls, in_backward

    calls = BlockCalls(chain)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * len(chain.stages)

    def pre(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if in_backward():
            return
        i = calls.stage(mod)
        if seen[i] is None:
            seen[i] = (args, kwargs)

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in calls.blocks]
    try:
        env = {k: slice_batch(v, 0, m) for k, v in inputs_env.items()}
        chain.model(**{**env, **chain.call_kwargs})
    finally:
        for h in handles:
            h.remove()
    per = []
    for got in seen:
        if got is None:
            raise ValueError("a block did not run in the model's forward")
        leaves: list[torch.Tensor] = []

        def fresh(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                d = v.detach()
                if v.requires_grad and v.is_floating_point():
                    d.requires_grad_(True)
                    leaves.append(d)
                return d
            if isinstance(v, (tuple, list)):
                return type(v)(fresh(x) for x in v)
            return v

        args, kwargs = fresh(got[0]), {k: fresh(v) for k, v in got[1].items()}
        per.append(([args, kwargs], leaves))
    return per


def selective_stages(chain: Any, inputs_env: dict[str, Any], lo: int, hi: int, params: set[int],
                     stages: Sequence[Any], fwd_lo: Sequence[float], fwd_hi: Sequence[float]) -> list[Any]:
    """``stages`` (:class:`edgetrain.graph.StageCost`) with their selective options measured and checked.

    Args:
        chain: the captured chain (traced stages, or module-tree blocks).
        inputs_env: the example inputs by name (a full logical batch).
        lo, hi: the two profiled micro-batch sizes.
        params: storage keys of the model's parameters.
        stages: the fitted stage costs.
        fwd_lo, fwd_hi: the stages' measured forward seconds at ``lo`` and ``hi``.
    """
    from dataclasses import replace

    blocks = chain.method == "modules"
    grab = _block_inputs if blocks else _fx_stage_inputs
    at_lo, at_hi = grab(chain, inputs_env, lo), grab(chain, inputs_env, hi)
    runs, samples = [], []
    for t, st in enumerate(chain.stages):
        fn = st.modules[0] if blocks else st
        if blocks:
            def run(args: Any, kwargs: Any, fn: Any = fn) -> Any:
                return fn(*args, **kwargs)
        else:
            def run(*args: Any, fn: Any = fn) -> Any:
                return fn(*args)
        runs.append(run)
        owns = getattr(st, "owns_input", False)
        samples.append([record_ops(lambda a=args, run=run: run(*a), args, params, owns)
                        for args, _ in (at_lo[t], at_hi[t])])
    options = candidate_options([s for pair in samples for s in pair])
    out = []
    for t, (st, cost) in enumerate(zip(chain.stages, stages)):
        args_lo, leaves_lo = at_lo[t]
        stage_params = [p for mod in st.modules for p in mod.parameters() if p.requires_grad]
        opts = tuple(fit_option(c, lo, samples[t][0], fwd_lo[t], hi, samples[t][1], fwd_hi[t]) for c in options
                     if option_is_exact(runs[t], args_lo, leaves_lo, stage_params, option_name(c),
                                        getattr(st, "owns_input", False)))
        out.append(replace(cost, selective=opts,
                           mutates_input=samples[t][0].mutates_input or samples[t][1].mutates_input))
    return out
