"""Lean BatchNorm: a training-mode BatchNorm (and the ReLU / ReLU6 after it) whose backward holds two tensors, not four.

Autograd runs ``conv -> BatchNorm -> ReLU6 -> conv`` backward as separate nodes. On the largest layer of a
step that sets the peak: while ReLU6's backward runs, the BatchNorm input ``x`` (saved by BatchNorm), the
activation's output ``y`` (saved by the activation and the next convolution), the incoming gradient ``g_y``
and the gradient it makes ``g_z`` are alive at once; then BatchNorm's backward holds ``x``, ``g_z`` and the
``g_x`` it makes. Four and then three tensors of the layer's size, where the maths needs two.

:func:`lean_batch_norm` runs the BatchNorm module itself (its own forward: running statistics, momentum,
``num_batches_tracked`` and forward hooks behave as written) and the activation inside one autograd
function that saves ``x`` and the activation's gradient mask packed to one bit per element. Its backward
is PyTorch's own CPU BatchNorm backward, re-done operation for operation in one native call
(``_lean_bn.c``) that reads the masked gradient on the fly, with no temporary of the layer's size:

    sum  = sum(g),  dotp = sum((x - mean) * g)          (per channel: float lanes per plane, double across)
    g_x  = (g - sum / N - (x - mean) * dotp * invstd^2 / N) * invstd * weight
    g_weight = dotp * invstd,  g_bias = sum

When the graph shows that nothing but this BatchNorm holds ``x`` (``owned``), ``g_x`` is written over ``x``
in place: the backward then holds ``x`` and ``g_y`` and nothing of their size more.

**Exact, or not used.** The results are the same bits as autograd's ``threshold_backward`` /
``hardtanh_backward`` followed by ``native_batch_norm_backward``: same reduction order (ATen's vector lanes,
tail and lane fold), same types, same rounding. What the installed torch's build did that C cannot see (its
vector width, whether it fused a multiply-add) is settled once per process by a self-check
(:func:`exact_variant`) that runs both kernels on small random problems and keeps the variant that agrees
bit for bit. Where none agrees, or the native library cannot be built, or a call is outside what the
kernel reproduces (not float32 on CPU, not contiguous, one element per channel plane, which ATen runs
through its channels-last kernel), the module and activation run as written: slower in memory, never
different in value.

The activation runs in place on the BatchNorm's own output (out of place where a selective checkpoint or
the profiler keeps that output). ``x`` is saved by a small call ahead of the BatchNorm, the mask and the
statistics stay with the BatchNorm's node: a recomputed stage that ends here stops its replay once ``x``
is back, without making the layer's output again.

An eval-mode layer (frozen statistics) takes the same path with the running statistics, as ATen's
eval-mode backward uses them.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode

from .. import settings
from ..forking import answer_in_fork
from ..native import NativeLibrary
from .composite import frames

__all__ = ["lean_batch_norm", "exact_variant", "available"]

log = logging.getLogger(__name__)

_BN_OPS = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                     torch.ops.aten._batch_norm_with_update.default})
_ACT_CODE = {"relu": 1, "hardtanh": 2}

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_NATIVE = NativeLibrary(Path(__file__).with_name("_lean_bn.c"), "libedgetrain_lean_bn", "lean BatchNorm's passes",
                        {"et_bn_act": [_PTR, _PTR, _PTR, _I64, _INT, _F32, _F32, _INT],
                         "et_bn_backward": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _INT, _PTR, _PTR,
                                            _PTR, _INT, _INT, _INT, _INT, _INT]},
                        "lean BatchNorm is off; BatchNorm layers run as written")
_FAILED: str | None = None  # why no kernel variant reproduces the installed torch
_VARIANT: tuple[int, int, int, int] | None = None
_SETTLED = False  # exact_variant() has run in this process


def _library() -> ctypes.CDLL | None:
    """The compiled passes (``_lean_bn.c``), built on first use, or None (no compiler: logged once)."""
    return _NATIVE.get()


def _check_cases() -> list[tuple[torch.Tensor, ...]]:
    """Small problems whose planes cover ATen's code paths: shorter than a vector, whole vectors, tails."""
    gen = torch.Generator().manual_seed(20261203)
    cases = []
    for n, c, s in ((1, 2, 3), (2, 3, 7), (3, 2, 8), (2, 3, 9), (4, 2, 15), (2, 3, 16), (4, 2, 17), (2, 3, 31),
                    (3, 2, 64), (2, 2, 100), (5, 3, 37), (2, 2, 1000)):
        x = torch.randn(n, c, s, generator=gen) * 3 + 0.7
        z = torch.randn(n, c, s, generator=gen)
        gy = torch.randn(n, c, s, generator=gen) * 2
        w = torch.rand(c, generator=gen) + 0.5
        rv = torch.rand(c, generator=gen) + 0.5
        cases.append((x, z, gy, w, torch.randn(c, generator=gen), rv))
    return cases


