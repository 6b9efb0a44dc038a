"""Lean BatchNorm (capture/lean_bn.py): PyTorch's values and gradients bit for bit, a two-tensor backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import edgetrain
from edgetrain.capture import capture, lean_bn
from edgetrain.capture.lean_bn import lean_batch_norm
from edgetrain.capture.rewrite import fresh_activation, rewrite
from edgetrain.models.zoo import ZOO, has_transformers


def _act(z: torch.Tensor, act: str) -> torch.Tensor:
    return {"none": z, "relu": torch.relu(z), "hardtanh": F.hardtanh(z, 0.0, 6.0)}[act]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("act", ["none", "relu", "hardtanh"])
@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(13, 8, 4, 6), (9, 8, 5, 7), (5, 8, 33), (3, 8, 2, 3, 5), (16, 8)])
def test_matches_batchnorm_and_activation(monkeypatch, native, act, owned, training, shape):
    """Forward, gradients and buffers equal autograd's bit for bit (native: the lean path; not: as written)."""
    monkeypatch.setenv("EDGETRAIN_NATIVE", "1" if native else "0")
    torch.manual_seed(0)
    ref = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)](8)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
        ref.running_mean.uniform_(-1, 1)
        ref.running_var.uniform_(0.5, 2)
    ref.train(training)
    ours = copy.deepcopy(ref)
    x0 = torch.randn(*shape) * 3 + 1
    g = torch.randn(*shape)
    xa = x0.clone().requires_grad_()
    ya = _act(ref(xa), act)
    ya.backward(g)
    xb = x0.clone().requires_grad_()
    yb = lean_batch_norm(xb * 1.0, ours, act, 0.0, 6.0, owned=owned)  # * 1.0: a tensor it may own
    lean = type(yb.grad_fn).__name__.startswith("_LeanBatchNormFn")
    assert lean == (native and len(shape) > 2)  # [N, C] planes of one element run as written
    yb.backward(g)
    assert torch.equal(ya, yb)  # the module's own forward
    for a, b in ((xa.grad, xb.grad), (ref.weight.grad, ours.weight.grad), (ref.bias.grad, ours.bias.grad)):
        assert torch.equal(a, b)
    for name, buf in ref.named_buffers():
        assert torch.equal(buf, ours.get_buffer(name)), name  # running statistics updated once, as PyTorch


def test_float64_and_frozen_layers_run_as_written():
    bn = nn.BatchNorm2d(3).double()
    x = torch.randn(4, 3, 2, 5, dtype=torch.float64, requires_grad=True)
    assert not type(lean_batch_norm(x * 1.0, bn, "relu").grad_fn).__name__.startswith("_Lean")
    bn = nn.BatchNorm2d(3).eval().requires_grad_(False)
    with torch.no_grad():
        assert lean_batch_norm(torch.randn(2, 3, 4, 4), bn, "relu").grad_fn is None


def test_the_self_check_finds_this_torch_and_rejects_other_roundings():
    """The kernel variant is chosen by comparing bits with ATen; a variant that rounds otherwise fails it."""
    variant = lean_bn.exact_variant()
    assert variant is not None  # CI's machines: lean BatchNorm must be on (the memory results depend on it)
    lib = lean_bn._library()
    lanes, seq, fma_dot, fma_dx = variant
    assert lean_bn._agrees(lib, variant)
    assert not lean_bn._agrees(lib, (lanes, seq, fma_dot, 1 - fma_dx))
    assert not lean_bn._agrees(lib, (lanes, 1 - seq, fma_dot, fma_dx))
    assert not lean_bn._agrees(lib, (24 - lanes, seq, fma_dot, fma_dx))


def test_owned_input_is_overwritten_and_a_second_saved_user_raises():
    """The gradient goes over an owned input; if anything else had saved it, autograd says so (never silent)."""
    bn = nn.BatchNorm2d(4)
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    c = x * 2.0
    square = c * c  # saves c too: the graph rewrite would never call c owned here
    y = lean_batch_norm(c, bn, "relu", owned=True)  # made later, so its backward runs first
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + square.sum()).backward()


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, 4 * c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4 * c)
        self.act = nn.ReLU6(inplace=True)
        self.conv2 = nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * c)
        self.conv3 = nn.Conv2d(4 * c, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return x + self.bn3(self.conv3(h))


def test_rewrite_fuses_and_owns_only_what_nothing_else_reads(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_LEAN_BN", "1")
    torch.manual_seed(0)
    block = _Block(4)
    gm = fx.symbolic_trace(copy.deepcopy(block))
    done = rewrite(gm)
    calls = [n for n in gm.graph.nodes if n.target is lean_batch_norm]
    assert done.batchnorms == 3 and len(calls) == 3
    assert [n.args[2] for n in calls] == ["hardtanh", "relu", "none"]
    assert all(n.kwargs["owned"] for n in calls)  # each reads a convolution's output, its only reader
    x = torch.randn(2, 4, 5, 5)
    assert torch.equal(gm(x), block(x))


def test_a_stage_owns_an_input_only_when_a_fused_activation_made_it(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_LEAN_BN", "1")
    model = nn.Sequential(_Block(4), _Block(4), _Block(4))
    chain = capture(model, (torch.randn(2, 4, 6, 6),))
    assert len(chain) > 1
    made = {n.name: n for st in chain.stages for n in st.fn.graph.nodes if n.op == "call_function"}
    owned_inputs = 0
    for st in chain.stages:
        for n in st.fn.graph.nodes:
            if n.op == "call_function" and n.kwargs.get("owned") and n.args[0].op == "placeholder":
                assert fresh_activation(made[str(n.args[0].target)]), st.name
                owned_inputs += 1
    assert owned_inputs  # the block's convolutions after a cut own what the BatchNorm's activation made


def _plain_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy((model(**x) if isinstance(x, dict) else model(x)).logits, y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
@pytest.mark.parametrize("name", ["hf-resnet", "hf-efficientnet"])
@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_hugging_face_cnn_step_matches_plain_pytorch(monkeypatch, name, solver):
    """A Hugging Face CNN built from its config: losses, parameters and every buffer are plain PyTorch's bits."""
    monkeypatch.setenv("EDGETRAIN_LEAN_BN", "1")
    case = ZOO[name]
    torch.manual_seed(0)
    ref = case.build()
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ours = copy.deepcopy(ref)
    x, y = case.example(8)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(out, target):
        return F.cross_entropy(out.logits, target)

    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), memory_budget="4GiB",
                             planning=edgetrain.PlanConfig(solver=solver))
    code = "".join(getattr(st.fn, "code", "") for st in step.chain.stages)
    assert "lean_batch_norm" in code
    for _ in range(3):
        assert step(x, y) == _plain_step(ref, opt_r, x, y)
    sr, so = ref.state_dict(), ours.state_dict()
    for k in sr:
        assert torch.equal(sr[k], so[k]), k  # bit for bit; num_batches_tracked advanced once per step
