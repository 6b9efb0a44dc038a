"""What a forward does beyond its values, kept by capture and recomputation: ops that write into an argument
autograd saves (nn.RReLU), torch.no_grad blocks and custom autograd Functions inside the forward, hooks on
the modules a trace would run through, blocks writing into their inputs, attributes set between steps."""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
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


def _retraced_side_by_side(model: nn.Module, change: Callable[[nn.Module, int], None]) -> None:
    """Three steps of ``model`` through a traced, fully recomputed plan beside plain PyTorch on a copy, with
    ``change(net, i)`` applied to both before step ``i``; they must end in the same state."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randint(0, 3, (8,))) for _ in range(3)]
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    m, step = prepared(model, *batches[0], solver="recompute_all")
    assert step.chain.method == "fx"
    for i, (x, y) in enumerate(batches):
        for net in (plain, m):
            change(net, i)
        opt.zero_grad()
        nn.CrossEntropyLoss()(plain(x), y).backward()
        opt.step()
        step(x, y)
    assert_same_state(plain, m)


class _Annealed(nn.Module):
    """Logits divided by a temperature and hidden units masked by a tensor, both plain attributes the training
    loop sets between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)
        self.temperature = 1.0
        self.keep = torch.ones(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.keep) / self.temperature


def test_plain_attributes_set_between_steps_are_used_by_traced_stages(caplog):
    """A trace bakes a float attribute into its code and holds the tensor object an attribute had: a temperature
    or mask assigned between steps was ignored by the traced stages (recompute-all 2.2e-2 off plain after three
    steps). The step now re-traces once such an attribute changes."""
    def change(net: nn.Module, i: int) -> None:
        net.temperature = 1.0 + i
        net.keep = (torch.arange(32) % (i + 2) != 0).float()

    torch.manual_seed(0)
    _retraced_side_by_side(_Annealed(), change)
    assert "keep (a new tensor) changed" in caplog.text


@dataclass
class _Schedule:
    scale: float = 1.0


class _Configured(nn.Module):
    """Reads a setting from a configuration object it holds (a dataclass, or a dict), as model code reads its
    ``self.config``; the training loop changes the setting between steps (a curriculum)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.a, self.b, self.cfg = nn.Linear(16, 32), nn.Linear(32, 3), cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.cfg["scale"] if isinstance(self.cfg, dict) else self.cfg.scale
        return self.b(torch.relu(self.a(x)) * scale)


@pytest.mark.parametrize("as_dict", [False, True])
def test_settings_in_a_configuration_object_set_between_steps_are_used_by_traced_stages(as_dict, caplog):
    """The re-trace looked at a module's own plain attributes only: a setting inside a configuration object the
    module holds stayed baked into the trace (parameters 24% from plain's after three steps, silently)."""
    def change(net: nn.Module, i: int) -> None:
        if as_dict:
            net.cfg["scale"] = 1.0 + i
        else:
            net.cfg.scale = 1.0 + i

    torch.manual_seed(0)
    _retraced_side_by_side(_Configured({"scale": 1.0} if as_dict else _Schedule()), change)
    assert "scale" in caplog.text and "changed" in caplog.text


_CURRICULUM = {"scale": 1.0}


class _GlobalScaled(nn.Module):
    """Reads a module-level setting the training loop changes between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * _CURRICULUM["scale"])


def test_a_module_level_setting_the_forward_reads_is_used_by_traced_stages(caplog):
    """A global dict read by name in a module's forward was baked into the trace like an attribute."""
    def change(net: nn.Module, i: int) -> None:
        _CURRICULUM["scale"] = 1.0 + i

    torch.manual_seed(0)
    try:
        _retraced_side_by_side(_GlobalScaled(), change)
    finally:
        _CURRICULUM["scale"] = 1.0
    assert "global _CURRICULUM['scale'] (1.0 -> 2.0) changed" in caplog.text


_NOISE_FLOOR = 0.0


def _gated(h: torch.Tensor) -> torch.Tensor:
    """A helper function of the model's module: the global it reads is not in any forward's code."""
    return torch.relu(h - _NOISE_FLOOR)


class _HelperGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_gated(self.a(x)))


def test_a_global_a_helper_function_reads_is_used_by_traced_stages(caplog):
    """Only the globals a forward itself names were keyed: one read in a helper function it calls stayed baked
    into the trace, and steps after a change trained with the old value, silently (0.029 apart in a parameter
    after one step). Every global the trace's Python code loads is keyed now."""
    global _NOISE_FLOOR

    def change(net: nn.Module, i: int) -> None:
        global _NOISE_FLOOR
        _NOISE_FLOOR = 0.25 * i

    torch.manual_seed(0)
    try:
        _retraced_side_by_side(_HelperGlobal(), change)
    finally:
        _NOISE_FLOOR = 0.0
    assert "global _NOISE_FLOOR (0.0 -> 0.25) changed" in caplog.text


