"""What a forward does beyond its values, kept by capture and recomputation: ops that write into an argument
autograd saves (nn.RReLU), torch.no_grad blocks and custom autograd Functions inside the forward, hooks on
the modules a trace would run through, blocks writing into their inputs (attributes and globals set between
steps: test_traced_settings.py)."""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import edgetrain

from _semantics import Stack, assert_same_state, plain_step, prepared


def test_rrelu_recomputed_on_its_own_gets_exact_gradients():
    """nn.RReLU fills the noise tensor it hands rrelu_with_noise, which autograd saved before the kernel ran; a
    checkpoint replay stopping at the last saved tensor skipped the kernel, and backward read an unfilled tensor
    (gradients of 1e19-1e35, no error) whenever the RReLU stage was recomputed without a later op."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.RReLU(), nn.Linear(32, 32), nn.RReLU(), nn.Linear(32, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, solver="no_saving")
    assert len(step.chain) == 5
    start = copy.deepcopy(m.state_dict())
    for policies in itertools.product(("keep", "recompute"), repeat=5):
        if "recompute" not in policies:
            continue
        m.load_state_dict(start)  # every plan takes the same step from the same weights
        for p in m.parameters():
            p.grad = None
        step.set_plan(step.plan.replace(policies=policies))
        torch.manual_seed(5)
        step(x, y)
        assert_same_state(plain, m)


class _Distilled(nn.Module):
    """A student fed a frozen teacher's output, the teacher run under torch.no_grad inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hint = self.teacher(x)
        return self.student(x + hint)


def test_a_no_grad_block_in_the_forward_is_not_trained():
    """torch.fx does not record torch.no_grad: the traced graph gave the teacher gradients, and SGD moved it
    (2.9e-3)."""
    torch.manual_seed(0)
    model = _Distilled()
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, solver="recompute_all")
    assert "recompute" in step.plan.policies
    torch.manual_seed(5)
    step(x, y)
    assert all(p.grad is None for p in m.teacher.parameters())
    assert_same_state(plain, m)


class _StraightThrough(torch.autograd.Function):
    """Rounding with an identity gradient (quantisation-aware training's straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class _GradientReversal(torch.autograd.Function):
    """Identity forward, negated and halved gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return -0.5 * g


class _CustomBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = torch.relu(b(h))
            h = _StraightThrough.apply(h) if i % 2 == 0 else _GradientReversal.apply(h)
        return self.head(h)


def test_custom_autograd_functions_keep_their_backward_when_recomputed():
    """torch.fx traces a custom Function's forward ops and differentiates those (rounding: zero gradient;
    reversal: identity), so recompute-all trained with other gradients (6.3e-3 off after one SGD step); the
    model now runs as its blocks, through its own forward."""
    torch.manual_seed(0)
    model = _CustomBackward()
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, solver="recompute_all")
    assert step.chain.method == "modules"
    assert "recompute" in step.plan.policies
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain, m)


class _InPlaceResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.lin(torch.relu(x))  # written into the tensor it was handed (nothing saved it)
        return x


class _UntraceableStack(nn.Module):
    """Three blocks called in a forward torch.fx cannot trace: the blocks are the stages."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if float(h.abs().sum()) > 1e9:  # data-dependent: torch.fx cannot trace it, blocks are the stages
            h = h / 2
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_blocks_writing_into_their_input_are_not_recomputed():
    """A checkpoint holds a block's input to replay it; a block that writes into that input made recompute-all
    fail at the step with autograd's 'modified by an inplace operation' from deep in torch."""
    torch.manual_seed(0)
    model = _UntraceableStack(_InPlaceResidual)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    m, step = prepared(model, x, y, solver="recompute_all")
    assert step.chain.method == "single" and "writing into none of them" in step.chain.warning
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain_step(model, x, y), m)


def test_hooks_on_traced_through_modules_still_run():
    """A trace runs a hook on a module it traces through once, while tracing: a backward hook halving a
    block's input gradients was dropped by traced stages. Such a model now runs as its blocks."""
    torch.manual_seed(0)
    model = Stack()
    model.blocks[1].register_full_backward_hook(lambda mod, gin, gout: tuple(g * 0.5 for g in gin))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = plain_step(model, x, y)
        m, step = prepared(model, x, y, solver="recompute_all")
        assert step.chain.method != "fx"
        torch.manual_seed(5)
        step(x, y)
    assert_same_state(plain, m)