def _agrees(lib: ctypes.CDLL, variant: tuple[int, int, int, int]) -> bool:
    """Whether the kernel in ``variant`` gives autograd's bits on every check case, train and eval."""
    aten = torch.ops.aten
    eps = 1e-5
    for x, z, gy, w, rm, rv in _check_cases():
        n, c, s = x.shape
        bits = torch.zeros(-(-z.numel() // 8) + 1, dtype=torch.uint8)
        y = torch.empty_like(z)
        lib.et_bn_act(z.data_ptr(), y.data_ptr(), bits.data_ptr(), z.numel(), _ACT_CODE["relu"], 0.0, 0.0, 1)
        if not torch.equal(y, torch.relu(z)):
            return False
        for mask, g in ((None, gy), (bits, aten.threshold_backward(gy, y, 0))):
            for train in (True, False):
                for weight in (w, None):
                    if train:
                        _, mean, invstd = aten.native_batch_norm(x, weight, None, None, None, True, 0.1, eps)
                        ref = aten.native_batch_norm_backward(g, x, weight, None, None, mean, invstd, True, eps,
                                                              [True, True, True])
                    else:
                        mean, invstd = rm, _eval_invstd(rv, eps)
                        ref = aten.native_batch_norm_backward(g, x, weight, rm, rv, None, None, False, eps,
                                                              [True, True, True])
                    out, gw, gb = torch.empty_like(x), torch.empty(c), torch.empty(c)
                    lib.et_bn_backward(x.data_ptr(), gy.data_ptr(), _ptr(mask), n, c, s, mean.data_ptr(),
                                       invstd.data_ptr(), _ptr(weight), int(train), out.data_ptr(),
                                       gw.data_ptr(), gb.data_ptr(), 1, *variant)
                    if not (torch.equal(out, ref[0]) and torch.equal(gb, ref[2])
                            and (weight is None or torch.equal(gw, ref[1]))):
                        return False
    return True


def exact_variant() -> tuple[int, int, int, int] | None:
    """``(lanes, seq, fma_dot, fma_dx)``: how the installed torch's CPU BatchNorm backward rounds, or None.

    Settled once per process (milliseconds) by running the native kernel in each variant beside
    ``aten.native_batch_norm_backward`` on :func:`_check_cases` and keeping the first that agrees bit for bit
    (``_lean_bn.c`` says what each field means). None (lean BatchNorm stays off, logged once) when none
    agrees or the kernel cannot be built. The check runs in a forked child where one runs as this process
    would (:func:`~edgetrain.forking.answer_in_fork`): it runs torch's own BatchNorm backward, code a
    lean step never runs, and that code and the check's heap stayed resident here (3.6 MiB), in every step
    and in every budget's fixed bytes."""
    global _VARIANT, _FAILED, _SETTLED
    if _SETTLED:
        return _VARIANT
    settled = answer_in_fork(_settle_variant)
    if settled is None or (settled[0] is None and settled[1] is None):
        settled = _settle_variant()  # no child, or the kernel did not build there: this process says why
    elif settled[0] is not None and _library() is None:  # built by the child: loaded here from the cache
        settled = None, None
    _SETTLED = True  # once per process, whatever the answer (a failed build is logged by NativeLibrary)
    _VARIANT, _FAILED = settled
    if _FAILED is not None:
        log.warning("lean BatchNorm is off: %s; BatchNorm layers run as written", _FAILED)
    return _VARIANT


def _settle_variant() -> tuple[tuple[int, int, int, int] | None, str | None]:
    """``(variant, None)``, ``(None, why none agrees)``, or ``(None, None)`` when the kernel cannot be built."""
    lib = _library()
    if lib is None:
        return None, None
    capability = torch.backends.cpu.get_cpu_capability().upper()
    widths = (16, 8, 4) if capability.startswith("AVX512") else (8, 16, 4)
    for lanes in widths:
        for seq in (0, 1):  # ATen's SIMD lane fold, or its generic one
            for fma_dot in (0, 2, 1, 3):  # bit 0: whole vectors, bit 1: the tail (_lean_bn.c)
                for fma_dx in (0, 1):
                    if _agrees(lib, (lanes, seq, fma_dot, fma_dx)):
                        log.debug("lean BatchNorm reproduces torch %s's backward (%s) as lanes %d, fold %s, "
                                  "fma %d/%d", torch.__version__, capability, lanes, "seq" if seq else "tree",
                                  fma_dot, fma_dx)
                        return (lanes, seq, fma_dot, fma_dx), None
    return None, (f"no kernel variant reproduces torch {torch.__version__}'s BatchNorm backward ({capability}) "
                  "bit for bit")


def available() -> bool:
    """Whether lean BatchNorm runs here: native passes built and bit-exact against the installed torch."""
    return settings.native_enabled() and exact_variant() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _eval_invstd(running_var: torch.Tensor, eps: float) -> torch.Tensor:
    """ATen's eval-mode ``1 / std::sqrt(running_var + eps)``: in double, then float."""
    return (1.0 / torch.sqrt(running_var.detach().double() + eps)).to(running_var.dtype)


class _Statistics(TorchDispatchMode):
    """Reads the batch mean and inverse standard deviation a BatchNorm forward's kernel returns."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _BN_OPS:
            self.stats = (out[1], out[2])
        return out


def _activation(z: torch.Tensor, act: str, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activation's output and its packed gradient mask (None: no activation, every element passes)."""
    if act == "none":
        return z, None
    # z is this call's own tensor unless a selective checkpoint (or the profiler) keeps the BatchNorm's
    # output: then the activation must not overwrite it
    y = z if not frames() else torch.empty_like(z)
    bits = torch.zeros(-(-z.numel() // 8) + 1, dtype=torch.uint8)  # + 1: the kernel reads 16 bits at a time
    _library().et_bn_act(z.data_ptr(), y.data_ptr(), bits.data_ptr(), z.numel(), _ACT_CODE[act], lo, hi,
                         torch.get_num_threads())
    return y, bits


class _SaveInput(torch.autograd.Function):
    """Saves the BatchNorm input ahead of the BatchNorm (module docstring: the replay stops here)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class _LeanBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, act, lo, hi, owned):  # type: ignore[override]
        grab = _Statistics()
        with grab:
            z = module(x)
        if grab.stats is not None and grab.stats[0].numel():  # normalised with the batch's statistics
            mean, invstd = grab.stats
            ctx.batch_stats = True
        else:  # eval mode: the running statistics, as ATen's eval-mode backward reads them
            mean = module.running_mean.detach().clone()
            invstd = _eval_invstd(module.running_var, module.eps)
            ctx.batch_stats = False
        y, mask = _activation(z, act, lo, hi)
        del z
        # The input is saved by the _SaveInput call before this one when it needs a gradient; the mask
        # and statistics (1/32 of the input and less) stay with this node, so that a recomputed stage
        # ending here stops once the input is back, without making this layer's output again.
        source = x.grad_fn if isinstance(x.grad_fn, _SaveInput._backward_cls) else None
        if source is None:
            ctx.save_for_backward(x)
        ctx.source = source
        ctx.mask, ctx.mean, ctx.invstd, ctx.weight = mask, mean, invstd, weight
        ctx.owned = owned
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g_y):  # type: ignore[override]
        (x,) = ctx.source.saved_tensors if ctx.source is not None else ctx.saved_tensors
        mask, mean, invstd, weight = ctx.mask, ctx.mean, ctx.invstd, ctx.weight
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g_y = g_y.contiguous()
        channels = x.shape[1]
        g_x = (x if ctx.owned else torch.empty_like(x)) if need_x else None
        g_w = x.new_empty(channels) if need_w else None
        g_b = x.new_empty(channels) if need_b else None
        _library().et_bn_backward(x.data_ptr(), g_y.data_ptr(), _ptr(mask), x.shape[0], channels,
                                  x[0, 0].numel(), mean.data_ptr(), invstd.data_ptr(), _ptr(weight),
                                  int(ctx.batch_stats), _ptr(g_x), _ptr(g_w), _ptr(g_b), torch.get_num_threads(),
                                  *_VARIANT)
        if g_x is not None:
            torch.autograd.graph.increment_version(g_x)  # a write autograd must see (a raw pointer's is not)
            g_x = g_x.detach()
        return g_x, g_w, g_b, None, None, None, None, None


def _fits(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether the exact kernel covers this call (module docstring): float32 on CPU, contiguous, planes of
    more than one element, parameters float32 too, and the kernel verified against the installed torch."""
    params = [t for t in (module.weight, module.bias, module.running_mean, module.running_var) if t is not None]
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and x.dim() >= 3
            and x.shape[0] > 0 and x[0, 0].numel() > 1
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in params)
            and available())


def lean_batch_norm(x: torch.Tensor, module: nn.Module, act: str = "none", lo: float = 0.0, hi: float = 0.0,
                    owned: bool = False) -> torch.Tensor:
    """``act(module(x))`` for a BatchNorm ``module``, with the backward of the module docstring.

    Args:
        x: the BatchNorm input ``[N, C, ...]``.
        module: an ``nn.BatchNorm1d/2d/3d``; called as is (its forward hooks fire).
        act: ``"none"``, ``"relu"`` or ``"hardtanh"`` (ReLU6 is ``hardtanh`` with bounds ``(0, 6)``).
        lo, hi: the hardtanh bounds.
        owned: nothing but this call holds ``x`` for backward, so its gradient may be written over it.

    Returns:
        The activation's output, equal to ``act(module(x))``; its gradients are autograd's, bit for bit.
    """
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(
        p is not None and p.requires_grad for p in (module.weight, module.bias)))
    if wants_grad and _fits(x, module):
        if x.requires_grad:
            x = _SaveInput.apply(x)
        return _LeanBatchNormFn.apply(x, module.weight, module.bias, module, act, float(lo), float(hi),
                                      bool(owned))
    z = module(x)
    if act == "none":
        return z
    y = torch.relu(z) if act == "relu" else F.hardtanh(z, lo, hi)
    # the activation saved y for its backward; a reader that owns its input must not overwrite that
    return y.clone() if wants_grad else y
