"""Cut a model into a chain of stages with one new tensor crossing each cut.

torch.fx traces the model; a submodule whose forward cannot be traced (data-dependent control flow) is
retried as an opaque leaf, innermost first. Graph passes (:mod:`edgetrain.capture.rewrite`) then make in-place
ops out-of-place and some ops leaner, with the same values. Cuts go at every point of the graph where
exactly one tensor made since the previous cut (besides the model's own inputs and non-tensor values such
as sizes) is used after; tensors made before it may cross too, so a residual block is cut inside with its
skip input *carried* across (``carry_cuts=False`` keeps skip connections inside a stage). Adjacent cut
points are merged until at most ``max_stages`` stages remain, balancing the activation bytes per stage.
A model that fx cannot trace at all is cut along its module tree (:mod:`edgetrain.capture.modules`: the
blocks of a ``ModuleList`` / ``Sequential`` its forward calls once each), and one without such blocks
becomes a single stage (micro-batching still applies), unless ``strict=True``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from .._state import preserved_model_state, rng_moved, rng_state, set_rng_state
from ..errors import CaptureError
from .chain import OUTPUT_KEY, Chain, Stage, bind_inputs, mutated_buffers, torchscript_in
from .checks import (GRAD_MODE, HOOKED, HOST_RANDOM, NOT_REPLAYABLE, TRACED_RANDOM, buffer_values, graph_checks,
                     hooked_traced_modules, isolated, reproducible, same, unlike_buffers)
from .fxnodes import GraphRun, node_values
from .lean import memory_format_of
from .modules import blocks_behind, module_chain
from .reads import globals_read, recording_globals
from .rewrite import MODULE_META, disown_stage_inputs, fresh_activation, keeps_input, rewrite

__all__ = ["capture"]

log = logging.getLogger(__name__)
_BN = nn.modules.batchnorm._BatchNorm


class _RetryTracer(fx.Tracer):
    """fx tracer that remembers the innermost module whose forward failed to trace."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        # Buffers are graph values, not constants of the trace: an in-place write to one (a counter
        # ``self.calls.add_(1)``) is then a node of the graph instead of a side effect of tracing.
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self.failed_at: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # A BatchNorm subclass with a forward of its own (timm's BatchNormAct2d: F.batch_norm on its buffers,
        # then an activation) stays a module call, so that the hooks keeping running statistics exact see it.
        return qualname in self.leaves or isinstance(m, _BN) or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                try:
                    self.failed_at = self.path_of_module(m)
                except Exception:  # module not registered under the root
                    self.failed_at = ""
            raise


# Attributes a GraphModule sets on itself: a submodule of the model with one of these names would clash.
_RESERVED = frozenset({"meta", "graph", "code", "_graph", "_code", "forward"})


