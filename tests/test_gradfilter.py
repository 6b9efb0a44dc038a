"""Gradient filtering: exactness at radius 1, agreement with an independent reference, memory, API."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight

import edgetrain.approx.gradfilter._dense as dense
import edgetrain.approx.gradfilter._impl as impl
from edgetrain.approx import (
    FilteredConv2d, GradFilter, apply_grad_filter, auto_grad_filter, estimate_costs, filtered_conv2d,
    remove_grad_filter,
)
from edgetrain.errors import BudgetError
from edgetrain.models.resnet import BasicBlock

# (H, W, C, O, groups, kernel, stride, padding, dilation, bias)
CONFIGS = [
    (8, 8, 4, 6, 1, 3, 1, 1, 1, True),
    (9, 7, 4, 6, 1, 3, 2, 1, 1, False),
    (10, 11, 6, 6, 6, 3, 1, 1, 1, True),      # depthwise
    (11, 9, 6, 6, 6, 3, 2, 1, 1, False),      # depthwise, stride 2
    (12, 12, 4, 8, 2, 3, 1, 2, 2, True),      # grouped, dilated
    (7, 7, 4, 4, 1, 1, 2, 0, 1, False),       # 1x1 stride 2 (ResNet shortcut)
    (13, 10, 3, 5, 1, 5, 3, 2, 1, True),
    (6, 6, 4, 4, 4, 3, 1, 0, 2, False),
    (5, 9, 2, 3, 1, (2, 3), (1, 2), (1, 0), (1, 2), True),
    (2, 2, 4, 4, 1, 3, 1, 1, 1, False),       # map smaller than the patch
    (16, 16, 8, 8, 1, 1, 1, 0, 1, True),      # 1x1 stride 1
    (20, 18, 4, 4, 1, 3, 1, 1, 1, False),     # coarse map above the dense threshold at r=2
]
PATHS = ["dense", "convolution"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run each test through both backward implementations (GEMMs on small maps, convolutions)."""
    if request.param == "convolution":
        monkeypatch.setattr(impl, "_DENSE_MAX_COARSE", 0)
    return request.param


def _make(cfg, dtype=torch.float64, seed=0):
    h, w, c, o, g, k, s, p, d, bias = cfg
    gen = torch.Generator().manual_seed(seed)
    kk = (k, k) if isinstance(k, int) else k
    x = torch.randn(2, c, h, w, dtype=dtype, generator=gen, requires_grad=True)
    weight = torch.randn(o, c // g, *kk, dtype=dtype, generator=gen, requires_grad=True)
    b = torch.randn(o, dtype=dtype, generator=gen, requires_grad=True) if bias else None
    return x, weight, b, dict(stride=s, padding=p, dilation=d, groups=g)


def _grads(y, x, weight, b, gy):
    inputs = [x, weight] + ([b] if b is not None else [])
    out = torch.autograd.grad(y, inputs, gy)
    return list(out) + ([None] if b is None else [])


def _project(t, r):
    """P: every value replaced by the mean of its r x r patch (ceil mode, real positions only)."""
    h, w = t.shape[-2:]
    sums = F.avg_pool2d(t, r, r, ceil_mode=True, divisor_override=1)
    counts = F.avg_pool2d(torch.ones_like(t[:1, :1]), r, r, ceil_mode=True, divisor_override=1)
    means = sums / counts
    return means.repeat_interleave(r, -2).repeat_interleave(r, -1)[..., :h, :w]


def _reference(x, weight, b, gy, r, kw):
    """Exact gradients of P_out(conv(P_in x)) at full resolution (no coarse maps anywhere)."""
    gy_t = _project(gy, r)
    gw = conv2d_weight(_project(x, r), weight.shape, gy_t, **kw)
    gx = _project(conv2d_input(x.shape, weight, gy_t, **kw), r)
    return gx, gw, (gy.sum((0, 2, 3)) if b is not None else None)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_radius_one_is_exact_backprop(cfg, path):
    x, weight, b, kw = _make(cfg, torch.float32)
    y0 = F.conv2d(x, weight, b, **kw)
    gy = torch.randn_like(y0)
    y = filtered_conv2d(x, weight, b, radius=1, **kw)
    assert torch.equal(y, y0)
    for got, want in zip(_grads(y, x, weight, b, gy), _grads(y0, x, weight, b, gy)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("radius", [2, 4])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_full_resolution_reference(cfg, radius, path):
    x, weight, b, kw = _make(cfg)
    y = filtered_conv2d(x, weight, b, radius=radius, **kw)
    torch.testing.assert_close(y, F.conv2d(x, weight, b, **kw))
    gy = torch.randn_like(y)
    got = _grads(y, x, weight, b, gy)
    want = _reference(x.detach(), weight.detach(), b, gy, radius, kw)
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] % 2 == 0 and c[1] % 2 == 0])
def test_equals_autograd_of_projected_layer(cfg):
    """On maps divisible by r: the exact gradients of y_s = P_out(conv(P_in x)), by autograd."""
    x, weight, b, kw = _make(cfg)
    y = filtered_conv2d(x, weight, b, radius=2, **kw)
    gy = torch.randn_like(y)
    if y.shape[-1] % 2 or y.shape[-2] % 2:
        pytest.skip("output not divisible by r")
    surrogate = _project(F.conv2d(_project(x, 2), weight, b, **kw), 2)
    for g, w in zip(_grads(y, x, weight, b, gy), _grads(surrogate, x, weight, b, gy)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 13), w=st.integers(1, 13), k=st.integers(1, 4), s=st.integers(1, 3),
       d=st.integers(1, 2), p=st.integers(0, 2), r=st.integers(1, 4), g=st.sampled_from([1, 2, 4]))
