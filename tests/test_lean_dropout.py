"""Lean dropout (capture/lean_dropout.py): torch.dropout's masks, values, gradients and generator stream, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import edgetrain
from edgetrain.capture import lean_dropout as ld
from edgetrain.capture.draws import dropout_module_site, dropout_site
from edgetrain.capture.rewrite import rewrite
from edgetrain.models.zoo import ZOO

needs_kernel = pytest.mark.skipif(not ld.available(), reason="torch draws dropout masks otherwise on this CPU "
                                                              "(MKL's Bernoulli): lean dropout stays off")


@needs_kernel
@pytest.mark.parametrize("shape", [(1,), (13,), (64, 28, 32), (3, 4, 5, 7), (2000,)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.77])
def test_same_output_gradient_and_generator_stream_as_torch(shape, p):
    torch.manual_seed(sum(shape))
    x0 = torch.randn(*shape)
    g = torch.randn(*shape)
    start = torch.get_rng_state()
    xa = x0.clone().requires_grad_()
    ya = torch.dropout(xa * 1.0, p, True)
    ya.backward(g)
    after = torch.get_rng_state()
    next_a = torch.rand(3)
    torch.set_rng_state(start)
    xb = x0.clone().requires_grad_()
    yb = ld.lean_dropout(xb * 1.0, p, True)
    assert type(yb.grad_fn).__name__.startswith("_LeanDropoutFn")
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(torch.rand(3), next_a)  # what is drawn next is plain PyTorch's too


@needs_kernel
def test_no_grad_and_the_cases_it_leaves_to_torch():
    x = torch.randn(4, 6)
    for args in ((x, 0.3, True), (x.double(), 0.3, True), (x.t(), 0.3, True), (x, 1.0, True), (x, 0.0, True)):
        torch.manual_seed(1)
        a = torch.dropout(*args)
        torch.manual_seed(1)
        assert torch.equal(ld.lean_dropout(*args), a)
    assert ld.lean_dropout(x, 0.3, False) is x  # eval: the input itself, as torch.dropout returns it


def test_the_self_check_rejects_other_values(monkeypatch):
    """The check compares with torch.dropout bit for bit: a kernel off by one ulp in the scale fails it."""
    if ld._library() is None:
        pytest.skip("no C compiler")
    x, g = torch.randn(300), torch.randn(300)
    with torch.random.fork_rng(devices=[]):
        assert ld._reference_and_ours(x, 0.1, g) == ld.available()
        true_scale = ld._scale
        monkeypatch.setattr(ld, "_scale", lambda p: float(torch.nextafter(torch.tensor(true_scale(p)),
                                                                          torch.tensor(2.0))))
        assert not ld._reference_and_ours(x, 0.1, g)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.2)
        self.drop_inplace = nn.Dropout(0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        h = F.dropout(h, 0.3, self.training)
        return self.b(self.drop_inplace(h * 2.0))


@needs_kernel
def test_rewrite_replaces_out_of_place_dropout_and_keeps_values():
    net = _Net()
    gm = fx.symbolic_trace(copy.deepcopy(net))
    plain_gm = fx.symbolic_trace(copy.deepcopy(net))  # F.dropout's training flag is baked in at trace time
    done = rewrite(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # the in-place module is made out-of-place first (pass 1), then a dropout site (lean dropout) like the others
    assert done.inplace == 1 and done.dropouts == 3
    assert targets.count(dropout_module_site) == 2 and dropout_site in targets
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and "drop" in str(n.target)]
    x = torch.randn(5, 8)
    torch.manual_seed(3)
    a = net(x)
    torch.manual_seed(3)
    assert torch.equal(gm(x), a)
    plain_gm.eval()
    gm.eval()  # the modules' dropout reads the flag at run time, as nn.Dropout does
    torch.manual_seed(4)
    a = plain_gm(x)
    torch.manual_seed(4)
    assert torch.equal(gm(x), a)


def _logits(out):
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


def _plain_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    out = model(**x) if isinstance(x, dict) else model(x)
    loss = F.cross_entropy(_logits(out), y)
    loss.backward()
    opt.step()
    return loss.item()


@needs_kernel
@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_transformer_with_dropout_trains_as_plain_pytorch(solver):
    """A timm-style ViT (dropout 0.1, traced by fx): every step's loss and the final parameters are plain
    PyTorch's bits (recomputed stages replay the same masks), with the dropouts lean."""
    case = ZOO["timm-vit"]
    torch.manual_seed(0)
    ref = case.build()
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in ref.modules())
    ours = copy.deepcopy(ref)
    x, y = case.example(8)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(out, target):
        return F.cross_entropy(_logits(out), target)

    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), memory_budget="4GiB",
                             planning=edgetrain.PlanConfig(solver=solver))
    code = "".join(getattr(st.fn, "code", "") for st in step.chain.stages)
    assert ("dropout_site" in code or "dropout_module_site" in code) and ld.available()  # sites run lean dropout
    for i in range(3):
        torch.manual_seed(100 + i)
        lr = _plain_step(ref, opt_r, x, y)
        torch.manual_seed(100 + i)
        assert step(x, y) == lr
    sr, so = ref.state_dict(), ours.state_dict()
    for k in sr:
        assert torch.equal(sr[k], so[k]), k
