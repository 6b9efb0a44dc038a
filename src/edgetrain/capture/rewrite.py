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

6. **Lean dropout** (:func:`edgetrain.capture.lean_dropout.lean_dropout`): out-of-place ``nn.Dropout``
   calls and ``F.dropout`` / ``torch.dropout`` calls draw PyTorch's own masks in one compiled pass and keep
   one bit per element for backward (on where its self-check finds it bit-exact against ``torch.dropout``).

Modules with hooks keep their calls (the hooks must fire); a rewritten module call records the module's
qualified name in ``node.meta[MODULE_META]`` so the stage still lists the module it runs.
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
from .lean import chunk_bytes, lean_conv2d, lean_hardtanh
from .lean_bn import available as lean_bn_available, lean_batch_norm
from .lean_dropout import (DROPOUT_FUNCTIONS, available as lean_dropout_available, dropout_module_out_of_place,
                           lean_dropout, lean_dropout_module)

__all__ = ["MODULE_META", "Rewrites", "rewrite", "keeps_input", "disown_stage_inputs", "fresh_activation"]

log = logging.getLogger(__name__)

#: Meta key that records, on a rewritten graph node, the qualified name of the module it called.
MODULE_META = "edgetrain_module"

# In-place tensor methods and torch functions that have an out-of-place twin of the same name without "_".
_INPLACE_METHODS = frozenset({
    "relu_", "sigmoid_", "tanh_", "clamp_", "clamp_min_", "clamp_max_", "clip_", "add_", "sub_", "mul_",
    "div_", "neg_", "abs_", "exp_", "log_", "sqrt_", "rsqrt_", "pow_", "square_", "reciprocal_", "sin_",
    "cos_", "erf_", "masked_fill_", "hardtanh_", "leaky_relu_", "elu_", "silu_", "hardswish_", "gelu_",
    "nan_to_num_", "lerp_", "addcmul_", "addcdiv_",
})
_FUNCTION_NAMESPACES = (torch, F, torch._C._nn)
# Ops that return a view: an in-place op on their result writes into another tensor, so it is kept.
_VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "narrow", "select", "transpose", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "t", "T", "as_strided", "chunk", "split", "unbind",
    "diagonal", "movedim", "swapaxes", "unfold", "__getitem__", "getitem", "real", "imag", "detach",
})


@dataclass
class Rewrites:
    """What :func:`rewrite` changed (counts of graph nodes)."""

    inplace: int = 0
    activations: int = 0
    convs: int = 0
    batchnorms: int = 0
    owned: int = 0
    dropouts: int = 0

    def __str__(self) -> str:
        return (f"{self.inplace} in-place op(s) made out-of-place, {self.activations} ReLU6/Hardtanh saving "
                f"outputs, {self.convs} convolution(s) with a batch-sliced backward, {self.batchnorms} lean "
                f"BatchNorm(s), {self.owned} input gradient(s) written over their input, {self.dropouts} "
                "lean dropout(s)")


def _has_hooks(m: nn.Module) -> bool:
    own = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    glob = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
            nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)
    return any(own) or any(glob)


def _has_backward_hooks(m: nn.Module) -> bool:
    return bool(m._backward_hooks or m._backward_pre_hooks or nn.modules.module._global_backward_hooks
                or nn.modules.module._global_backward_pre_hooks)


def _has_foreign_forward_hooks(m: nn.Module) -> bool:
    """Forward hooks that may keep a reference to the output: any but edgetrain's own BatchNorm statistics
    hooks (their owner says ``keeps_outputs = False``)."""
    hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values(),
             *nn.modules.module._global_forward_hooks.values(),
             *nn.modules.module._global_forward_pre_hooks.values()]
    return any(getattr(getattr(h, "__self__", None), "keeps_outputs", True) for h in hooks)


