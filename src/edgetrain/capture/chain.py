"""The chain a model is cut into: its stages, the names of the values they pass, and the model inputs.

Plain data plus the small amount of behaviour every consumer needs (running the stages in order, dropping
values no later stage reads). Made by :mod:`edgetrain.capture.trace` (torch.fx) or
:mod:`edgetrain.capture.modules` (the module tree); read by the profiler and executed by the runtime.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

import torch
from torch import nn

from ..errors import CaptureError

__all__ = ["Stage", "Chain", "OUTPUT_KEY", "bind_inputs", "buffer_sample", "managed_buffer", "mutated_buffers",
           "written_parameters", "stage_inputs", "grad_outputs", "argument_writer_nodes", "unwrap_compiled",
           "torchscript_in"]

OUTPUT_KEY = "__output__"
_BN = nn.modules.batchnorm._BatchNorm
_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def managed_buffer(model: nn.Module, qualname: str) -> bool:
    """Whether a buffer changed in forward is a BatchNorm running statistic, which edgetrain keeps exact
    under recomputation and micro-batching (:mod:`edgetrain.runtime.batchnorm`). Every BatchNorm layer,
    subclasses with a forward of their own included, runs as a module call (see :class:`_RetryTracer`),
    so those mechanisms see each of its calls."""
    owner, _, leaf = qualname.rpartition(".")
    try:
        mod = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return isinstance(mod, _BN) and mod.track_running_stats and leaf in _BN_BUFFERS


def mutated_buffers(model: nn.Module, run: Callable[[], Any]) -> tuple[tuple[str, ...], Any]:
    """Names of the buffers ``run()`` wrote: in place (their version counter advanced, or their shape or values
    changed), or by assigning the module another tensor; and its result.

    The values are compared as well as the version counters because some kernels write their tensor arguments
    without advancing them: quantization-aware training's ``fused_moving_avg_obs_fake_quant`` (every
    ``FusedMovingAvgObsFakeQuantize``, PyTorch's default QAT observer) updates its observer's min/max that
    way, and a recomputation that did not put them back observed each batch twice (min_val 1.6% off plain's
    after 3 steps, silently).
    """
    return _written(list(model.named_buffers()), lambda: dict(model.named_buffers()), run)


def written_parameters(model: nn.Module, run: Callable[[], Any]) -> tuple[tuple[str, ...], Any]:
    """Names of the parameters ``run()`` wrote, as :func:`mutated_buffers` finds buffers (through ``.data`` too),
    and its result. An embedding's own renormalisation (``max_norm``) is left out: it is idempotent."""
    renormed = {id(m.weight) for m in model.modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None}
    params = [(n, p) for n, p in model.named_parameters() if id(p) not in renormed]
    return _written(params, lambda: dict(model.named_parameters()), run)


def _written(named: list[tuple[str, torch.Tensor]], current: Callable[[], dict[str, torch.Tensor]],
             run: Callable[[], Any]) -> tuple[tuple[str, ...], Any]:
    """Names of the ``named`` tensors ``run()`` wrote (version counter, identity under ``current()``, or contents
    changed), and its result."""
    before = [(t._version, _contents(t)) for _, t in named]
    out = run()
    now = current()
    return tuple(n for (n, t), (v, old) in zip(named, before)
                 if t._version != v or now.get(n) is not t or not _same(_contents(t), old)), out


#: buffers up to this size are compared whole; larger ones (attention masks, rotary tables: constants in
#: practice) by shape, storage, sum and an even sample of 4096 elements, so no full copy is held
_WHOLE_BYTES = 1 << 20


