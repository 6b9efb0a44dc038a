"""Gradient filtering's native kernels: the same results as the PyTorch formulation, and a clean fallback."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_gradfilter import CONFIGS, _reference

from edgetrain.approx.gradfilter import _impl as impl
from edgetrain.approx.gradfilter import _native as native
from edgetrain.approx.gradfilter._impl import filtered_conv2d

HAS_CC = any(shutil.which(c) for c in ("gcc", "cc", "clang"))


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv("EDGETRAIN_NATIVE", raising=False)


def test_library_builds_where_a_compiler_exists():
    if not HAS_CC:
        pytest.skip("no C compiler on this machine: the fallback is tested below")
    assert native.available(torch.zeros(1)), native._NATIVE.failed
    assert not native.available(torch.zeros(1, dtype=torch.float64))  # float32 only


def _needs_native():
    if not native.available(torch.zeros(1)):
        pytest.skip("native kernels unavailable here")


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (3, 5, 16, 16), (2, 4, 7, 9), (1, 3, 1, 1), (2, 2, 5, 32),
                                   (2, 70, 14, 14), (2, 3, 12, 8), (1, 2, 6, 8)])
@pytest.mark.parametrize("radius", [2, 3, 4])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_pool_and_unpool_match_their_definitions(shape, radius, channels_last):
    _needs_native()
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(h * 31 + w)
    x = torch.randn(shape, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    want = F.avg_pool2d(x, radius, radius, ceil_mode=True).flatten(2) * 1.5  # ceil mode: real positions
    lc = want.shape[2]
    for out in (torch.empty(n, c, lc), torch.empty(n, lc, c).transpose(1, 2), torch.empty(lc, n, c).permute(1, 2, 0)):
        torch.testing.assert_close(native.pool(x, radius, out, 1.5), want, rtol=1e-6, atol=1e-6)
    t = torch.randn(n, c, lc, generator=gen)
    counts = F.avg_pool2d(torch.ones(1, 1, h, w), radius, radius, ceil_mode=True, divisor_override=1).flatten()
    up = (t / counts * 2.0).view(n, c, -(-h // radius), -(-w // radius))
    want = up.repeat_interleave(radius, 2).repeat_interleave(radius, 3)[:, :, :h, :w]
    for src in (t, t.transpose(1, 2).contiguous().transpose(1, 2)):
        out = torch.full(shape, float("nan"))
        if channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(native.unpool(src, radius, out, 2.0), want, rtol=1e-6, atol=1e-6)


# depthwise and dense layers with enough channels for the kernels' vector blocks and their tails
WIDE = [
    (8, 8, 80, 80, 80, 3, 1, 1, 1, True),      # depthwise: one 64-channel block, one of 16
    (8, 8, 37, 37, 37, 3, 1, 1, 1, False),     # depthwise: 32 channels in blocks of 16, then 5 one at a time
    (9, 7, 24, 24, 24, 3, 2, 1, 1, True),      # depthwise, stride 2, partial patches
    (10, 10, 20, 20, 20, 5, 1, 4, 2, False),   # depthwise, dilated
    (8, 8, 24, 40, 1, 1, 1, 0, 1, True),       # 1x1
    (16, 16, 24, 40, 1, 1, 2, 0, 1, False),    # 1x1 stride 2
    (8, 8, 24, 16, 1, 3, 1, 1, 1, True),       # 3x3
    (20, 18, 8, 8, 8, 3, 1, 1, 1, True),       # depthwise above the dense threshold (convolution path)
]


def _make32(cfg, seed=0):
    h, w, c, o, g, k, s, p, d, bias = cfg
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, c, h, w, generator=gen)
    weight = torch.randn(o, c // g, k, k, generator=gen)
    b = torch.randn(o, generator=gen) if bias else None
    return x, weight, b, dict(stride=s, padding=p, dilation=d, groups=g)


def _filtered_grads(x, weight, b, kw, radius, gy_fn, x_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    weight = weight.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    y = filtered_conv2d(x, weight, b, radius=radius, **kw)
    out = gy_fn(y)
    if out is not y:  # a scalar to backpropagate from (else gy_fn has run the backward itself)
        out.backward()
    return [t.grad for t in (x, weight, b) if t is not None and t.requires_grad]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("radius", [2, 4])
@pytest.mark.parametrize("cfg", WIDE + CONFIGS)
def test_native_backward_matches_reference_and_fallback(cfg, radius, channels_last, monkeypatch):
    _needs_native()
    if cfg in CONFIGS:
        h, w, c, o, g, k, s, p, d, bias = cfg
        x, weight, b, kw = _make32((h, w, c, o, g, 1, s, p, d, bias))
        weight = torch.randn(o, c // g, *((k, k) if isinstance(k, int) else k))
    else:
        x, weight, b, kw = _make32(cfg)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    gy = torch.randn(F.conv2d(x, weight, b, **kw).shape)
    ref = _reference(x.double(), weight.double(), None if b is None else b.double(), gy.double(), radius, kw)
    ref = [t for t in ref if t is not None]
    for gy_layout in (torch.contiguous_format, torch.channels_last):  # dL/dy as NCHW and channels-last
        gy_l = gy.contiguous(memory_format=gy_layout)
        got = _filtered_grads(x, weight, b, kw, radius, lambda y: torch.autograd.backward(y, gy_l) or y)
        for a, r in zip(got, ref):
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)
        if channels_last:
            assert got[0].is_contiguous(memory_format=torch.channels_last)  # dx keeps the input's layout
    monkeypatch.setenv("EDGETRAIN_NATIVE", "0")
    for a, r in zip(got, _filtered_grads(x, weight, b, kw, radius, lambda y: y.mul(gy).sum())):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", WIDE[:2] + WIDE[4:6])
def test_weight_only_and_broadcast_output_gradient(cfg):
    """A frozen input (dW only) and ``y.sum()``, whose output gradient is an expanded tensor of stride 0."""
    _needs_native()
    x, weight, b, kw = _make32(cfg)
    got = _filtered_grads(x, weight, b, kw, 2, lambda y: y.sum(), x_grad=False)
    ref = _reference(x.double(), weight.double(), None if b is None else b.double(),
                     torch.ones(F.conv2d(x, weight, b, **kw).shape, dtype=torch.float64), 2, kw)
    for a, r in zip(got, [t for t in ref[1:] if t is not None]):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_pytorch_formulation_runs(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(native._NATIVE, "lib", None)
    monkeypatch.setattr(native._NATIVE, "failed", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.available(torch.zeros(1))
    assert "native kernels are unavailable" in caplog.text and "no-such-compiler" in caplog.text
    x, weight, b, kw = _make32(WIDE[0])
    got = _filtered_grads(x, weight, b, kw, 2, lambda y: y.sum())
    ref = _reference(x.double(), weight.double(), b.double(),
                     torch.ones(F.conv2d(x, weight, b, **kw).shape, dtype=torch.float64), 2, kw)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4)


def test_large_maps_pool_natively_and_keep_the_layout():
    _needs_native()
    x = torch.randn(2, 5, 33, 30).contiguous(memory_format=torch.channels_last)
    pooled = impl._mean_pool(x, 4)
    assert pooled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(pooled, F.avg_pool2d(x, 4, 4, ceil_mode=True))
    back = impl._mean_unpool(pooled, 33, 30, 4, channels_last=False)
    assert back.is_contiguous() and back.shape == x.shape