def test_rrelu_blocks_of_the_module_tree_are_recomputed_exactly():
    """The module-tree capture learns of argument-writing ops from the loss check's forward; each block ends in
    an RReLU, whose noise is the last tensor its replay saves."""
    torch.manual_seed(0)
    model = _UntraceableStack(lambda: nn.Sequential(nn.Linear(32, 32), nn.RReLU()))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, solver="recompute_all")
    assert step.chain.method == "modules" and not step.chain.early_stop
    assert "recompute" in step.plan.policies
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain, m)


class _ScalesItsInput(nn.Module):
    """Scales its input in place (``x.div_(255)``, preprocessing written into the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.div_(255)
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def test_prepare_leaves_an_example_the_forward_writes_into_as_it_was():
    """prepare ran the model on the example a dozen times, dividing the caller's tensor by 255 each time: a
    step on that example then trained on zeros, silently. Now prepare works on a copy and says so; the step
    writes into its batch once, as plain PyTorch's forward does."""
    torch.manual_seed(0)
    x0, y = torch.randn(8, 16) * 255, torch.randint(0, 3, (8,))
    model = _ScalesItsInput()
    x = x0.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = copy.deepcopy(model)
        step = edgetrain.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                                 memory_budget="1GiB")
    assert torch.equal(x, x0)
    assert any("writes into its input(s) x in place" in str(w.message) for w in caught)
    torch.manual_seed(5)
    step(x, y)
    x_plain = x0.clone()
    assert_same_state(plain_step(model, x_plain, y), m)
    assert torch.equal(x, x_plain)  # divided once, by each


class _ScriptedMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(16, 32), nn.Linear(32, 3)
        self.mid = torch.jit.script(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(torch.relu(self.a(x))))


def test_a_torchscript_submodule_is_recomputed_to_its_end():
    """A checkpoint stops its replay by raising from a saved-tensor hook; inside the TorchScript interpreter the
    exception became a RuntimeError the checkpoint did not know, and every step recomputing a scripted
    submodule failed in backward. The chain now replays such stages to their end."""
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    torch.manual_seed(0)
    ref = _ScriptedMiddle()  # scripted modules do not deep-copy: each model is built from the same seed
    torch.manual_seed(0)
    model = _ScriptedMiddle()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y),
                                 planning=edgetrain.PlanConfig(solver="recompute_all"))
    assert len(step.chain) > 1 and "recompute" in step.plan.policies and not step.chain.early_stop
    for i in range(2):
        torch.manual_seed(i)
        opt_ref.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        opt_ref.step()
        torch.manual_seed(i)
        step(x, y)
    assert_same_state(ref, model)


class _OwnCheckpoint(nn.Module):
    """A model that checkpoints a block itself, the reentrant way (torch.utils.checkpoint's old default)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.2), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, torch.relu(self.a(x)), use_reentrant=True)
        return self.head(torch.tanh(self.c(h)))


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_a_models_own_reentrant_checkpoint_trains_exactly(solver):
    """The model's reentrant checkpoint runs its block again inside the backward, through the block's hooks:
    profiling counted that as a second call of the block and refused the model ("block block.0 ran 2
    time(s)"), and capture's forwards without gradients made torch warn five times."""
    torch.manual_seed(0)
    model = _OwnCheckpoint()
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = edgetrain.prepare(m, opt, nn.CrossEntropyLoss(), example=(x, y),
                                 planning=edgetrain.PlanConfig(solver=solver))
    assert not [w for w in caught if "requires_grad" in str(w.message)], [str(w.message) for w in caught]
    assert step.chain.method != "single" and ("recompute" in step.plan.policies) == (solver == "recompute_all")
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain, m)


class _ScriptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class _WithScriptModules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(torch.jit.script(_ScriptedBlock()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_torchscript_blocks_are_stages_of_their_own_and_prepare_prints_nothing(capfd):
    """A TorchScript module is one opaque call to the trace; the selective policy cannot run inside it, and each
    refused option made torch.fx print a traceback to stderr (8 for this model) while prepare went on."""
    torch.manual_seed(0)
    model = _WithScriptModules()
    torch.manual_seed(0)
    twin = _WithScriptModules()  # deepcopy of a scripted module gives parameters that are not leaves
    x, y = torch.randn(16, 16), torch.randint(0, 3, (16,))
    capfd.readouterr()
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                             planning=edgetrain.PlanConfig(solver="recompute_all", micro_batch_size=8, use_cache=False))
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err and "Traceback" not in printed.out, printed.err[-2000:]
    assert len(step.chain) >= 5 and set(step.plan.policies) == {"recompute"}
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(2):
        step(x, y)
        opt.zero_grad()
        nn.CrossEntropyLoss()(twin(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)  # two micro-batches: the sum's rounding only