class _Mixing(nn.Module):
    """Mixing weights as a list of lists in a configuration dict (a schedule the training loop edits)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)
        self.cfg = {"mix": [[1.0, 0.0], [0.5, 0.5]]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h * self.cfg["mix"][0][0] + h.flip(1) * self.cfg["mix"][0][1])


def test_a_nested_list_setting_is_used_by_traced_stages(caplog):
    """A list of lists of numbers was not keyed (only flat lists were): a change to it trained silently with the
    value of the capture."""
    def change(net: nn.Module, i: int) -> None:
        net.cfg["mix"][0][:] = [1.0 - 0.25 * i, 0.25 * i]

    _retraced_side_by_side(_Mixing(), change)
    assert "cfg['mix'] (((1.0, 0.0), (0.5, 0.5)) -> ((0.75, 0.25), (0.5, 0.5))) changed" in caplog.text


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



class _MaskedByDict(nn.Module):
    """Keeps its masks in a dict and a list of tensors, which the training loop replaces between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)
        self.masks, self.extra = {"keep": torch.ones(32)}, [torch.ones(32)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.masks["keep"] * self.extra[0])


def test_tensors_replaced_in_a_dict_or_list_between_steps_are_used_by_traced_stages(caplog):
    """A tensor in a dict or list the module holds was baked into the trace by identity, unseen when replaced
    (7.6% from plain's after three steps)."""
    def change(net: nn.Module, i: int) -> None:
        net.masks["keep"] = (torch.arange(32) % (i + 2) != 0).float()
        net.extra[0] = (torch.arange(32) % (i + 3) != 1).float()

    torch.manual_seed(0)
    _retraced_side_by_side(_MaskedByDict(), change)
    assert "masks['keep'] (a new tensor) changed" in caplog.text


def _leaky(x: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(x, 0.1)


def _leakier(x: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(x, 0.5)


_ACTIVATION = _leaky


class _Swappable(nn.Module):
    """An activation held as a partial, and one named by a module-level global: either swapped between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_ACTIVATION(self.act(self.a(x))))


@pytest.mark.parametrize("swap", ["attribute", "global"])
def test_a_function_swapped_after_the_trace_is_used_by_traced_stages(caplog, swap):
    """A trace inlines the function it called: a partial assigned to a module attribute, or a function a global
    names, swapped between steps trained silently with the old one (functions were never keyed)."""
    global _ACTIVATION

    def change(net: nn.Module, i: int) -> None:
        global _ACTIVATION
        if i == 1 and swap == "attribute":
            net.act = functools.partial(F.leaky_relu, negative_slope=0.5)
        elif i == 1:
            _ACTIVATION = _leakier

    torch.manual_seed(0)
    try:
        _retraced_side_by_side(_Swappable(), change)
    finally:
        _ACTIVATION = _leaky
    expected = "act (partial leaky_relu -> partial leaky_relu)" if swap == "attribute" else \
        "global _ACTIVATION (_leaky -> _leakier)"
    assert expected in caplog.text


def test_recording_the_globals_a_trace_reads_puts_back_a_tracer_installed_before():
    """A debugger's or coverage's trace function is in force again after a capture, and library code (PyTorch's,
    the standard library's) does not count as the model's."""
    import sys

    from edgetrain.capture.reads import globals_read, recording_globals

    def tracer(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        with recording_globals() as ran:
            _gated(torch.ones(2))
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert [label for label, _, _ in globals_read(ran)] == [f"global {__name__}._NOISE_FLOOR"]


_COLLECTIONS = 0


def _count_collection(phase: str, info: dict) -> None:
    global _COLLECTIONS
    _COLLECTIONS += 1


def test_a_garbage_collector_callback_that_ran_during_the_trace_is_not_the_models_code(caplog):
    """A gc callback (Hypothesis times every collection in globals of its own) that ran while the model was traced
    had its globals keyed as the model's: each step then saw them change, traced the model again, and one such
    re-trace refused the step (a CI run of the suite). Collections are off while a trace is recorded."""
    import gc

    threshold = gc.get_threshold()
    gc.callbacks.append(_count_collection)
    gc.set_threshold(1)  # a collection at nearly every allocation, the trace's included
    try:
        model, step = prepared(Stack(), torch.randn(8, 16), torch.randint(0, 3, (8,)), solver="recompute_all")
        assert step.chain.method == "fx"
        before = _COLLECTIONS
        for _ in range(2):
            step(torch.randn(8, 16), torch.randint(0, 3, (8,)))
        assert _COLLECTIONS > before  # collections ran between the steps: the global the callback writes moved
    finally:
        gc.callbacks.remove(_count_collection)
        gc.set_threshold(*threshold)
    assert not any(name == "_COLLECTIONS" for _, _, name in step.chain.globals_read)
    assert "changed since the model was traced" not in caplog.text
