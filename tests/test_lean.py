"""Graph rewrites and lean ops: in-place models, ReLU6 saving its output, batch-sliced conv backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import edgetrain
from edgetrain.capture.rewrite import keeps_input, rewrite
from edgetrain.capture import capture
from edgetrain.planners import solve
from edgetrain.capture.lean import lean_conv2d, lean_hardtanh


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> None:
    """Equal up to float32 summation order: the largest difference relative to the largest value."""
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-12)


def _grads(fn, *tensors):
    out = fn(*tensors)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    return out, torch.autograd.grad(out, [t for t in tensors if t.requires_grad], g)


@pytest.mark.parametrize("stride,padding,dilation,groups,bias", [
    (1, 1, 1, 1, True), (2, 1, 1, 1, False), (1, 0, 1, 1, True), (2, 1, 1, 8, False), (1, 2, 2, 2, True),
    (1, 1, 1, 8, True),
])
def test_sliced_conv_matches_conv2d(monkeypatch, stride, padding, dilation, groups, bias):
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", "4096")  # a few samples per slice
    torch.manual_seed(0)
    x = torch.randn(7, 8, 9, 9, requires_grad=True)
    w = torch.randn(16, 8 // groups, 3, 3, requires_grad=True)
    b = torch.randn(16, requires_grad=True) if bias else None
    args = (_pair(stride), _pair(padding), _pair(dilation), groups)
    ts = [t for t in (x, w, b) if t is not None]

    def lean(*t):
        return lean_conv2d(t[0], t[1], t[2] if bias else None, *args)

    def ref(*t):
        return F.conv2d(t[0], t[1], t[2] if bias else None, *args)

    y, g = _grads(lean, *ts)
    y_ref, g_ref = _grads(ref, *ts)
    _close(y, y_ref)  # oneDNN's sums may differ with the slice size: float32 rounding only
    for a, r in zip(g, g_ref):
        _close(a, r)


def test_sliced_conv_without_input_gradient(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", "4096")
    x = torch.randn(6, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    (gw,) = torch.autograd.grad(lean_conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1).sum(), [w])
    (gw_ref,) = torch.autograd.grad(F.conv2d(x, w, None, 1, 1).sum(), [w])
    _close(gw, gw_ref)


def test_chunk_setting_is_validated(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="EDGETRAIN_CONV_CHUNK_BYTES"):
        lean_conv2d(torch.randn(1, 1, 3, 3), torch.randn(1, 1, 1, 1), None, (1, 1), (0, 0), (1, 1), 1)


def test_profiles_cached_under_one_slice_limit_are_not_reused_under_another(monkeypatch):
    from edgetrain.profile.stages import _cache_key

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    chain = capture(model, x)
    env = {"input": x}
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", str(8 << 20))
    a = _cache_key(chain, model, env, (1, 2))
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", "0")
    assert _cache_key(chain, model, env, (1, 2)) != a


def test_hardtanh_saving_output_has_pytorchs_gradient_bit_for_bit():
    x = torch.tensor([-1.0, 0.0, 1e-8, 3.0, 6.0, 6.5, float("inf")]).repeat(3).requires_grad_()
    g = torch.arange(21, dtype=torch.float32)
    (a,) = torch.autograd.grad(lean_hardtanh(x, 0.0, 6.0), [x], g)
    (b,) = torch.autograd.grad(F.relu6(x), [x], g)
    assert torch.equal(a, b)
    assert torch.equal(lean_hardtanh(x.detach(), -1.0, 1.0), F.hardtanh(x.detach()))


class _InPlace(nn.Module):
    """Every in-place form fx records, including a side effect read through the old name."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU6(inplace=True)
        self.relu = nn.ReLU(inplace=True)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.conv(x)))
        y = self.relu(y - 1.0)
        y = F.relu(y * 2.0, inplace=True)
        z = y.mul_(0.5)
        torch.relu_(z)          # result unused: later readers of z must see it
        z.add_(x.mean())
        v = z[:, :2]
        v.mul_(3.0)             # a view: left in place (it writes into z)
        return F.hardtanh(z, 0.0, 6.0).flatten(1)


def test_rewrite_makes_in_place_ops_out_of_place_with_the_same_values():
    torch.manual_seed(0)
    model = _InPlace()
    x = torch.randn(2, 3, 5, 5)
    gm = fx.symbolic_trace(copy.deepcopy(model))
    done = rewrite(gm)
    assert (done.inplace, done.activations, done.convs) == (6, 1, 1)  # ReLU6(inplace) counts as in-place
    kinds = [(n.op, str(n.target)) for n in gm.graph.nodes]
    assert ("call_method", "mul_") in kinds  # the write through a view stays
    assert not any(t.endswith("relu_") or t == "add_" for _, t in kinds)
    assert torch.equal(gm(x), model(x))


def test_no_cut_before_an_op_that_frees_its_input():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))
    chain = capture(model, torch.randn(2, 3, 8, 8))
    starts = [st.name for st in chain.stages]
    assert not any(name.startswith("2") for name in starts), starts  # nothing starts at the ReLU
    gm = fx.symbolic_trace(model)
    relu = next(n for n in gm.graph.nodes if n.target == "2")
    assert not keeps_input(gm, relu)


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all", "chen_sqrt"])
def test_in_place_models_train_exactly(monkeypatch, solver):
    """torchvision-style in-place ResNet-18, every conv backward sliced: the step is plain PyTorch's."""
    monkeypatch.setenv("EDGETRAIN_CONV_CHUNK_BYTES", "65536")
    torch.manual_seed(0)
    model = edgetrain.models.resnet18(num_classes=10, in_channels=3, small_input=True)
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = edgetrain.prepare(model, opt, F.cross_entropy, (x, y), memory_budget="4GiB",
                             micro_batch_size=8, use_cache=False)
    step.set_plan(solve(step.costs, 10**12, solver=solver, micro_batch_sizes=[8]))
    loss = step(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    for a, b in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _pair(v: int) -> tuple[int, int]:
    return (v, v)


def test_no_cut_after_a_view_or_before_an_add():
    """A reshape's output shares its source's bytes; an add and dropout need none of their inputs."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).view(-1, 4, 2).view(-1, 8)
            return x + self.drop(self.b(h))

    chain = capture(Block(), torch.randn(4, 8))
    names = [st.name for st in chain.stages]
    assert names == ["a", "b..drop"], names  # no cut after the views, none before the dropout
