"""Graph passes run on a traced model before it is cut into stages: same values, safer and leaner.

1. **Out-of-place activations.** torchvision's models (and most user code) use ``ReLU(inplace=True)``,
   ``F.relu(x, inplace=True)``, ``x.relu_()`` and the like. An in-place op on a tensor that crosses a stage
   boundary overwrites what the runtime keeps as the input of a recomputed stage (and the profiler's leaf
   inputs: "a leaf Variable that requires grad is being used in an in-place operation"). Every in-place
   call of an element-wise op, and every ``nn.Dropout(inplace=True)``-style module (classifier heads of
   torchvision and Hugging Face models), is turned into its out-of-place twin, and later readers of the
   overwritten tensor read the new value instead (the functional form of the same program). Ops whose
   input is a view of another tensor are left alone (the write would reach the base), as are ops not on
   the list; the cutter then puts no stage boundary across the tensor they write.
2. **ReLU6 / Hardtanh save their output** (:func:`edgetrain.capture.lean.lean_hardtanh`): the memory an
   in-place ReLU6 saves, kept by the out-of-place form.
3. **Lean convolutions** (:func:`edgetrain.capture.lean.lean_conv2d`): plain ``nn.Conv2d`` calls get a
   batch-sliced backward with the same maths and a fraction of oneDNN's transient copies.
4. **Lean BatchNorm** (:func:`edgetrain.capture.lean_bn.lean_batch_norm`): a BatchNorm module call, with
   the ReLU / ReLU6 that is its only reader, runs as one autograd function whose backward holds two
   tensors of the layer's size instead of four, with autograd's results bit for bit (on by default where
   its native kernel reproduces the installed torch: :func:`edgetrain.capture.lean_bn.available`).
5. **Gradients written over owned inputs**: where the graph shows that a lean BatchNorm's or a lean
   convolution's input is read by nothing else and saved by no other op (its maker, a convolution, a
   BatchNorm or an addition, keeps only its own inputs), the call is told it owns that input
   (``owned=True``) and writes its input gradient over it. A tensor that crosses a stage boundary is
   owned only when a lean BatchNorm's activation made it (:func:`disown_stage_inputs`): the runtime's
   copy of a stage input is read again only to re-run that stage, before its backward, and no selective
   checkpoint caches such a tensor.

6. **Dropout sites** (:func:`edgetrain.capture.draws.dropout_site`): out-of-place ``nn.Dropout`` calls and
   ``F.dropout`` / ``torch.dropout`` calls become numbered sites. A site runs lean dropout
   (:func:`edgetrain.capture.lean_dropout.lean_dropout`: PyTorch's own masks drawn in one compiled pass, one
   bit per element kept for backward, on where its self-check finds it bit-exact against ``torch.dropout``;
   torch's dropout elsewhere) and, in a step that splits its batch, the whole batch's masks
   (:mod:`edgetrain.capture.draws`).

7. **Rows of one tensor unbound** (:func:`edgetrain.capture.lean_passes.sibling_selects`): ``x[0], x[1], x[2]``
   of one tensor (attention's ``q, k, v = qkv[0], qkv[1], qkv[2]``) become the items of ``x.unbind(0)``: the
   same views, and a backward that stacks the rows' gradients once instead of adding ``k`` zero-filled tensors
   of ``x``'s size.

Passes 2, 3, 4, 6 and 7 live in :mod:`edgetrain.capture.lean_passes`. Modules with hooks keep their calls
(the hooks must fire); a rewritten module call records the module's qualified name in
``node.meta[MODULE_META]`` so the stage still lists the module it runs.
"""

from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import settings
from .fxnodes import MODULE_META, calls_module, has_hooks, is_view, replace_node
from .lean import lean_conv2d, lean_hardtanh
from .lean_bn import available as lean_bn_available, lean_batch_norm
from .lean_dropout import DROPOUT_FUNCTIONS, dropout_module_out_of_place, lean_dropout, lean_dropout_module
from .lean_passes import (BATCHNORMS, activation_replacement, dropout_sites, has_dropout, lean_activations,
                          lean_batch_norms, lean_convs, sibling_selects)
from .draws import dropout_module_site, dropout_site

__all__ = ["MODULE_META", "Rewrites", "rewrite", "keeps_input", "disown_stage_inputs", "fresh_activation"]

log = logging.getLogger(__name__)

# In-place tensor methods and torch functions that have an out-of-place twin of the same name without "_".
_INPLACE_METHODS = frozenset({
    "relu_", "sigmoid_", "tanh_", "clamp_", "clamp_min_", "clamp_max_", "clip_", "add_", "sub_", "mul_",
    "div_", "neg_", "abs_", "exp_", "log_", "sqrt_", "rsqrt_", "pow_", "square_", "reciprocal_", "sin_",
    "cos_", "erf_", "masked_fill_", "hardtanh_", "leaky_relu_", "elu_", "silu_", "hardswish_", "gelu_",
    "nan_to_num_", "lerp_", "addcmul_", "addcdiv_",
})
_FUNCTION_NAMESPACES = (torch, F, torch._C._nn)


