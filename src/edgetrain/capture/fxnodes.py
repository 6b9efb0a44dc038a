"""Small shared facts about traced graphs and the modules they call, for the capture's graph passes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["MODULE_META", "has_hooks", "has_backward_hooks", "has_foreign_forward_hooks", "replace_node",
           "calls_module", "VIEW_OPS", "op_name", "is_view", "storage_of", "node_values", "GraphRun"]

#: Meta key that records, on a rewritten graph node, the qualified name of the module it called.
MODULE_META = "edgetrain_module"


def has_hooks(m: nn.Module) -> bool:
    """Whether any hook, the module's own or a global one, fires on ``m``'s call (then the call is kept)."""
    own = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    glob = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
            nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)
    return any(own) or any(glob)


def has_backward_hooks(m: nn.Module) -> bool:
    """Whether a backward hook, the module's own or a global one, fires on ``m``'s call."""
    return bool(m._backward_hooks or m._backward_pre_hooks or nn.modules.module._global_backward_hooks
                or nn.modules.module._global_backward_pre_hooks)


def has_foreign_forward_hooks(m: nn.Module) -> bool:
    """Forward hooks that may keep a reference to the output: any but edgetrain's own BatchNorm statistics
    hooks (their owner says ``keeps_outputs = False``)."""
    hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values(),
             *nn.modules.module._global_forward_hooks.values(),
             *nn.modules.module._global_forward_pre_hooks.values()]
    return any(getattr(getattr(h, "__self__", None), "keeps_outputs", True) for h in hooks)


def replace_node(gm: fx.GraphModule, node: fx.Node, fn: Callable[..., Any] | str, args: tuple[Any, ...],
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


def calls_module(gm: fx.GraphModule, types: Any) -> bool:
    """Whether the graph calls a module whose type is one of ``types``."""
    return any(n.op == "call_module" and type(gm.get_submodule(str(n.target))) in types for n in gm.graph.nodes)


#: Ops that return a view: an in-place op on their result writes into another tensor (``unbound`` is
#: :func:`edgetrain.capture.lean_passes.unbound`).
VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "narrow", "select", "transpose", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "t", "T", "as_strided", "chunk", "split", "unbind",
    "diagonal", "movedim", "swapaxes", "unfold", "__getitem__", "getitem", "real", "imag", "detach", "unbound",
})


def op_name(n: fx.Node) -> str:
    """The method or function name a call node runs ("" for anything else)."""
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        return getattr(n.target, "__name__", "")
    return ""


def is_view(n: fx.Node) -> bool:
    """Whether ``n`` calls an op whose result is a view of its input (:data:`VIEW_OPS`)."""
    return n.op in ("call_method", "call_function") and op_name(n) in VIEW_OPS


def storage_of(v: Any) -> int | None:
    """The address of a strided tensor's storage (what in-place writes are tracked by); None otherwise."""
    return v.untyped_storage().data_ptr() if isinstance(v, torch.Tensor) and v.layout == torch.strided else None


@dataclass
class GraphRun:
    """What one run of a traced graph showed about its nodes, holding no more memory than a forward does.

    Attributes:
        values: each node's value, every tensor in it as a stand-in on the meta device (its shape, dtype and
            strides); the graph's inputs, attributes and outputs as they were.
        storage: for each node whose value is a strided tensor, the storage it lives in, numbered in order of
            first sight (a view has its source's number; an empty tensor has none).
        last_write: for each storage number an op wrote into in place (its version counter advanced), the
            position of the last node that did.
    """

    values: dict[fx.Node, Any] = field(default_factory=dict)
    storage: dict[fx.Node, int] = field(default_factory=dict)
    last_write: dict[int, int] = field(default_factory=dict)


def _stand_in(v: Any) -> Any:
    """``v`` with every strided tensor in it replaced by an empty one of its shape, dtype and strides on the meta
    device (no memory); other values as they are."""
    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype or subclass the meta device lacks
            return t
    return fx.node.map_aggregate(v, meta)


def node_values(gm: fx.GraphModule, env: dict[str, Any]) -> GraphRun:
    """Run the traced graph once and record what its values look like (:class:`GraphRun`). Each value is freed
    after its last reader, as in a forward without gradients, so that a graph captured on a whole batch (a
    model that runs on no part of it) holds what such a forward holds, not every activation at once."""
    run = GraphRun()
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    kept = set(nodes[-1].all_input_nodes) if nodes and nodes[-1].op == "output" else set()
    numbers: dict[int, tuple[StorageWeakRef, int]] = {}  # address -> (the storage there, its number)
    fresh = itertools.count(1)

    def number(v: Any) -> int | None:
        ptr = storage_of(v)
        if not ptr:
            return None
        hit = numbers.get(ptr)
        if hit is None or hit[0].expired():  # a storage freed since, its address given to a new one
            hit = numbers[ptr] = (StorageWeakRef(v.untyped_storage()), next(fresh))
        return hit[1]

    class _Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op == "placeholder":
                v = env[n.target] if n.target in env else (n.args[0] if n.args else None)
            else:
                args = [self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), torch.Tensor)]
                before = [a._version for a in args]
                v = super().run_node(n)
                for a, version in zip(args, before):
                    k = number(a)
                    if a._version != version and k is not None:
                        run.last_write[k] = position[n]
            k = number(v)
            if k is not None:
                run.storage[n] = k
            run.values[n] = v if n.op in ("placeholder", "get_attr") or n in kept else _stand_in(v)
            return v

    _Rec(gm).run(*[env.get(n.target) for n in nodes if n.op == "placeholder"])
    return run