def _graph_module(model: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(model, graph)``, with top-level children whose names clash with a GraphModule's own
    attributes (a submodule called ``meta``) reached under another name (the same module objects)."""
    clash = {str(n.target).split(".")[0] for n in graph.nodes if n.op in ("call_module", "get_attr")} & _RESERVED
    if not clash:
        return fx.GraphModule(model, graph, type(model).__name__)
    root = nn.Module()
    root.training = model.training
    for name, child in model.named_children():
        root.add_module(f"_et_{name}" if name in clash else name, child)
    for name, p in model.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        root.register_buffer(name, b)
    for name, v in vars(model).items():  # tensor constants fx stored on the model
        if isinstance(v, torch.Tensor) and not hasattr(root, name):
            setattr(root, name, v)
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr"):
            head, dot, rest = str(n.target).partition(".")
            if head in clash:
                n.target = f"_et_{head}{dot}{rest}"
    return fx.GraphModule(root, graph, type(model).__name__)


def _trace(model: nn.Module, concrete: dict[str, Any], max_retries: int = 64) -> tuple[fx.GraphModule, set[str]]:
    leaves: set[str] = set()
    last_err: Exception | None = None
    for _ in range(max_retries):
        tracer = _RetryTracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
            return _graph_module(model, graph), leaves
        except Exception as e:  # any tracing failure: retry with the failing module as a leaf
            last_err = e
            if not tracer.failed_at or tracer.failed_at in leaves:
                break
            log.debug("fx could not trace %s (%s); treating it as a leaf", tracer.failed_at, e)
            leaves.add(tracer.failed_at)
    raise CaptureError(f"torch.fx cannot trace {type(model).__name__}.forward: {last_err}")


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    return 0


def _cut_points(nodes: list[fx.Node], run: GraphRun, keeps_input: Callable[[fx.Node], bool] = lambda n: True,
                carry: bool = True) -> list[int]:
    """Indices p where exactly one non-input tensor made since the previous cut is used after p.

    With ``carry``, tensors made before the previous cut may cross too (a residual block's skip input:
    the block is then cut inside, its skip carried across); without, nothing else may cross.
    No cut goes after a view (its bytes are its source's), nor where every later reader of the new tensor
    frees it (``keeps_input`` false for all of them, e.g. a ReLU, whose backward reads its output): uncut,
    the tensor dies right after its reader; cut, a recomputed segment would keep it as its input.
    Nor where a node after p writes in place into a tensor crossing the cut (``run.last_write``, from
    :func:`node_values`): the runtime keeps a stage's inputs to
    re-run it, and an in-place op the graph passes could not make out-of-place would overwrite them (or
    fail on the leaf tensor a stage's gradient input is). Nor where a tuple, list or dict of floating-point
    tensors (a ``split``'s result, read item by item later) crosses: a stage's gradient inputs are tensors.
    """
    values, storage = run.values, run.storage
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((index[u] for u in n.users), default=index[n]) for n in nodes}
    cuts: list[int] = []
    live: set[fx.Node] = set()
    packed: set[fx.Node] = set()  # tuples / lists / dicts of float tensors (a ``split``'s result), still read
    for p, n in enumerate(nodes):
        if n.op == "output":
            break
        if n.op not in ("placeholder", "get_attr") and isinstance(values.get(n), torch.Tensor):
            live.add(n)
        elif n.op not in ("placeholder", "get_attr") and _holds_float_tensor(values.get(n)):
            packed.add(n)
        live = {x for x in live if last_use[x] > p}
        packed = {x for x in packed if last_use[x] > p}
        if packed:  # a stage's gradient inputs are tensors: a container crossing would tie two stages' graphs
            continue
        nxt = nodes[p + 1] if p + 1 < len(nodes) else None
        if nxt is None or nxt.op == "output":
            continue
        since = cuts[-1] if cuts else -1
        fresh = [x for x in live if index[x] > since]
        if len(fresh) == 1 and (carry or len(live) == 1) and not _is_view(fresh[0], storage) and any(
                keeps_input(u) for u in fresh[0].users if index[u] > p) and not any(
                run.last_write.get(storage.get(x, 0), -1) > p for x in live):
            cuts.append(p)
    return cuts


def _holds_float_tensor(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() or _holds_float_tensor(x) for x in v)
    if isinstance(v, dict):
        return _holds_float_tensor(list(v.values()))
    return False


def _is_view(n: fx.Node, storage: dict[fx.Node, int]) -> bool:
    """Whether ``n``'s value shares storage with a tensor it was made from (a reshape, permute, slice):
    cut there, the same bytes would cross twice."""
    k = storage.get(n)
    return k is not None and any(storage.get(a) == k for a in n.all_input_nodes)


def _coarsen(cuts: list[int], nodes: list[fx.Node], values: dict[fx.Node, Any], max_stages: int) -> list[int]:
    if len(cuts) + 1 <= max_stages:
        return cuts
    weight = [_nbytes(values.get(n)) if n.op not in ("placeholder", "get_attr", "output") else 0 for n in nodes]
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    total = prefix[-1] or 1
    target = total / max_stages
    chosen: list[int] = []
    last = 0
    for p in cuts:
        if prefix[p + 1] - last >= target and len(chosen) < max_stages - 1:
            chosen.append(p)
            last = prefix[p + 1]
    return chosen


def _module_name(n: fx.Node) -> str | None:
    """The qualified name of the module ``n`` runs: its target, or the one a graph rewrite recorded."""
    return str(n.target) if n.op == "call_module" else n.meta.get(MODULE_META)


def _stage_name(nodes: Sequence[fx.Node]) -> str:
    mods = [m for m in map(_module_name, nodes) if m is not None]
    if not mods:
        ops = [getattr(n.target, "__name__", str(n.target)) for n in nodes if n.op in ("call_function", "call_method")]
        return "+".join(ops[:2]) or "stage"
    return mods[0] if len(mods) == 1 else f"{mods[0]}..{mods[-1]}"


def _build_stages(gm: fx.GraphModule, nodes: list[fx.Node], cuts: list[int],
                  input_names: Sequence[str] = ()) -> tuple[list[Stage], dict[str, int]]:
    bounds = [-1] + cuts + [len(nodes) - 2]  # the last node is the output node
    out_node = nodes[-1]
    owner: dict[fx.Node, int] = {}
    for s in range(len(bounds) - 1):
        for n in nodes[bounds[s] + 1: bounds[s + 1] + 1]:
            owner[n] = s
    stages: list[Stage] = []
    last_use: dict[str, int] = {}
    n_stages = len(bounds) - 1
    inputs_set = set(input_names) or {str(n.target) for n in nodes if n.op == "placeholder"}
    for s in range(n_stages):
        members = [n for n in nodes[bounds[s] + 1: bounds[s + 1] + 1] if n.op != "placeholder"]
        g = fx.Graph()
        local: dict[fx.Node, fx.Node] = {}
        inputs: list[str] = []

        def fetch(a: fx.Node) -> Any:
            if a in local:
                return local[a]
            if a.op == "placeholder" and str(a.target) not in inputs_set:
                # a non-tensor input fixed at trace time (concrete_args: ``temperature=1.0``, ``mask=None``)
                local[a] = a.args[0] if a.args else None
                return local[a]
            if a.op == "get_attr":
                local[a] = g.get_attr(a.target)  # parameters/buffers are shared with the user's model
            else:
                key = str(a.target) if a.op == "placeholder" else a.name
                local[a] = g.placeholder(key)
                inputs.append(key)
                last_use[key] = max(last_use.get(key, -1), s)
            return local[a]

        for n in members:
            for a in n.all_input_nodes:
                if a not in local and (a.op == "get_attr" or owner.get(a) != s or a.op == "placeholder"):
                    fetch(a)
            local[n] = g.node_copy(n, lambda a: local[a])
        last = s == n_stages - 1
        outputs = [n for n in members if n.op != "get_attr" and any(
            (u.op != "output" and owner.get(u, n_stages) > s) or (u.op == "output" and not last) for u in n.users)]
        out_vals: list[Any] = [local[n] for n in outputs]
        out_names = [n.name for n in outputs]
        if last:
            out_vals.append(fx.node.map_arg(out_node.args[0], lambda a: fetch(a) if a not in local else local[a]))
            out_names.append(OUTPUT_KEY)
        g.output(tuple(out_vals))
        owns = disown_stage_inputs(g, {a.name for a in local if a.op != "placeholder" and fresh_activation(a)
                                       and owner.get(a) != s})
        sub = fx.GraphModule(gm, g, f"stage{s}")
        mods = tuple(gm.get_submodule(m) for m in map(_module_name, members) if m is not None)
        stages.append(Stage(index=s, name=_stage_name(members), fn=sub, inputs=tuple(inputs),
                            outputs=tuple(out_names), modules=mods, owns_input=owns))
    return stages, last_use


def _single_stage(model: nn.Module, names: tuple[str, ...], mutates: tuple[str, ...]) -> Chain:
    def fn(*vals: Any) -> tuple[Any, ...]:
        return (model(**dict(zip(names, vals))),)

    st = Stage(0, type(model).__name__, fn, names, (OUTPUT_KEY,), tuple(model.modules()), mutates)
    return Chain([st], names, "single", (), {k: 0 for k in names}, model)


def _fallback(model: nn.Module, env: dict[str, Any], names: tuple[str, ...], mutates: tuple[str, ...],
              why: str, strict: bool) -> Chain:
    """Stages from the module tree where fx failed (``_capture_modules.module_chain``), else one stage."""

    if strict:
        raise CaptureError(why)
    try:
        chain = module_chain(model, env, names, mutates)
    except Exception as e:  # the module tree cannot be followed: one stage still trains exactly
        log.info("following the module tree of %s failed: %s", type(model).__name__, e)
        chain = None
    if chain is not None:
        log.info("%s; its %d repeated blocks are the stages (%s .. %s)", why, len(chain), chain.stages[0].name,
                 chain.stages[-1].name)
        return chain
    chain = _single_stage(model, names, mutates)
    chain.warning = (f"{why}, and it has no stack of blocks it could recompute (a ModuleList or Sequential called "
                     "once per forward, each block taking tensors and writing into none of them); training it as a "
                     "single stage (micro-batching only). Make the forward fx-traceable, or keep its blocks in a "
                     "ModuleList, to let edgetrain recompute inside it.")
    log.info(chain.warning)
    return chain


def _returning(fn: Callable[..., tuple[Any, ...]], cls: type) -> Callable[..., tuple[Any, ...]]:
    """``fn`` with its model output (the last value) rebuilt as ``cls`` (e.g. a Hugging Face ``ModelOutput``)."""
    def run(*args: Any) -> tuple[Any, ...]:
        outs = fn(*args)
        return (*outs[:-1], cls(**outs[-1]))
    run.graph = getattr(fn, "graph", None)  # type: ignore[attr-defined]
    run.get_buffer = getattr(fn, "get_buffer", None)  # type: ignore[attr-defined]
    return run


def _stage_mutations(stages: list[Stage], model: nn.Module, env: dict[str, Any]) -> None:
    """Run the stages once on the example (state restored after) and record what each writes in place. Each
    stage's outputs are dropped after the last stage that reads them, as a forward frees them."""
    env = dict(env)
    last = {k: i for i, st in enumerate(stages) for k in st.inputs}
    with preserved_model_state(model), torch.no_grad():
        for i, st in enumerate(stages):
            st.mutates, outs = mutated_buffers(model, lambda st=st: st(*(env[k] for k in st.inputs)))
            env.update(zip(st.outputs, outs))
            del outs
            for k in [k for k in env if last.get(k, -1) <= i]:
                del env[k]


def capture(model: nn.Module, example_inputs: Any, *, max_stages: int = 48, strict: bool = False,
            carry_cuts: bool = True, writers: Sequence[str] | None = None,
            isolate: Callable[[Callable[[], Any]], Any] | None = None) -> Chain:
    """Cut ``model`` into a :class:`Chain` of stages, checked on ``example_inputs``.

    Args:
        model: any ``nn.Module``; its parameters and buffers are shared, never copied.
        example_inputs: a (small) batch: a tensor, a tuple of positional inputs or a dict of keyword inputs.
        max_stages: merge cut points until at most this many stages remain.
        strict: raise :class:`CaptureError` instead of falling back to the module tree or a single stage.
        carry_cuts: also cut inside residual blocks, where the block's skip input crosses the cut beside
            the running tensor (``StageCost.carried``); False keeps every block in one stage (planners
            without a model of carried tensors, such as the paging planners, need that).
        writers: the forward's ops that write into arguments autograd saves, where the caller has seen its
            autograd graph already (``prepare``'s loss check); None: found here, in a forked child.
        isolate: runs a function in a forked child and returns its value (None where it could not), for the
            checks that run forwards with gradients (:func:`edgetrain.capture.checks.isolated`).

    Returns:
        The chain. ``chain.method`` is ``"fx"``, ``"modules"`` (blocks of the module tree) or ``"single"``;
        a single stage says why in ``chain.warning`` (logged here at INFO; :func:`edgetrain.prepare` warns).

    Raises:
        CaptureError: the example batch does not run through the model, or (``strict``) no cut is possible.
    """
    with warnings.catch_warnings():
        # a model's own reentrant torch.utils.checkpoint says this on every forward without gradients, as
        # capture runs it; training forwards have them
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
        return _capture_checked(model, example_inputs, max_stages, strict, carry_cuts, writers, isolate)


def _capture_checked(model: nn.Module, example_inputs: Any, max_stages: int, strict: bool, carry_cuts: bool,
                     writers: Sequence[str] | None, isolate: Callable[[Callable[[], Any]], Any] | None) -> Chain:
    env = bind_inputs(model, example_inputs)
    with preserved_model_state(model), torch.no_grad():
        state = rng_state()
        try:
            with preserved_model_state(model):  # the traced graph runs below on the same buffers
                mutates, reference = mutated_buffers(model, lambda: model(**env))
                written = buffer_values(model, mutates)
        except Exception as e:
            if _runs_with_gradients(model, env):
                raise CaptureError(f"{type(model).__name__}'s forward fails without gradients ({type(e).__name__}: "
                                   f"{e}) and runs with them: it differentiates inside itself (torch.autograd.grad, as "
                                   "physics-informed networks, gradient penalties and force fields do). edgetrain "
                                   "analyses a forward without gradients and cannot plan such a model: train it "
                                   "with plain PyTorch.") from e
            raise CaptureError(f"{type(model).__name__} failed on the example batch: {type(e).__name__}: {e}. "
                               "Check the example's shapes and dtypes against the model.") from e
    chain = _capture(model, env, mutates, reference, written, state, max_stages, strict, carry_cuts, isolate)
    if chain.method != "fx" and chain.replayable:  # a traced chain was checked with its graph (_capture)
        _replay_to_the_end(chain, list(writers) if writers is not None else
                           isolated(lambda: graph_checks(model, None, env), ([], ""), isolate)[0])
    scripted = torchscript_in(model, chain)
    if scripted and chain.early_stop:
        chain.early_stop = False
        log.info("%s runs TorchScript (%s): recomputations replay each stage to its end", type(model).__name__,
                 scripted)
    return chain


def _runs_with_gradients(model: nn.Module, env: dict[str, Any]) -> bool:
    """Whether ``model`` runs on ``env`` with gradients on (its buffers and the generators put back after)."""
    try:
        with preserved_model_state(model), torch.enable_grad():
            model(**env)
        return True
    except Exception:  # noqa: BLE001 - it fails either way: the example is at fault
        return False


def _replay_to_the_end(chain: Chain, writers: list[str]) -> None:
    """Turn the checkpoints' early stop off for a chain whose forward writes into arguments autograd saves."""
    if writers:
        chain.early_stop = False
        log.info("%s writes into arguments autograd saves (%s): recomputations replay each stage to its end",
                 type(chain.model).__name__, ", ".join(writers))


def _capture(model: nn.Module, env: dict[str, Any], mutates: tuple[str, ...], reference: Any,
             written: dict[str, torch.Tensor], state: Any, max_stages: int, strict: bool, carry_cuts: bool,
             isolate: Callable[[Callable[[], Any]], Any] | None) -> Chain:
    # reference: the forward's output on the example; written: the buffers it wrote (buffer_values after it)
    names = tuple(env)
    with preserved_model_state(model), torch.no_grad():
        if not reproducible(model, env):
            chain = _single_stage(model, names, mutates)
            chain.replayable = False
            chain.warning = NOT_REPLAYABLE % type(model).__name__
            log.info(chain.warning)
            return chain
        if not reproducible(model, env, host_rngs=False):  # torch.fx would freeze its draws into constants
            return _fallback(model, env, names, mutates, HOST_RANDOM % type(model).__name__, strict)
        try:
            concrete = {k: v for k, v in env.items() if not isinstance(v, torch.Tensor)}
            with preserved_model_state(model), torch.enable_grad():  # as a step runs; the trace below runs without
                with_grad = _trace(model, concrete)[0].code  # (a trace assigns proxies to what `self.n += 1` writes)
            drawn = rng_state()
            with recording_globals() as ran:  # the Python code the trace runs, and so the globals it bakes in
                gm, leaves = _trace(model, concrete)
            if rng_moved(drawn, rng_state()):  # a draw ran while tracing, not on a traced tensor: frozen in the graph
                set_rng_state(state)
                return _fallback(model, env, names, mutates, TRACED_RANDOM % type(model).__name__, strict)
            if with_grad != gm.code:
                set_rng_state(state)
                return _fallback(model, env, names, mutates, GRAD_MODE % type(model).__name__, strict)
            hooked = hooked_traced_modules(model, _RetryTracer(leaves).is_leaf_module)
            if hooked:
                set_rng_state(state)
                return _fallback(model, env, names, mutates, HOOKED % (", ".join(hooked[:3]) + (
                    f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")), strict)
            rewrite(gm, channels_last=any(isinstance(v, torch.Tensor) and memory_format_of(v) is torch.channels_last
                                          for v in env.values()))  # same values, out-of-place and leaner
            set_rng_state(state)
            run = node_values(gm, env)
            unlike = unlike_buffers(model, written)  # what the trace wrote there
        except Exception as e:  # CaptureError from tracing, or the traced graph failing to run
            set_rng_state(state)
            why = str(e) if isinstance(e, CaptureError) else \
                f"the graph torch.fx traced from {type(model).__name__} does not run ({type(e).__name__}: {e})"
            return _fallback(model, env, names, mutates, why, strict)
    nodes, values = list(gm.graph.nodes), run.values
    out_val = values.get(nodes[-1].args[0]) if isinstance(nodes[-1].args[0], fx.Node) else \
        fx.node.map_aggregate(nodes[-1].args[0], lambda a: values.get(a) if isinstance(a, fx.Node) else a)
    if not same(out_val, reference) or unlike:
        what = (f"write buffer(s) {', '.join(unlike[:3])} as its forward does" if unlike else
                "reproduce its output on the example batch (data-dependent Python control flow?)")
        msg = f"the traced graph of {type(model).__name__} does not {what}"
        with preserved_model_state(model):
            return _fallback(model, env, names, mutates, msg, strict)
    writers, mismatch = isolated(lambda: graph_checks(model, gm, env), ([], ""), isolate)
    if mismatch:
        msg = (f"the graph torch.fx traced from {type(model).__name__} gives other gradients than its forward "
               f"({mismatch}): a trace does not record torch.no_grad / torch.enable_grad blocks or a custom "
               "torch.autograd.Function's backward inside the forward")
        with preserved_model_state(model):
            return _fallback(model, env, names, mutates, msg, strict)
    cuts = _coarsen(_cut_points(nodes, run, lambda n: keeps_input(gm, n), carry_cuts), nodes, values, max_stages)
    if not cuts and strict:
        raise CaptureError(f"{type(model).__name__} has no point where a single tensor crosses; "
                           "it cannot be cut into stages")
    tensor_inputs = [k for k, v in env.items() if isinstance(v, torch.Tensor)]
    stages, last_use = _build_stages(gm, nodes, cuts, tensor_inputs)
    if isinstance(reference, Mapping) and type(out_val) is not type(reference):
        stages[-1].fn = _returning(stages[-1].fn, type(reference))  # fx returns a ModelOutput as a plain dict
    _stage_mutations(stages, model, env)
    for k in names:
        last_use.setdefault(k, -1)
    if leaves:
        log.info("modules kept opaque (not fx-traceable): %s", ", ".join(sorted(leaves)))
        finer = blocks_behind(model, env, names, mutates, leaves, len(stages))
        if finer is not None:
            return finer
    chain = Chain(stages, names, "fx", tuple(sorted(leaves)), last_use, model, globals_read=globals_read(ran))
    _replay_to_the_end(chain, writers)
    return chain

