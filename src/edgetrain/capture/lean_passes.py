"""The lean-op passes of :func:`edgetrain.capture.rewrite.rewrite` (2, 3, 4, 6 and 7 of its docstring).

Each takes a traced graph module and replaces calls in place by the lean functions of :mod:`.lean`,
:mod:`.lean_bn` and :mod:`.lean_dropout` (same values, less memory kept for backward), returning how many
it replaced; the dropout pass numbers each call it rewrites (a site of :mod:`edgetrain.capture.draws`). The
predicates :func:`has_dropout` and ``calls_module(gm, BATCHNORMS)`` answer, without loading a native kernel,
whether a graph has anything for the BatchNorm and dropout passes to do.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .fxnodes import (MODULE_META, has_backward_hooks, has_foreign_forward_hooks, has_hooks, is_view, op_name,
                      replace_node)
from .lean import chunk_bytes, lean_conv2d, lean_hardtanh
from .lean_bn import lean_batch_norm
from .lean_dropout import dropout_module_out_of_place
from .draws import dropout_module_site, dropout_site

__all__ = ["BATCHNORMS", "activation_replacement", "lean_activations", "lean_convs", "lean_batch_norms",
           "has_dropout", "dropout_sites", "sibling_selects", "unbound"]

#: BatchNorm module types the BatchNorm pass rewrites.
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def activation_replacement(m: nn.Module) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
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


def lean_activations(gm: fx.GraphModule) -> int:
    """ReLU6 / Hardtanh module and function calls -> :func:`lean_hardtanh` (pass 2)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and len(n.args) == 1 and not n.kwargs:
            m = gm.get_submodule(str(n.target))
            if type(m) in (nn.ReLU6, nn.Hardtanh) and not m.inplace and not has_hooks(m):
                fn, extra = activation_replacement(m)  # type: ignore[misc]
                replace_node(gm, n, fn, (n.args[0],) + extra, module=str(n.target))
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
            replace_node(gm, n, lean_hardtanh, (bound.arguments["input"], float(lo), float(hi)))
            count += 1
    return count


def lean_convs(gm: fx.GraphModule) -> int:
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
                or has_hooks(m)):
            continue
        with gm.graph.inserting_before(n):
            weight = gm.graph.get_attr(f"{n.target}.weight")
            bias = gm.graph.get_attr(f"{n.target}.bias") if m.bias is not None else None
        replace_node(gm, n, lean_conv2d, (n.args[0], weight, bias, tuple(m.stride), tuple(m.padding),
                                      tuple(m.dilation), m.groups, limit), module=str(n.target))
        count += 1
    return count


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
        if type(m) is nn.ReLU and not has_hooks(m):
            return "relu", 0.0, 0.0
    return None


def lean_batch_norms(gm: fx.GraphModule) -> int:
    """BatchNorm module calls (with a ReLU / ReLU6 that is their only reader) -> :func:`lean_batch_norm` (pass 4)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_module" or len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node):
            continue
        m = gm.get_submodule(str(n.target))
        if type(m) not in BATCHNORMS or has_backward_hooks(m):
            continue
        fused = _fused_activation(gm, next(iter(n.users)), n) if len(n.users) == 1 else None
        act, lo, hi = fused if fused is not None and not has_foreign_forward_hooks(m) else ("none", 0.0, 0.0)
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


def _dropout_call(gm: fx.GraphModule, n: fx.Node) -> tuple[Callable[..., Any], tuple[Any, ...], bool] | None:
    """``(lean function, its arguments, whether the module goes last)`` for a dropout call the lean pass
    rewrites: an out-of-place ``nn.Dropout`` module call without hooks, the out-of-place form of an in-place
    one (pass 1), or an out-of-place ``F.dropout`` / ``torch.dropout`` call; None for anything else."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if type(m) is not nn.Dropout or m.inplace or has_hooks(m) or len(n.args) != 1 or n.kwargs:
            return None
        return dropout_module_site, (n.args[0],), True
    if n.op != "call_function":
        return None
    if n.target is dropout_module_out_of_place:
        if type(gm.get_submodule(str(n.args[1].target))) is not nn.Dropout:
            return None
        return dropout_module_site, tuple(n.args), False
    if n.target in (F.dropout, torch.dropout):
        args = _dropout_args(n)
        return None if args is None else (dropout_site, (n.args[0], *args), False)
    return None


