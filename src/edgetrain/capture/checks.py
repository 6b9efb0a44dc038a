"""Does a traced graph keep what the model's forward does beyond its values? Checks run at capture.

* :func:`gradient_mismatch`: the model's own autograd graph and the traced graph's, from one forward each with
  gradients, reach the same parameters (a ``torch.no_grad()`` block vanishes from a trace) and run the same
  custom ``torch.autograd.Function`` backwards (a trace differentiates a Function's forward ops instead).
* :func:`graph_checks`: that, and the ops writing into arguments autograd saves, whose replay must not stop
  early (:func:`~edgetrain.capture.chain.argument_writer_nodes`); run :func:`isolated`, in a forked child.
* :func:`hooked_traced_modules`: hooks on modules a trace runs through (it runs them once, while tracing).
* :func:`reproducible`, :func:`same`: whether two forwards from the same state agree (a replay would).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import fx, nn

from .._state import preserved_model_state
from ..batch import slice_batch, tensors_in
from ..forking import answer_in_fork
from .chain import argument_writer_nodes, buffer_sample

__all__ = ["HOOKED", "NOT_REPLAYABLE", "TRACED_RANDOM", "HOST_RANDOM", "GRAD_MODE", "autograd_nodes",
           "hooked_traced_modules", "reproducible", "same", "own_graph", "gradient_mismatch", "graph_checks",
           "isolated", "buffer_values", "unlike_buffers"]

log = logging.getLogger(__name__)


#: Why a model with hooks on modules a trace runs through is not traced (%s names them).
HOOKED = ("hooks are registered on %s, whose code a torch.fx trace would run through: the trace runs a hook once, "
          "while tracing, and never in a step (a forward hook keeping an activation for the loss, a backward hook "
          "scaling gradients)")


#: Why a chain is one stage that is never recomputed (``Chain.replayable`` False); %s is the model's class.
NOT_REPLAYABLE = ("%s's forward does not reproduce its output from the same random state and buffers (does it write "
                  "into its inputs in place, draw from a generator that is not a torch.Generator attribute of one "
                  "of its modules, or read the clock?): recomputation would differ from the first forward, so it "
                  "trains as one stage that is never recomputed (micro-batching only)")


#: Why a model whose forward draws from torch's generator while being traced is not traced (%s: its class).
TRACED_RANDOM = ("%s's forward draws from torch's generator where no traced tensor is involved (torch.rand([]) "
                 "deciding whether a layer runs, as LayerDrop does), which a traced graph would freeze into "
                 "constants; its blocks are the stages instead (a recomputation replays their draws)")


#: Why a model that draws from NumPy's or Python's generator is not traced (%s is the model's class).
HOST_RANDOM = ("%s's forward draws from NumPy's or Python's random generator, which a traced graph would freeze "
               "into constants; its blocks are the stages instead (a recomputation replays those generators)")


#: Why a model whose traced graph depends on the gradient mode is not traced (%s is the model's class).
GRAD_MODE = ("%s's forward branches on torch.is_grad_enabled(): a trace would keep the branch taken while tracing, and "
             "a step runs with gradients on; its blocks are the stages instead, each running its own forward")


def hooked_traced_modules(model: nn.Module, is_leaf: Callable[[nn.Module, str], bool]) -> list[str]:
    """The modules a trace runs through (not leaves, nor inside one) that carry forward or backward hooks, the
    model itself included (a traced step never calls it); every module where global module hooks are set.
    A leaf runs as a call of its own in the traced graph, hooks and all."""
    from torch.nn.modules import module as _module

    if any(getattr(_module, k, None) for k in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                "_global_backward_hooks", "_global_backward_pre_hooks")):
        return ["every module (global module hooks)"]
    inside: list[str] = []
    hooked = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if name and is_leaf(m, name):
            inside.append(name)
            continue
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            hooked.append(f"'{name}'" if name else "the model")
    return hooked


@dataclass
class _Graph:
    """What a backward from a forward's output would run: the leaf tensors given gradients (by id), the custom
    ``torch.autograd.Function`` classes whose backward it calls, the names of its nodes; and the inputs the
    forward was given (one, two or all samples of the example)."""

    leaves: set[int]
    custom: set[type]
    nodes: set[str]
    inputs: dict[str, Any]


def autograd_nodes(roots: list[Any]) -> set[Any]:
    """The autograd nodes reachable from ``roots`` (``grad_fn`` objects; None entries skipped)."""
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return seen


def _autograd_graph(out: Any, inputs: dict[str, Any]) -> _Graph:
    graph = _Graph({id(t) for t in tensors_in(out) if t.requires_grad and t.grad_fn is None}, set(), set(), inputs)
    for fn in autograd_nodes([t.grad_fn for t in tensors_in(out)]):
        graph.nodes.add(type(fn).__name__)
        if hasattr(fn, "variable"):  # AccumulateGrad
            graph.leaves.add(id(fn.variable))
        elif isinstance(fn, torch.autograd.function.BackwardCFunction):
            graph.custom.add(type(fn))
    return graph


def own_graph(model: nn.Module, env: dict[str, Any]) -> _Graph | None:
    """The model's own forward's autograd graph (:class:`_Graph`), from one forward with gradients on one
    sample where the model takes one, else two, else the whole example (a BatchNorm over ``[N, C]`` needs
    two in training mode); buffers and generators put back. None where none runs (then nothing is checked)."""
    for inputs in ({k: slice_batch(v, 0, 1) for k, v in env.items()},
                   {k: slice_batch(v, 0, 2) for k, v in env.items()}, env):
        try:
            with torch.enable_grad(), preserved_model_state(model):
                return _autograd_graph(model(**inputs), inputs)
        except Exception:
            continue
    return None


def gradient_mismatch(gm: fx.GraphModule, own: _Graph | None, names: dict[int, str]) -> str:
    """How the traced graph's backward would differ from the model's own (empty where it would not), from one
    forward of it with gradients on the inputs ``own`` was made from (no backward, no gradients made).

    A trace records the ops a forward runs, not how autograd is told to differentiate them: a
    ``torch.no_grad()`` block (a frozen teacher) would be trained, so the two must give gradients to the same
    parameters; a custom ``torch.autograd.Function`` (a straight-through estimator, a gradient reversal) is
    traced as its forward's ops and differentiated as those, so every Function class in the model's own
    graph must be in the traced one (the lean passes add classes of their own: more is fine)."""
    if own is None:
        return ""
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        with torch.enable_grad(), preserved_model_state(gm):
            traced = _autograd_graph(gm(*[own.inputs.get(k) for k in placeholders]), own.inputs)
    except Exception:  # it ran on the example batch already; it cannot fail here but on resources
        return ""
    lost = sorted(t.__name__.removesuffix("Backward") for t in own.custom - traced.custom)
    if lost:
        return f"custom torch.autograd.Function {', '.join(lost)} would be differentiated as its forward's ops"
    for leaf in (own.leaves ^ traced.leaves) & set(names):
        return f"{names[leaf]} gets a gradient " + ("in the traced graph and none from the forward"
                                                    if leaf in traced.leaves else
                                                    "from the forward and none in the traced graph")
    return ""


def graph_checks(model: nn.Module, gm: fx.GraphModule | None, env: dict[str, Any]) -> tuple[list[str], str]:
    """From the model's own autograd graph (:func:`own_graph`): the ops in it that write into an argument
    autograd saves (:func:`~edgetrain.capture.chain.argument_writer_nodes`), and, given the traced graph, how
    its backward would differ (:func:`gradient_mismatch`)."""
    own = own_graph(model, env)
    if own is None:
        return [], ""
    writers = sorted(n.removesuffix("Backward0") for n in own.nodes & argument_writer_nodes())
    names = {id(p): n for n, p in model.named_parameters()}
    return writers, ("" if gm is None else gradient_mismatch(gm, own, names))


def isolated(fn: Callable[[], Any], default: Any, run: Callable[[Callable[[], Any]], Any] | None = None) -> Any:
    """``fn()`` in a forked child where possible: forwards with gradients leave heap behind (ResNet-18 at two
    samples: 2.8 MiB, 1 MiB of it on the first step's peak) that a process training under a budget must not
    carry into its steps after the plans were measured, nor a forked child of the analysis into the memory it
    measures (its predicted peaks came out 2% above the validation runs').

    ``run(fn)`` forks and returns ``fn()``'s value, or None where it could not (``prepare``'s analysis hands
    in its own forking); without it, :func:`edgetrain.forking.answer_in_fork` (a child running this
    process's intra-op threads). Where neither answers, ``fn`` runs here; ``default`` where it fails."""
    value = run(fn) if run is not None else answer_in_fork(fn)
    if value is not None:
        return value
    try:
        return fn()
    except Exception as e:
        log.info("capture's gradient checks skipped: %s: %s", type(e).__name__, e)
        return default


def reproducible(model: nn.Module, env: dict[str, Any], host_rngs: bool = True) -> bool:
    """Whether two forwards on two samples of ``env``, from the same random state, buffers and generators,
    give the same output (a model drawing from a generator edgetrain cannot replay does not). With
    ``host_rngs=False`` NumPy's and Python's generators are not rewound between the two: a model that draws
    from them then differs (what a traced graph, which froze the draws at tracing, could not follow)."""
    for inputs in ({k: slice_batch(v, 0, 2) for k, v in env.items()}, env):  # the whole batch if 2 samples fail
        try:
            outs = []
            for _ in range(2):
                with preserved_model_state(model, host_rngs=host_rngs):
                    outs.append(model(**inputs))
            return same(outs[0], outs[1])
        except Exception:
            continue
    return True  # the example batch ran once already; it cannot fail here but on resources


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b)


def buffer_values(model: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Copies of the named buffers of ``model`` as they are now (after a forward: what it wrote into them); of a
    buffer over 1 MiB (a memory bank), an even sample of its elements (:func:`~.chain.buffer_sample`)."""
    bufs = dict(model.named_buffers())
    return {n: buffer_sample(bufs[n]) for n in names if n in bufs}


def unlike_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> list[str]:
    """Names of the buffers of ``model`` that are not (up to float rounding) ``values`` (:func:`buffer_values`)."""
    bufs = dict(model.named_buffers())
    return [n for n, v in values.items() if n not in bufs or not same(buffer_sample(bufs[n]), v)]
