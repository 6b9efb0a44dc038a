"""Per-op (selective) recomputation inside a stage: which op outputs a selective checkpoint keeps.

A stage planned ``selective:NAME`` runs under non-reentrant ``torch.utils.checkpoint`` with a selective
checkpoint policy (``create_selective_checkpoint_contexts``): the outputs of the ops whose class is in
``NAME`` (``"+"``-joined, e.g. ``"conv+mm"``) are cached during forward and handed back during the replay;
every other op re-runs. Exactness rests on three rules:

* random ops (tagged ``nondeterministic_seeded``: dropout's ``bernoulli_``, ``native_dropout``) always
  re-run, never cached: the checkpoint restores the RNG state before the replay, so the random ops draw the
  same numbers only if every one of them draws again, in order (a cached one would not advance the stream
  and shift every later mask);
* BatchNorm layers that re-run update their running statistics again; the :class:`RecomputeGuard` entered
  around the replay puts them back (its forward context is entered *outside* the caching mode, so its
  buffer copies are not ops of the cached sequence);
* a cached output that is later mutated in place raises (PyTorch's version check on cache entries stays
  on); the profiler runs every option once and drops the ones that raise or whose gradients differ from
  plain PyTorch's, so a plan never carries them;
* only the kept classes go through PyTorch's caching modes (:class:`_KeptOnly`): their cache is indexed by
  the count of calls per op, and the ops in between may differ between forward and replay (a
  ``momentum=None`` BatchNorm reads ``num_batches_tracked`` with ``.item()`` in a replay, but not in a
  micro-batched forward, where :class:`FullBatchStats` sets the momentum); as in whole-stage
  recomputation, what must match is the saved tensors, which the checkpoint checks;
* a composite op made of several kernels (the lean convolution's batch slices written into one output)
  registers itself with :func:`composite`: under a selective checkpoint that keeps its class, its kernels
  run uncached in forward, its one output is cached (with its version, checked in the replay: a mutated
  entry raises), and the replay hands that output back without running the composite at all.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import settings
from ..capture.composite import Frame as _Frame
from ..capture.composite import composite, frames

__all__ = ["OP_CLASSES", "op_class", "option_classes", "option_name", "selective_context_fn", "composite",
           "recording", "enabled"]


def enabled() -> bool:
    """Whether the profiler measures selective options (``EDGETRAIN_SELECTIVE=0`` turns them off, so
    plans use whole-stage policies only; for A/B measurements)."""
    return settings.selective_enabled()


#: Op classes whose outputs an option may keep, cheapest to keep (most expensive to recompute) first.
OP_CLASSES = ("conv", "mm", "norm")

_CONV = ("convolution", "_convolution", "mkldnn_convolution", "_slow_conv2d_forward", "thnn_conv2d",
         "_conv_depthwise2d", "conv_depthwise3d", "slow_conv3d_forward", "slow_conv_dilated2d",
         "slow_conv_dilated3d", "convolution_overrideable", "slow_conv_transpose2d", "slow_conv_transpose3d")
_MM = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
       "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
       "_scaled_dot_product_cudnn_attention", "_mkldnn_linear", "mkldnn_linear", "_addmm_activation")
_NORM = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
         "_batch_norm_with_update", "_batch_norm_no_update", "native_layer_norm", "native_group_norm",
         "_fused_rms_norm", "cudnn_batch_norm", "miopen_batch_norm")
_CLASS_OF = {**dict.fromkeys(_CONV, "conv"), **dict.fromkeys(_MM, "mm"), **dict.fromkeys(_NORM, "norm")}


@functools.lru_cache(maxsize=None)
def op_class(func: Any) -> str:
    """The class of an ATen op as a dispatch mode sees it: ``conv``, ``mm``, ``norm``, ``random`` or ``other``."""
    tags = getattr(func, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return "random"
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None) or str(func)
    return _CLASS_OF.get(name, "other")


def option_name(classes: tuple[str, ...]) -> str:
    """The option name of a set of kept op classes (in :data:`OP_CLASSES` order)."""
    return "+".join(c for c in OP_CLASSES if c in classes)


def option_classes(name: str) -> frozenset[str]:
    """The kept op classes of an option name.

    Raises:
        ValueError: a class that is not one of :data:`OP_CLASSES`.
    """
    classes = frozenset(name.split("+"))
    bad = classes - set(OP_CLASSES)
    if bad or not classes:
        raise ValueError(f"selective option {name!r} names unknown op classes {sorted(bad)}; "
                         f"known: {OP_CLASSES}")
    return classes


def _policy(keep: frozenset[str], ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # random ops never cached (module doc); everything outside the kept classes re-runs
    return CheckpointPolicy.MUST_SAVE if op_class(func) in keep else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def recording(on_kept: Callable[[str, torch.Tensor], None]) -> Iterator[_Frame]:
    """Profiler hook: composites report their one output as kept (``on_kept(cls, out)``) and mark their
    kernels (``frame.suppress``) so the recorder counts their time but not their outputs."""
    frame = _Frame("record", frozenset(OP_CLASSES), [], on_kept)
    frames().append(frame)
    try:
        yield frame
    finally:
        frames().remove(frame)


class _KeptOnly(TorchDispatchMode):
    """Hands the ops of the kept classes to a selective-checkpoint mode; every other op just runs."""

    def __init__(self, keep: frozenset[str], sac_mode: TorchDispatchMode, frame: _Frame) -> None:
        super().__init__()
        self.keep = keep
        self.sac_mode = sac_mode
        self.frame = frame

    def __enter__(self) -> "_KeptOnly":
        frames().append(self.frame)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            frames().remove(self.frame)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if op_class(func) in self.keep and not self.frame.suppress:
            return self.sac_mode.__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _both(outer: Any, inner: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(outer)
        stack.enter_context(inner)
        yield


def selective_context_fn(name: str, guard_fn: Callable[[], tuple[Any, Any]] | None = None
                         ) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that runs option ``name``.

    Args:
        name: the option (kept op classes, ``"+"``-joined).
        guard_fn: the whole-stage recompute contexts to combine with it (``(forward context, recompute
            context)``, e.g. a :class:`~edgetrain.runtime.batchnorm.RecomputeGuard`); they are entered
            outside the selective-checkpoint modes.

    Returns:
        A function returning fresh ``(forward context, recompute context)`` per checkpoint call.
    """
    keep = option_classes(name)
    policy = functools.partial(_policy, keep)

    def context_fn() -> tuple[Any, Any]:
        sac_fwd, sac_rec = create_selective_checkpoint_contexts(policy)
        cache: list[Any] = []
        fwd = _KeptOnly(keep, sac_fwd, _Frame("forward", keep, cache))
        rec = _KeptOnly(keep, sac_rec, _Frame("replay", keep, cache))
        if guard_fn is None:
            return fwd, rec
        g_fwd, g_rec = guard_fn()
        return _both(g_fwd, fwd), _both(g_rec, rec)

    return context_fn