def has_dropout(gm: fx.GraphModule) -> bool:
    """Whether the graph has a dropout call :func:`dropout_sites` rewrites (a question that loads no kernel)."""
    return any(_dropout_call(gm, n) is not None for n in gm.graph.nodes)


def dropout_sites(gm: fx.GraphModule) -> int:
    """Out-of-place ``nn.Dropout`` module calls and ``F.dropout`` / ``torch.dropout`` calls -> dropout sites (pass 6):
    :func:`~edgetrain.capture.draws.dropout_site` calls, numbered in graph order, which run lean dropout (or torch's
    where it is off) and, in a split step, the whole batch's masks."""
    count = 0
    for n in list(gm.graph.nodes):
        call = _dropout_call(gm, n)
        if call is None:
            continue
        fn, args, module_last = call
        with gm.graph.inserting_before(n):
            if module_last:
                args = args + (gm.graph.get_attr(str(n.target)),)
            new = gm.graph.call_function(fn, args, {"site": count})
        new.meta.update(n.meta)
        if module_last:
            new.meta[MODULE_META] = str(n.target)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    return count


def unbound(x: Any, rows: int) -> Any:
    """``x.unbind(0)`` for a tensor of ``rows`` rows, ``x`` itself for anything else (what :func:`sibling_selects`
    puts before ``x[0], x[1], ...``: indexing either gives the same views)."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == rows:
        return x.unbind(0)
    return x


def _writes_through(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether a reader of ``n``, or of a view of it, may write in place (an output of ``unbind`` must not be
    written: autograd refuses in-place writes to one of several views made by one call)."""
    todo, seen = [n], set()
    while todo:
        for u in todo.pop().users:
            if u in seen:
                continue
            seen.add(u)
            name = op_name(u)
            if u.op == "call_module":
                m = gm.get_submodule(str(u.target))
                if getattr(m, "inplace", False) or not type(m).__module__.startswith("torch.nn"):
                    return True
            elif (name.endswith("_") and not name.endswith("__")) or u.kwargs.get("inplace") or "out" in u.kwargs:
                return True
            elif is_view(u):
                todo.append(u)
    return False


def _int_index(u: fx.Node) -> bool:
    return (u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 and not u.kwargs
            and type(u.args[1]) is int)


def sibling_selects(gm: fx.GraphModule) -> int:
    """``x[0], x[1], ..., x[k-1]`` of one tensor (``q, k, v = qkv[0], qkv[1], qkv[2]``) -> ``x.unbind(0)``'s items
    (pass 7). The views are the same; the backward differs: each ``x[i]``'s gradient is a zero-filled tensor of
    ``x``'s whole size with one row written, and autograd adds the ``k`` of them, where ``unbind``'s backward
    stacks the ``k`` rows once. Every element is the same number (one row's gradient plus zeros), a ``-0.0``
    aside, which comes out ``-0.0`` instead of ``+0.0``. Applied where the integer indices are exactly
    ``0 .. k-1`` (``k >= 2``), ``x`` has no other reader and nothing writes in place into a selected view;
    at run time :func:`unbound` unbinds only a tensor of ``k`` rows (anything else is indexed as before)."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # inserting a node keeps the others' relative order
    for x in list(order):
        users = list(x.users)
        if op_name(x) in ("getattr", "size") or len(users) < 2 or not all(map(_int_index, users)):
            continue
        rows = sorted({u.args[1] for u in users})
        if rows != list(range(len(rows))) or any(_writes_through(gm, u) for u in users):
            continue
        with gm.graph.inserting_before(min(users, key=order.__getitem__)):
            parts = gm.graph.call_function(unbound, (x, len(rows)))
        for u in users:
            u.replace_input_with(x, parts)
        count += 1
    return count