def _op_name(n: fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        return getattr(n.target, "__name__", "")
    return ""


def _is_view(n: fx.Node) -> bool:
    return n.op in ("call_method", "call_function") and _op_name(n) in _VIEW_OPS


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


def _module_replacement(m: nn.Module) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    """Out-of-place function and its extra arguments for an activation module (None: keep the call)."""
    if type(m) is nn.ReLU6:
        return lean_hardtanh, (0.0, 6.0)
    if type(m) is nn.Hardtanh:
        return lean_hardtanh, (float(m.min_val), float(m.max_val))
    if type(m) is nn.ReLU and m.inplace:
        return torch.relu, ()
    if type(m) is nn.LeakyReLU and m.inplace:
        return F.leaky_relu, (m.negative_slope,)
    if type(m) is nn.ELU and m.inplace:
        return F.elu, (m.alpha,)
    if type(m) in (nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Mish) and m.inplace:
        return {nn.SiLU: F.silu, nn.Hardswish: F.hardswish, nn.Hardsigmoid: F.hardsigmoid,
                nn.Mish: F.mish}[type(m)], ()
    return None


def _replace(gm: fx.GraphModule, node: fx.Node, fn: Callable[..., Any] | str, args: tuple[Any, ...],
             kwargs: dict[str, Any] | None = None, module: str | None = None) -> fx.Node:
    """Put a call of ``fn`` (a method name when a string) where ``node`` was."""
    with gm.graph.inserting_before(node):
        if isinstance(fn, str):
            new = gm.graph.call_method(fn, args, kwargs or {})
        else:
            new = gm.graph.call_function(fn, args, kwargs or {})
    new.meta.update(node.meta)
    if module is not None:
        new.meta[MODULE_META] = module
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _mutated_arg(n: fx.Node) -> fx.Node | None:
    """The tensor an in-place call overwrites, when rewriting it out-of-place keeps the program's meaning:
    not a view (the write would reach its base) and not a parameter or buffer (``self.calls.add_(1)``,
    ``F.batch_norm`` on a layer's own statistics: the write is the point, and the model keeps it)."""
    a = n.args[0] if n.args else None
    return a if isinstance(a, fx.Node) and not _is_view(a) and a.op != "get_attr" else None


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
            inplace = getattr(m, "inplace", False) and not _has_hooks(m) and len(n.args) == 1 and not n.kwargs
            rep = _module_replacement(m) if inplace else None
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
        new = _replace(gm, n, fn, args, kwargs, module)
        order[new] = order.pop(n)
        for u in later:  # they read the overwritten tensor: now the new value
            u.replace_input_with(a, new)
        count += 1
    return count


def _lean_activations(gm: fx.GraphModule) -> int:
    """ReLU6 / Hardtanh module and function calls -> :func:`lean_hardtanh` (pass 2)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and len(n.args) == 1 and not n.kwargs:
            m = gm.get_submodule(str(n.target))
            if type(m) in (nn.ReLU6, nn.Hardtanh) and not m.inplace and not _has_hooks(m):
                fn, extra = _module_replacement(m)  # type: ignore[misc]
                _replace(gm, n, fn, (n.args[0],) + extra, module=str(n.target))
                count += 1
        elif n.op == "call_function" and n.target in (F.hardtanh, F.relu6):
            try:
                bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
            except TypeError:
                continue
            bound.apply_defaults()
            if bound.arguments.get("inplace"):
                continue
            lo, hi = (0.0, 6.0) if n.target is F.relu6 else (bound.arguments["min_val"],
                                                            bound.arguments["max_val"])
            if isinstance(lo, fx.Node) or isinstance(hi, fx.Node):
                continue
            _replace(gm, n, lean_hardtanh, (bound.arguments["input"], float(lo), float(hi)))
            count += 1
    return count


def _lean_convs(gm: fx.GraphModule) -> int:
    """Plain ``nn.Conv2d`` calls -> :func:`lean_conv2d` on the module's own parameters (pass 3)."""
    limit = chunk_bytes()
    if limit <= 0:
        return 0
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_module" or len(n.args) != 1 or n.kwargs:
            continue
        m = gm.get_submodule(str(n.target))
        if (type(m) is not nn.Conv2d or m.padding_mode != "zeros" or isinstance(m.padding, str)
                or _has_hooks(m)):
            continue
        with gm.graph.inserting_before(n):
            weight = gm.graph.get_attr(f"{n.target}.weight")
            bias = gm.graph.get_attr(f"{n.target}.bias") if m.bias is not None else None
        _replace(gm, n, lean_conv2d, (n.args[0], weight, bias, tuple(m.stride), tuple(m.padding),
                                      tuple(m.dilation), m.groups, limit), module=str(n.target))
        count += 1
    return count


_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_CONV_FUNCTIONS = (lean_conv2d, F.conv1d, F.conv2d, F.conv3d, F.linear, torch.conv1d, torch.conv2d,
                   torch.conv3d)
_ADDS = (operator.add, torch.add)


def _fused_activation(gm: fx.GraphModule, u: fx.Node, z: fx.Node) -> tuple[str, float, float] | None:
    """``(act, lo, hi)`` when ``u`` is a ReLU or ReLU6/Hardtanh of ``z`` alone, else None."""
    if u.op == "call_function" and u.target is lean_hardtanh and len(u.args) == 3 and u.args[0] is z:
        return "hardtanh", float(u.args[1]), float(u.args[2])
    if u.op == "call_function" and u.target in (torch.relu, F.relu) and u.args == (z,) and not u.kwargs.get(
            "inplace"):
        return "relu", 0.0, 0.0
    if u.op == "call_method" and u.target == "relu" and u.args == (z,) and not u.kwargs:
        return "relu", 0.0, 0.0
    if u.op == "call_module" and u.args == (z,) and not u.kwargs:
        m = gm.get_submodule(str(u.target))
        if type(m) is nn.ReLU and not _has_hooks(m):
            return "relu", 0.0, 0.0
    return None


def _lean_batch_norms(gm: fx.GraphModule) -> int:
    """BatchNorm module calls (with a ReLU / ReLU6 that is their only reader) -> :func:`lean_batch_norm` (pass 4)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_module" or len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node):
            continue
        m = gm.get_submodule(str(n.target))
        if type(m) not in _BATCHNORMS or _has_backward_hooks(m):
            continue
        fused = _fused_activation(gm, next(iter(n.users)), n) if len(n.users) == 1 else None
        act, lo, hi = fused if fused is not None and not _has_foreign_forward_hooks(m) else ("none", 0.0, 0.0)
        with gm.graph.inserting_before(n):
            module = gm.graph.get_attr(str(n.target))
        target = next(iter(n.users)) if fused is not None else n
        with gm.graph.inserting_after(target):
            new = gm.graph.call_function(lean_batch_norm, (n.args[0], module, act, lo, hi), {"owned": False})
        new.meta.update(target.meta)
        new.meta[MODULE_META] = str(n.target)
        target.replace_all_uses_with(new)
        gm.graph.erase_node(target)
        if target is not n:
            gm.graph.erase_node(n)
        count += 1
    return count


def _dropout_args(n: fx.Node) -> tuple[Any, Any] | None:
    """``(p, training)`` of an out-of-place ``F.dropout`` / ``torch.dropout`` call, or None."""
    names = ("input", "p", "training", "inplace") if n.target is F.dropout else ("input", "p", "train")
    if len(n.args) > len(names) or any(k not in names for k in n.kwargs):
        return None
    bound = dict(zip(names, n.args), **n.kwargs)
    if n.target is F.dropout:
        bound.setdefault("p", 0.5)
        bound.setdefault("training", True)
        if bound.get("inplace", False) is not False:
            return None
        return bound["p"], bound["training"]
    if "p" not in bound or "train" not in bound:
        return None
    return bound["p"], bound["train"]


def _lean_dropouts(gm: fx.GraphModule) -> int:
    """Out-of-place ``nn.Dropout`` module calls and ``F.dropout`` / ``torch.dropout`` calls -> lean dropout (pass 6)."""
    count = 0
    for n in list(gm.graph.nodes):
        if not n.args or not isinstance(n.args[0], fx.Node):
            continue
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if type(m) is not nn.Dropout or m.inplace or _has_hooks(m) or len(n.args) != 1 or n.kwargs:
                continue
            with gm.graph.inserting_before(n):
                module = gm.graph.get_attr(str(n.target))
                new = gm.graph.call_function(lean_dropout_module, (n.args[0], module))
            new.meta.update(n.meta)
            new.meta[MODULE_META] = str(n.target)
        elif (n.op == "call_function" and n.target is dropout_module_out_of_place
              and type(gm.get_submodule(str(n.args[1].target))) is nn.Dropout):
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(lean_dropout_module, tuple(n.args))
            new.meta.update(n.meta)
        elif n.op == "call_function" and n.target in (F.dropout, torch.dropout):
            args = _dropout_args(n)
            if args is None:
                continue
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(lean_dropout, (n.args[0], *args))
            new.meta.update(n.meta)
        else:
            continue
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    return count


def _makes_unshared(gm: fx.GraphModule, a: fx.Node) -> bool:
    """Whether ``a`` makes a fresh tensor that no op saves for backward: a convolution, linear layer,
    BatchNorm or addition keeps only its inputs (and a lean BatchNorm its input and a bit mask)."""
    if a.op == "call_function":
        return a.target in _CONV_FUNCTIONS or a.target is lean_batch_norm or a.target in _ADDS
    if a.op == "call_method":
        return a.target == "add"
    if a.op == "call_module":
        m = gm.get_submodule(str(a.target))
        return type(m) in _CONV_MODULES + _BATCHNORMS and not _has_hooks(m)
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
                            lean_dropout, lean_dropout_module, operator.add, operator.sub, torch.add, torch.sub)
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
                    and not _has_hooks(m))
    return True


def _calls(gm: fx.GraphModule, types: Any) -> bool:
    """Whether the graph calls a module whose type is one of ``types``."""
    return any(n.op == "call_module" and type(gm.get_submodule(str(n.target))) in types for n in gm.graph.nodes)


def _has_dropout(gm: fx.GraphModule) -> bool:
    """Whether the graph has a dropout call :func:`_lean_dropouts` may rewrite."""
    return _calls(gm, (nn.Dropout,)) or any(
        n.op == "call_function" and n.target in (F.dropout, torch.dropout, dropout_module_out_of_place)
        for n in gm.graph.nodes)


def rewrite(gm: fx.GraphModule) -> Rewrites:
    """Apply the passes of the module docstring to ``gm`` in place (its values are unchanged).

    Args:
        gm: a graph module traced from the user's model (its root holds the model's submodules).

    Returns:
        The counts of rewritten nodes.
    """
    done = Rewrites(_functionalize(gm), _lean_activations(gm), _lean_convs(gm))
    # the native kernels are built, loaded and self-checked on first use, which leaves them and the torch
    # code the check runs resident in this process: only for a graph that has something for them to do
    if settings.lean_batchnorm_enabled() and _calls(gm, _BATCHNORMS) and lean_bn_available():
        done.batchnorms = _lean_batch_norms(gm)
        done.owned = _own_inputs(gm)
    if _has_dropout(gm) and lean_dropout_available():
        done.dropouts = _lean_dropouts(gm)
    gm.graph.lint()
    gm.recompile()
    if done.inplace or done.activations or done.convs or done.batchnorms or done.dropouts:
        log.debug("graph rewrites: %s", done)
    return done

