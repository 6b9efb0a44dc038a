"""Values a torch.fx trace bakes into its code, set between steps: the step traces the model again and trains as
plain PyTorch does. Plain attributes, settings in configuration objects and dicts (nested lists too), tensors
replaced in a dict or list, functions swapped, and module-level globals read anywhere in the model's code; and
what is not the model's code (a garbage collector callback) is not keyed."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _semantics import Stack, prepared, retraced_side_by_side


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
    retraced_side_by_side(_Annealed(), change)
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
    retraced_side_by_side(_Configured({"scale": 1.0} if as_dict else _Schedule()), change)
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
        retraced_side_by_side(_GlobalScaled(), change)
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
        retraced_side_by_side(_HelperGlobal(), change)
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

    retraced_side_by_side(_Mixing(), change)
    assert "cfg['mix'] (((1.0, 0.0), (0.5, 0.5)) -> ((0.75, 0.25), (0.5, 0.5))) changed" in caplog.text


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
    retraced_side_by_side(_MaskedByDict(), change)
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
        retraced_side_by_side(_Swappable(), change)
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


_TEMPERATURE = 1.0


def _tempered(logits: torch.Tensor) -> torch.Tensor:
    return logits / _TEMPERATURE


class _TemperedClassifier(nn.Module):
    """A user's wrapper around a Hugging Face model: its logits pass a helper reading an annealed global."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tempered(self.inner(pixel_values=x).logits)


def test_a_hugging_face_model_behind_a_helper_reading_a_global_trains_as_plain_pytorch(caplog):
    """A Hugging Face ResNet built from its config, traced whole (its own code reads transformers' globals too):
    three steps beside plain PyTorch, bit for bit, with the temperature changed before the second."""
    global _TEMPERATURE
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    layer_type="basic", num_labels=3)
    torch.manual_seed(0)
    model = _TemperedClassifier(transformers.ResNetForImageClassification(cfg).train())
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    def change(net: nn.Module, i: int) -> None:
        global _TEMPERATURE
        _TEMPERATURE = 1.0 if i == 0 else 2.0

    try:
        retraced_side_by_side(model, change, batches)
    finally:
        _TEMPERATURE = 1.0
    assert caplog.text.count("changed since the model was traced") == 1  # once, at the change, and only it
    assert "global _TEMPERATURE (1.0 -> 2.0)" in caplog.text