def buffer_sample(b: torch.Tensor) -> torch.Tensor:
    """A copy of ``b``, or of an even sample of 4096 of its elements where it is over :data:`_WHOLE_BYTES`."""
    b = b.detach()
    if b.numel() * b.element_size() <= _WHOLE_BYTES:
        return b.clone()
    flat = b.reshape(-1)
    return flat[:: max(1, flat.numel() // 4096)].clone()


def _contents(b: torch.Tensor) -> tuple[Any, ...]:
    b = b.detach()
    if b.numel() * b.element_size() <= _WHOLE_BYTES:
        return (b.shape, buffer_sample(b))
    flat = b.reshape(-1)
    total = flat.sum(dtype=torch.float64) if not b.dtype.is_complex else flat.sum()
    return (b.shape, b.data_ptr(), total.item(), buffer_sample(b))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two :func:`_contents` agree (NaNs equal to themselves)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a[:-1], b[:-1]):  # shape, storage, sum (a NaN sum equals a NaN sum)
        if x != y and not (isinstance(x, float) and isinstance(y, float) and x != x and y != y):
            return False
    x, y = a[-1], b[-1]
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if torch.equal(x, y):
        return True
    return bool((x.is_floating_point() or x.is_complex()) and ((x == y) | (x.isnan() & y.isnan())).all())


def _camel(op: str) -> str:
    return "".join(w[:1].upper() + w[1:] for w in op.split("_") if w)


@functools.lru_cache(maxsize=None)
def argument_writer_nodes() -> frozenset[str]:
    """Autograd node names (``RreluWithNoiseBackward0``) of the ATen ops that write into a tensor argument other
    than the one they update in place, such as ``rrelu_with_noise``, which fills the ``noise`` tensor handed
    to it (``nn.RReLU`` in training mode); read from the registered schemas once.

    Autograd saves such an argument before the kernel writes it, and a non-reentrant
    ``torch.utils.checkpoint`` stops its replay once the last saved tensor is back: when that is the
    argument, the kernel never runs in the replay and backward reads an unfilled tensor (an ``nn.RReLU``
    recomputed alone gave gradients of 1e19-1e35, with no error). A chain whose graph has such a node is
    replayed in full (:attr:`Chain.early_stop`). BatchNorm's running statistics are left out: a
    training-mode backward does not read them.
    """
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::") or "out" in schema.overload_name:
            continue
        op = schema.name.split("::", 1)[1]
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write or arg.is_out or arg.name in ("running_mean", "running_var") \
                    or str(arg.type) not in ("Tensor", "Optional[Tensor]"):  # lists and dicts: TorchScript's
                continue
            if i == 0 and op.endswith("_"):  # the op's own in-place update: saved after it, if at all
                continue
            names.add(_camel(op.rstrip("_")) + "Backward0")
            break
    return frozenset(names)


@dataclass
class Stage:
    """One stage of the chain: a callable over named values of the running environment.

    Attributes:
        index: position in the chain.
        name: readable name (first and last module it covers).
        fn: callable taking ``inputs`` positionally and returning a tuple of ``outputs``.
        inputs: names of the values it reads.
        outputs: names of the values it produces that later stages (or the loss) read.
        modules: the submodules whose code runs inside the stage.
        mutates: qualified names of the model buffers its forward changes in place (BatchNorm running
            statistics, counters, power-iteration vectors), as seen on the example batch.
        owns_input: its backward may write an input gradient over one of its inputs
            (:mod:`edgetrain.capture.rewrite`): whoever runs it twice on the same inputs copies them.
        call: for a block of a ``"modules"`` chain, which call of its module in one forward it is (0 unless
            the forward calls the module several times, sharing its weights).
    """

    index: int
    name: str
    fn: Callable[..., tuple[Any, ...]]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    modules: tuple[nn.Module, ...] = ()
    mutates: tuple[str, ...] = ()
    owns_input: bool = False
    call: int = 0

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return self.fn(*args)


@dataclass
class Chain:
    """A model as a chain of stages (the result of :func:`capture`)."""

    stages: list[Stage]
    input_names: tuple[str, ...]
    method: str
    leaf_modules: tuple[str, ...] = ()
    last_use: dict[str, int] = field(default_factory=dict)
    model: nn.Module | None = None
    call_kwargs: dict[str, Any] = field(default_factory=dict)  # "modules" chains: extra keyword inputs
    replayable: bool = True  # False: the forward is not reproducible from the same state, never recompute it
    # "modules" chains: the forward skips blocks at random (LayerDrop), so one run's peak is a lower bound
    skips_blocks: bool = False
    # why the model trains as one stage; capture logs it at INFO (prepare's forked children capture too) and
    # the step prepared with the chain warns once
    warning: str = ""
    # False: an op writes into an argument autograd saves (see argument_writer_nodes); replays run to the end
    early_stop: bool = True
    # "fx" chains: the module-level globals the trace read, baked into its code (edgetrain.capture.reads)
    globals_read: tuple[tuple[str, dict[str, Any], str], ...] = ()
    # "fx" chains: what edgetrain.capture.draws.probe found of its dropout sites (None: not checked yet)
    draw_sites: Any = None

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def unmanaged_mutations(self) -> tuple[str, ...]:
        """Buffers changed in forward that edgetrain's BatchNorm mechanisms do not own (see
        :func:`managed_buffer`): once per forward, so micro-batching would change them once per micro-batch."""
        if self.model is None:
            return ()
        return tuple(n for st in self.stages for n in st.mutates if not managed_buffer(self.model, n))

    def run(self, env: dict[str, Any]) -> Any:
        """Run every stage plainly on an environment of model inputs and return the model output."""
        for st in self.stages:
            outs = st(*(env[k] for k in st.inputs))
            env.update(zip(st.outputs, outs))
            self.release(env, st.index)
        return env[OUTPUT_KEY]

    def release(self, env: dict[str, Any], stage_index: int) -> None:
        """Drop values no stage after ``stage_index`` reads (so memory follows the plan)."""
        for k in [k for k in env if k != OUTPUT_KEY and self.last_use.get(k, -1) <= stage_index]:
            del env[k]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, with a warning, or ``model``.

    edgetrain's steps run the model's own forward (recomputing, micro-batching, replaying random draws),
    eagerly: the wrapped module, whose parameters are the wrapper's, is what it trains."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        warnings.warn(f"edgetrain was given a torch.compile'd {type(inner).__name__}: it trains the module the "
                      "compiled wrapper holds (the same parameters), running it eagerly; pass the model before "
                      "torch.compile to silence this, with PlanConfig(compile=True) to run the step compiled where "
                      "a measured compiled step fits the budget", stacklevel=3)
        return inner
    return model