@dataclass
class Rewrites:
    """What :func:`rewrite` changed (counts of graph nodes)."""

    inplace: int = 0
    activations: int = 0
    convs: int = 0
    batchnorms: int = 0
    owned: int = 0
    dropouts: int = 0
    selects: int = 0

    def __str__(self) -> str:
        return (f"{self.inplace} in-place op(s) made out-of-place, {self.activations} ReLU6/Hardtanh saving "
                f"outputs, {self.convs} convolution(s) with a batch-sliced backward, {self.batchnorms} lean "
                f"BatchNorm(s), {self.owned} input gradient(s) written over their input, {self.dropouts} "
                f"lean dropout(s), {self.selects} tensor(s) indexed row by row unbound")


def _twin_function(target: Any) -> Callable[..., Any] | None:
    """``torch.relu`` for ``torch.relu_`` and so on; None when there is none or it is not listed."""
    name = getattr(target, "__name__", "")
    if name not in _INPLACE_METHODS:
        return None
    for ns in _FUNCTION_NAMESPACES:
        if getattr(ns, name, None) is target and callable(getattr(ns, name[:-1], None)):
            return getattr(ns, name[:-1])
    return None


def _without_inplace_flag(n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` of a call with ``inplace=True`` (by keyword or position) set to False."""
    try:
        sig = inspect.signature(n.target)
        bound = sig.bind(*n.args, **n.kwargs)
    except (TypeError, ValueError):
        return None
    if bound.arguments.get("inplace") is not True:
        return None
    bound.arguments["inplace"] = False
    return tuple(bound.args), dict(bound.kwargs)


def _mutated_arg(n: fx.Node) -> fx.Node | None:
    """The tensor an in-place call overwrites, when rewriting it out-of-place keeps the program's meaning:
    not a view (the write would reach its base) and not a parameter or buffer (``self.calls.add_(1)``,
    ``F.batch_norm`` on a layer's own statistics: the write is the point, and the model keeps it), nor the
    result of another in-place call on one (``self.avg.mul_(0.9).add_(x)``: ``mul_`` returns the buffer)."""
    a = n.args[0] if n.args else None
    if not isinstance(a, fx.Node):
        return None
    root: Any = a
    while isinstance(root, fx.Node):
        if is_view(root) or root.op == "get_attr":
            return None
        root = root.args[0] if _returns_its_input(root) and root.args else None
    return a


def _returns_its_input(n: fx.Node) -> bool:
    """Whether ``n`` is an in-place call, whose result is its first argument itself."""
    if n.op == "call_method":
        name = str(n.target)
        return name.endswith("_") and not name.startswith("__")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return (name.endswith("_") and not name.startswith("__")) or n.kwargs.get("inplace") is True
    return False


def _readers_after(a: fx.Node, n: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    return [u for u in a.users if u is not n and order[u] > order[n]]


def _functionalize(gm: fx.GraphModule) -> int:
    """Turn in-place calls into out-of-place ones (pass 1 of the module docstring)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for n in list(gm.graph.nodes):
        new_call: tuple[Callable[..., Any] | str, tuple[Any, ...], dict[str, Any], str | None] | None = None
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            inplace = getattr(m, "inplace", False) and not has_hooks(m) and len(n.args) == 1 and not n.kwargs
            rep = activation_replacement(m) if inplace else None
            if rep is not None:
                new_call = (rep[0], (n.args[0],) + rep[1], {}, str(n.target))
            elif inplace and type(m) in DROPOUT_FUNCTIONS and _mutated_arg(n) is not None:
                with gm.graph.inserting_before(n):
                    module = gm.graph.get_attr(str(n.target))
                new_call = (dropout_module_out_of_place, (n.args[0], module), {}, str(n.target))
        elif n.op == "call_method" and str(n.target) in _INPLACE_METHODS:
            new_call = (str(n.target)[:-1], tuple(n.args), dict(n.kwargs), None)
        elif n.op == "call_function":
            twin = _twin_function(n.target)
            flag = None if twin is not None else _without_inplace_flag(n)
            if twin is not None:
                new_call = (twin, tuple(n.args), dict(n.kwargs), None)
            elif flag is not None:
                new_call = (n.target, flag[0], flag[1], None)
        a = _mutated_arg(n) if new_call is not None else None
        if a is None:
            continue
        later = _readers_after(a, n, order)
        fn, args, kwargs, module = new_call
        new = replace_node(gm, n, fn, args, kwargs, module)
        order[new] = order.pop(n)
        for u in later:  # they read the overwritten tensor: now the new value
            u.replace_input_with(a, new)
        count += 1
    return count


_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_CONV_FUNCTIONS = (lean_conv2d, F.conv1d, F.conv2d, F.conv3d, F.linear, torch.conv1d, torch.conv2d,
                   torch.conv3d)
_ADDS = (operator.add, torch.add)


def _makes_unshared(gm: fx.GraphModule, a: fx.Node) -> bool:
    """Whether ``a`` makes a fresh tensor that no op saves for backward: a convolution, linear layer,
    BatchNorm or addition keeps only its inputs (and a lean BatchNorm its input and a bit mask)."""
    if a.op == "call_function":
        return a.target in _CONV_FUNCTIONS or a.target is lean_batch_norm or a.target in _ADDS
    if a.op == "call_method":
        return a.target == "add"
    if a.op == "call_module":
        m = gm.get_submodule(str(a.target))
        return type(m) in _CONV_MODULES + BATCHNORMS and not has_hooks(m)
    return False


def _own_inputs(gm: fx.GraphModule) -> int:
    """Mark lean calls whose input nothing else reads or saves ``owned=True`` (pass 5)."""
    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (lean_batch_norm, lean_conv2d):
            continue
        a = n.args[0]
        if isinstance(a, fx.Node) and len(a.users) == 1 and _makes_unshared(gm, a):
            n.update_kwarg("owned", True)
            count += 1
    return count


def fresh_activation(a: fx.Node) -> bool:
    """Whether ``a`` is a lean BatchNorm with an activation: its output is a tensor no op saves and no
    selective checkpoint caches (the activation writes it, out of place under a checkpoint that keeps
    the BatchNorm's output), so a stage that reads it alone may own it."""
    return a.op == "call_function" and a.target is lean_batch_norm and len(a.args) > 2 and a.args[2] != "none"


def disown_stage_inputs(graph: fx.Graph, ownable: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    """A stage's graph: lean calls whose input is a stage input do not own it (the runtime keeps it to re-run
    the stage, a selective checkpoint may have cached it), except the inputs named in ``ownable``.

    Returns:
        Whether the stage still owns one of its inputs.
    """
    owns = False
    for n in graph.nodes:
        if (n.op == "call_function" and n.target in (lean_batch_norm, lean_conv2d) and n.kwargs.get("owned")
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"):
            if str(n.args[0].target) in ownable:
                owns = True
            else:
                n.update_kwarg("owned", False)
    return owns


# Ops whose backward needs none of their inputs: they read their output (ReLU, sigmoid, tanh), a mask
# (dropout) or nothing (addition).
_OUTPUT_SAVING_FUNCTIONS = (lean_hardtanh, torch.relu, F.relu, torch.sigmoid, torch.tanh, F.dropout,
                            lean_dropout, lean_dropout_module, dropout_site, dropout_module_site, operator.add,
                            operator.sub, torch.add, torch.sub)
_OUTPUT_SAVING_METHODS = frozenset({"relu", "sigmoid", "tanh", "add", "sub"})
_OUTPUT_SAVING_MODULES = (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def keeps_input(gm: fx.GraphModule, n: fx.Node) -> bool:
    """False when ``n``'s backward needs none of its inputs (ReLU, ReLU6 after :func:`rewrite`, sigmoid
    and tanh read their output, dropout its mask, addition nothing), so its input need not outlive its
    forward; True for anything else (the safe answer).

    Args:
        gm: the graph module ``n`` belongs to.
        n: a node of its graph.

    Returns:
        Whether autograd may keep ``n``'s first input alive for backward.
    """
    if n.op == "call_function":
        if n.target in (F.relu, F.relu6, F.hardtanh) and n.kwargs.get("inplace"):
            return True
        if n.target is lean_batch_norm and n.kwargs.get("owned"):
            # it writes its gradient over its input (a convolution's output, read by nothing else): a cut
            # before it would keep that input whole as the next stage's, where inside the stage it goes
            return False
        return n.target not in _OUTPUT_SAVING_FUNCTIONS
    if n.op == "call_method":
        return str(n.target) not in _OUTPUT_SAVING_METHODS
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return not (type(m) in _OUTPUT_SAVING_MODULES and not getattr(m, "inplace", False)
                    and not has_hooks(m))
    return True


def rewrite(gm: fx.GraphModule, channels_last: bool = False) -> Rewrites:
    """Apply the passes of the module docstring to ``gm`` in place (its values are unchanged).

    Args:
        gm: a graph module traced from the user's model (its root holds the model's submodules).
        channels_last: the model is fed channels-last images. Lean BatchNorm is then left out: its kernel
            covers contiguous (NCHW) maps only, and a layer it falls back on pays a copy of its output.

    Returns:
        The counts of rewritten nodes.
    """
    done = Rewrites(_functionalize(gm), lean_activations(gm), lean_convs(gm))
    # the native kernels are built, loaded and self-checked on first use, which leaves them and the torch
    # code the check runs resident in this process: only for a graph that has something for them to do
    if (settings.lean_batchnorm_enabled() and not channels_last and calls_module(gm, BATCHNORMS)
            and lean_bn_available()):
        done.batchnorms = lean_batch_norms(gm)
        done.owned = _own_inputs(gm)
    if has_dropout(gm):
        done.dropouts = dropout_sites(gm)
    done.selects = sibling_selects(gm)
    gm.graph.lint()
    gm.recompile()
    if done.inplace or done.activations or done.convs or done.batchnorms or done.dropouts or done.selects:
        log.debug("graph rewrites: %s", done)
    return done