def test_random_geometries_match_reference(h, w, k, s, d, p, r, g):
    if h + 2 * p < d * (k - 1) + 1 or w + 2 * p < d * (k - 1) + 1:
        return  # no output
    x, weight, b, kw = _make((h, w, 4, 4, g, k, s, p, d, True), seed=h * 100 + w)
    y = filtered_conv2d(x, weight, b, radius=r, **kw)
    gy = torch.randn_like(y)
    for got, want in zip(_grads(y, x, weight, b, gy), _reference(x.detach(), weight.detach(), b, gy, r, kw)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_frozen_weight_and_no_grad_mode(path):
    x, weight, b, kw = _make(CONFIGS[1])
    y = filtered_conv2d(x, weight.detach(), None, radius=2, **kw)  # frozen weight: input gradient only
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, [x], gy)
    torch.testing.assert_close(gx, _reference(x.detach(), weight.detach(), None, gy, 2, kw)[0])
    with torch.no_grad():
        assert filtered_conv2d(x, weight, b, radius=2, **kw).grad_fn is None


def test_channels_last_input_gives_the_same_gradients():
    x, weight, b, kw = _make(CONFIGS[0])
    y = filtered_conv2d(x, weight, b, radius=2, **kw)
    gy = torch.randn_like(y)
    want = _grads(y, x, weight, b, gy)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    y_cl = filtered_conv2d(x_cl, weight, b, radius=2, **kw)
    got = _grads(y_cl, x_cl, weight, b, gy.contiguous(memory_format=torch.channels_last))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[3], CONFIGS[5], CONFIGS[10]],
                         ids=["depthwise", "depthwise-s2", "1x1-s2", "1x1"])