def bind_inputs(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """Name the model inputs the way ``model.forward``'s signature does (tensor, tuple or dict)."""
    sig = inspect.signature(model.forward)
    try:
        if isinstance(inputs, Mapping):
            bound = sig.bind(**inputs)
        elif isinstance(inputs, (tuple, list)):
            bound = sig.bind(*inputs)
        else:
            bound = sig.bind(inputs)
    except TypeError as e:
        hint = "Pass a tensor, a tuple of positional inputs, or a dict of keyword inputs."
        if isinstance(inputs, (tuple, list)) and _binds(sig, inputs):
            hint = (f"A {type(inputs).__name__} is taken as the forward's positional inputs; to pass it as its one "
                    "input (views, crops), wrap it in a tuple of one: example=((views,), targets), "
                    "step((views,), targets).")
        raise CaptureError(f"the inputs do not match {type(model).__name__}.forward{sig}: {e}. {hint}") from e
    bound.apply_defaults()
    env: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            env.update(value)  # forward(x, **kwargs): the extra keywords are inputs of their own
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise CaptureError(f"{type(model).__name__}.forward{sig} takes *{name}; edgetrain calls the model "
                                   "with its inputs by name, which *args cannot take: wrap it in a module whose "
                                   "forward names them (def forward(self, x, mask): return model(x, mask))")
        else:
            env[name] = value
    return env


def _binds(sig: inspect.Signature, one: Any) -> bool:
    try:
        sig.bind(one)
        return True
    except TypeError:
        return False


def stage_inputs(stage: Any, env: dict[str, Any], live: Container[str]) -> tuple[list[Any], list[torch.Tensor]]:
    """A stage's arguments from ``env``, each floating-point tensor in ``live`` (made by an earlier stage and
    carrying a gradient in a step) detached into a leaf that requires grad, as the stage sees it in a step
    (copied for a stage that owns an input); returns the arguments and those leaves.

    A tensor an earlier stage made without a gradient (a frozen backbone's features: no trainable parameter
    and no such input upstream) stays a plain tensor: a step saves nothing for its backward and runs none,
    and a stage profiled as if it did would be charged activations and backward time it never has.
    """
    args: list[Any] = []
    leaves: list[torch.Tensor] = []
    for k in stage.inputs:
        v = env[k]
        if k in live and isinstance(v, torch.Tensor) and v.is_floating_point():
            # a stage that owns an input writes its gradient there: it gets a copy, env keeps the value
            v = (v.detach().clone() if getattr(stage, "owns_input", False) else v.detach()).requires_grad_(True)
            leaves.append(v)
        args.append(v)
    return args, leaves


def grad_outputs(stage: Any, outs: Any) -> set[str]:
    """The names of ``stage``'s outputs that carry a gradient (what :func:`stage_inputs` takes as ``live``)."""
    return {k for k, o in zip(stage.outputs, outs) if isinstance(o, torch.Tensor) and o.requires_grad}


def torchscript_in(model: nn.Module, chain: "Chain") -> str:
    """The first TorchScript module or function the chain runs ('' when none).

    A checkpoint's replay stops early by raising an exception from a saved-tensor hook; raised inside the
    TorchScript interpreter, it comes out as a RuntimeError the checkpoint does not recognise, and the
    backward fails (an ``nn.Sequential`` passed through ``torch.jit.script`` failed every recomputed step).
    """
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            return name or type(m).__name__
    for st in chain.stages:
        graph = getattr(st.fn, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function" and isinstance(node.target, torch.jit.ScriptFunction):
                return str(getattr(node.target, "name", node.target))
    return ""