def test_channels_last_dense_paths_match_reference_and_keep_the_layout(cfg, path):
    """Depthwise and 1x1 convs on channels-last tensors: same gradients, input gradient stored N,H,W,C."""
    x, weight, b, kw = _make(cfg)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    y = filtered_conv2d(x_cl, weight, b, radius=2, **kw)
    gy = torch.randn_like(y).contiguous(memory_format=torch.channels_last)
    got = _grads(y, x_cl, weight, b, gy)
    for g, w in zip(got, _reference(x.detach(), weight.detach(), b, gy.contiguous(), 2, kw)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    if path == "dense":
        assert got[0].is_contiguous(memory_format=torch.channels_last) and not got[0].is_contiguous()


@pytest.mark.parametrize("x_cl", [True, False], ids=["x-cl", "x-nchw"])
@pytest.mark.parametrize("cfg", [CONFIGS[5], CONFIGS[10], CONFIGS[2]], ids=["1x1-s2", "1x1", "depthwise"])
def test_input_and_output_gradient_in_different_layouts(cfg, x_cl, path):
    """The pooled input and dL/dy are read in whichever layout each has; dL/dx keeps the input's."""
    x, weight, b, kw = _make(cfg)
    fmt = torch.channels_last
    x_in = (x.detach().contiguous(memory_format=fmt) if x_cl else x.detach()).requires_grad_()
    y = filtered_conv2d(x_in, weight, b, radius=2, **kw)
    gy = torch.randn_like(y, memory_format=torch.contiguous_format)
    gy = gy if x_cl else gy.contiguous(memory_format=fmt)
    got = _grads(y, x_in, weight, b, gy)
    for g, w in zip(got, _reference(x.detach(), weight.detach(), b, gy.contiguous(), 2, kw)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=["dense", "depthwise"])
def test_bias_only_gradient_is_the_exact_sum(cfg, path):
    x, weight, b, kw = _make(cfg)
    y = filtered_conv2d(x.detach(), weight.detach(), b, radius=2, **kw)
    gy = torch.randn_like(y)
    (gb,) = torch.autograd.grad(y, [b], gy)
    torch.testing.assert_close(gb, gy.sum((0, 2, 3)), rtol=1e-10, atol=1e-10)


def test_tap_matrix_orders_are_the_same_matrix():
    """The per-position stacks the dense backward reads are permutations of T[(p, q, I, J), (U, V)]."""
    x_shape, w_shape, y_shape = (2, 4, 9, 7), (6, 4, 3, 3), (2, 6, 5, 4)
    ah, aw = impl.coarse_geometry(x_shape, w_shape, y_shape, (2, 2), (1, 1), (1, 1), 2)
    flat = dense.tap_matrix(ah, aw, 3, 3, torch.float64, torch.device("cpu"))
    l_out, l_in = ah.n_out_c * aw.n_out_c, ah.n_in_c * aw.n_in_c
    t = flat.view(9, l_out, l_in)
    iu_tap = dense.tap_matrix(ah, aw, 3, 3, torch.float64, torch.device("cpu"), "i,u,tap")
    i_tap_u = dense.tap_matrix(ah, aw, 3, 3, torch.float64, torch.device("cpu"), "i,tap,u")
    assert torch.equal(iu_tap, t.permute(1, 2, 0)) and torch.equal(i_tap_u, t.permute(1, 0, 2))
    assert iu_tap.is_contiguous() and i_tap_u.is_contiguous() and flat.sum() > 0


def test_flop_estimate_counts_kernel_taps_when_fewer_than_coarse_taps():
    """A 1x1 stride-2 conv reads 2 x 2 coarse inputs per coarse output, but all with the same weight."""
    from edgetrain.approx.gradfilter.trace import conv2d_backward_flops
    args = ((8, 256, 16, 16), (512, 256, 1, 1), (8, 512, 8, 8), (2, 2), (0, 0), (1, 1))
    exact, r2 = conv2d_backward_flops(*args, None), conv2d_backward_flops(*args, 2)
    assert 3.5 < exact / r2 < 4  # r^2 fewer products, plus the gathering and pooling adds
    args3 = ((8, 64, 8, 8), (64, 64, 3, 3), (8, 64, 8, 8), (1, 1), (1, 1), (1, 1))
    ah, aw = impl.coarse_geometry(*args3, 2)
    assert ah.k_c * aw.k_c == 9  # 3x3: as many coarse taps as kernel taps, the coarse formula
    assert 3.5 < conv2d_backward_flops(*args3, None) / conv2d_backward_flops(*args3, 2) <= 4


def test_reapply_and_remove_on_a_copy():
    model = _small_cnn()
    apply_grad_filter(model, GradFilter(radius=2, last_n=1))
    report = apply_grad_filter(model, GradFilter(radius=4, last_n=2))  # replaces the first filter
    assert report.layers == ("6", "9") and model[9].grad_filter_radius == 4
    assert model[0].weight.requires_grad is False
    clone = copy.deepcopy(model)
    assert remove_grad_filter(clone) == ("6", "9") and type(clone[9]) is nn.Conv2d


def _saved_activation_bytes(fn, params=()):
    """Unique storages saved for backward while running fn, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("radius,fraction", [(2, 1 / 4), (4, 1 / 16)])
def test_saves_only_the_pooled_input(radius, fraction):
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    weight = nn.Parameter(torch.randn(8, 8, 3, 3))
    exact, _ = _saved_activation_bytes(lambda: F.conv2d(x, weight, padding=1), [weight])
    filt, _ = _saved_activation_bytes(lambda: filtered_conv2d(x, weight, padding=1, radius=radius), [weight])
    assert exact == x.numel() * 4
    assert filt == exact * fraction
    weight.requires_grad_(False)  # frozen weight: the input gradient needs no activation at all
    frozen, _ = _saved_activation_bytes(lambda: filtered_conv2d(x, weight, padding=1, radius=radius), [weight])
    assert frozen == 0


def _small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))


def test_apply_keeps_parameters_and_freezes_earlier_layers():
    model = _small_cnn()
    x = torch.randn(4, 3, 16, 16)
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    expected = model(x)
    report = apply_grad_filter(model, GradFilter(radius=2, last_n=2), x)
    assert report.layers == ("6", "9")
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert isinstance(model[6], FilteredConv2d) and isinstance(model[0], nn.Conv2d)
    assert set(report.frozen) == {"0.weight", "1.weight", "1.bias", "3.weight", "4.weight", "4.bias"}
    assert all(not params[n].requires_grad for n in report.frozen)
    assert params["6.weight"].requires_grad and params["7.weight"].requires_grad
    torch.testing.assert_close(model(x), expected)  # forward unchanged (same BN batch statistics)
    assert [c.name for c in report.costs] == ["6", "9"]
    assert remove_grad_filter(model) == ("6", "9")
    assert type(model[6]) is nn.Conv2d and all(p.requires_grad for p in model.parameters())
    assert remove_grad_filter(model) == ()


def test_radius_one_model_gradients_equal_exact():
    model = _small_cnn()
    exact = copy.deepcopy(model)
    apply_grad_filter(model, GradFilter(radius=1, last_n=None, freeze_earlier=False))
    x = torch.randn(4, 3, 16, 16)
    model(x).square().sum().backward()
    exact(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), exact.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_named_layers_and_padding_modes():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                          nn.Conv2d(4, 4, 4, padding="same"), nn.Conv2d(4, 2, 3, padding="valid"))
    exact = copy.deepcopy(model)
    report = apply_grad_filter(model, GradFilter(radius=1, layers=("2", "0", "3"), freeze_earlier=False))
    assert report.layers == ("0", "2", "3")
    x = torch.randn(2, 3, 9, 9)
    model(x).sum().backward()
    exact(x).sum().backward()
    for p, q in zip(model.parameters(), exact.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_errors_say_what_to_do():
    model = _small_cnn()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="radius"):
            GradFilter(radius=bad)
    with pytest.raises(ValueError, match="last_n"):
        GradFilter(last_n=0)
    with pytest.raises(ValueError, match="not a module"):
        apply_grad_filter(model, GradFilter(layers=("nope",)))
    with pytest.raises(ValueError, match="only nn.Conv2d"):
        apply_grad_filter(model, GradFilter(layers=("1",)))
    with pytest.raises(ValueError, match="radius"):
        filtered_conv2d(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3), radius=0)

    class Custom(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(ValueError, match="overrides forward"):
        apply_grad_filter(nn.Sequential(Custom(1, 1, 3)), GradFilter(last_n=1))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        apply_grad_filter(model, GradFilter())
    assert all(type(m) is not FilteredConv2d for m in model.modules())


def test_symbolic_trace_records_the_filtered_call():
    model = _small_cnn().eval()
    apply_grad_filter(model, GradFilter(last_n=2))
    traced = torch.fx.symbolic_trace(model)
    assert sum(n.target is filtered_conv2d for n in traced.graph.nodes) == 2
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(traced(x), model(x))


def _step_saved_bytes(model, x):
    return _saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()))[0]


@pytest.mark.parametrize("radius", [2, 4])
def test_estimates_match_measured_saved_bytes(radius):
    """estimate_costs predicts the measured change, including tensors a ReLU also keeps."""
    torch.manual_seed(0)  # the end of a ResNet-18 (layer4), narrow: same structure, fast
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          BasicBlock(8, 16, stride=2), BasicBlock(16, 16), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 4))
    x = torch.randn(2, 3, 16, 16)  # block maps are 8x8
    config = GradFilter(radius=radius, last_n=4)
    costs = estimate_costs(model, x, config)
    report = apply_grad_filter(copy.deepcopy(model), config)  # freeze on a copy to measure exact
    exact_model = copy.deepcopy(model)
    for name, p in exact_model.named_parameters():
        p.requires_grad_(name not in report.frozen)
    filtered = copy.deepcopy(exact_model)
    apply_grad_filter(filtered, GradFilter(radius=radius, layers=report.layers, freeze_earlier=False))
    exact_bytes, filtered_bytes = _step_saved_bytes(exact_model, x), _step_saved_bytes(filtered, x)
    assert exact_bytes - filtered_bytes == sum(c.freed_bytes for c in costs)
    # inputs of layer4.0's conv2 and shortcut come from the frozen part: no input gradient there
    assert {c.name: c.needs_input_grad for c in costs} == {
        "3.conv2": False, "3.downsample.0": False, "4.conv1": True, "4.conv2": True}
    shared = {c.name: not c.input_freed for c in costs}
    assert shared["4.conv1"] and shared["4.conv2"]  # inputs are ReLU outputs the ReLU keeps too
    assert not shared["3.conv2"]  # its ReLU is in front of the frozen part: saves nothing
    for c in costs:
        n, ch, h, w = c.input_shape
        assert c.saved_bytes_exact == n * ch * h * w * 4
        ho, wo = c.output_shape[2:]
        gh, gw = (ho, wo) if c.name.endswith("downsample.0") else (h, w)  # 1x1 stride 2 keeps T X
        assert c.saved_bytes_filtered == n * ch * -(-gh // radius) * -(-gw // radius) * 4
    conv3x3 = [c for c in costs if c.name.endswith("conv2")]  # 8x8 maps: r^2 fewer positions
    assert all(0.9 * radius**2 < c.flops_ratio <= radius**2 for c in conv3x3)


def test_auto_mode_picks_the_smallest_suffix_that_meets_the_target():
    """With the FLOPs model (deterministic); measured timing: tests/test_gradfilter_auto.py."""
    model = _small_cnn()
    x = torch.randn(4, 3, 16, 16)
    config = auto_grad_filter(model, x, target_speedup=1.5, timing="flops")
    assert config.freeze_earlier is False and config.radius in (2, 4)

    def speedup(n, r):
        from edgetrain.approx.gradfilter.trace import layer_costs, trace_model
        trace = trace_model(model, x, record_saved=True)
        convs = [m for m in trace.order if isinstance(model.get_submodule(m), nn.Conv2d)]
        costs = layer_costs(trace, convs[-n:], r)
        saved = sum(c.backward_flops_exact - c.backward_flops_filtered for c in costs)
        return trace.backward_flops / (trace.backward_flops - saved)

    assert speedup(config.last_n, config.radius) >= 1.5
    assert all(speedup(n, r) < 1.5 for n in range(1, config.last_n) for r in (2, 4))
    if config.radius == 4:
        assert speedup(config.last_n, 2) < 1.5
    bigger = auto_grad_filter(model, x, target_speedup=2.5, timing="flops")
    assert (bigger.last_n, bigger.radius) > (config.last_n, config.radius)
    with pytest.raises(BudgetError, match="best reachable"):
        auto_grad_filter(model, x, target_speedup=1000.0, timing="flops")
    with pytest.raises(ValueError, match="target"):
        auto_grad_filter(model, x)
    budget = _step_saved_bytes(model, x) - 1
    by_bytes = auto_grad_filter(model, x, target_saved_bytes=budget, timing="flops")
    filtered = copy.deepcopy(model)
    apply_grad_filter(filtered, by_bytes)
    assert _step_saved_bytes(filtered, x) <= budget
