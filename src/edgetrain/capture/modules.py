"""Stages for models torch.fx cannot trace: the repeated blocks of the module tree.

Hugging Face models (their forwards take ``**kwargs``, build masks with data-dependent code and return
``ModelOutput`` objects) and many others do not trace. Their structure is still plain to see: a stack of
blocks in a ``ModuleList`` or ``Sequential`` that the model's own forward calls one after another, the
unit Hugging Face's per-layer gradient checkpointing wraps. Each such block becomes a stage, and the
model's own forward keeps running as written: :class:`~edgetrain.runtime.executor.ModuleExecutor` swaps a
block's ``forward`` for a checkpointed call of it while the step runs. What the forward does outside the
blocks (embeddings, masks, the head) is always kept; the profiler counts it as resident memory
(``CostChain.input_bytes``) and time beside the loss's.

A block qualifies when, on the example batch, it is not called inside another block and is handed nothing
but tensors and plain values (a block handed a cache object it appends to, such as a key/value cache, would
append twice when recomputed: the model then stays one stage; Hugging Face models are run with
``use_cache=False``, as their own gradient checkpointing does). A block the forward calls several times
(shared weights: ALBERT runs one layer group for every layer) gives a stage per call (``Stage.call``);
:class:`BlockCalls` tells which stage a call is, and a forward that calls a block a different number of
times than the example batch did is refused (:func:`check_calls`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from torch import nn

from .._state import preserved_model_state
from ..batch import tensors_in
from ..errors import InputError
from .chain import Chain, Stage

__all__ = ["BlockCalls", "check_calls", "find_blocks", "block_stages", "module_chain", "blocks_behind", "replay_kwargs"]

log = logging.getLogger(__name__)

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

#: runs in a row that must call no new block before the blocks of a forward that skips some at random are
#: taken as found (at least 10 runs: a block skipped with probability 0.5 goes unseen with probability 2**-10),
#: and the most runs
STABLE_RUNS, MAX_RUNS = 8, 64


def _containers_children(m: nn.Module) -> list[tuple[str, nn.Module]] | None:
    if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 1:
        return list(m.named_children())
    return None


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(model: nn.Module) -> tuple[list[str], set[str]]:
    """Qualified names of the candidate blocks: children of every ``ModuleList`` / ``Sequential``, each
    replaced by its own blocks where those hold (nearly) all of its parameters (a T5 block's list of attention
    and feed-forward layers; not a ViT block's MLP, which leaves its attention out); and those of them that
    are the only entry of their container (they qualify only if the forward calls them more than once). A
    model that is itself a ``Sequential`` is such a container."""
    alone: set[str] = set()

    def container(prefix: str, kids: list[tuple[str, nn.Module]]) -> list[str]:
        out: list[str] = []
        for kname, k in kids:
            inner = walk(f"{prefix}{kname}.", k)
            covered = sum(_numel(model.get_submodule(n)) for n in inner)
            fine = len(inner) >= 2 and covered >= 0.9 * _numel(k)
            if not fine and len(kids) == 1:
                alone.add(f"{prefix}{kname}")
            out.extend(inner if fine else [f"{prefix}{kname}"])
        return out

    def walk(prefix: str, m: nn.Module) -> list[str]:
        out: list[str] = []
        for name, child in m.named_children():
            kids = _containers_children(child)
            out.extend(container(f"{prefix}{name}.", kids) if kids is not None else walk(f"{prefix}{name}.", child))
        return out

    root = _containers_children(model) if isinstance(model, nn.Sequential) else None
    return (container("", root) if root is not None else walk("", model)), alone


def _plain(v: Any) -> bool:
    if isinstance(v, (torch.Tensor,) + _PLAIN):
        return True
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(x) for x in v.values())
    return False


def block_stages(model: nn.Module, env: dict[str, Any]) -> tuple[list[str] | None, bool]:
    """The calls of the blocks that qualify, in call order, a block once per call (None when fewer than two),
    and whether the forward calls different blocks from run to run.

    The forward runs twice, its random draws going on between; where the two call different blocks (LayerDrop
    skips layers at random), it runs again until :data:`STABLE_RUNS` runs in a row add no block, and the blocks
    are those any run called, in module-tree order (a plan must hold for a step that calls every block).
    """
    names, alone = find_blocks(model)
    if not names:
        return None, False
    mods = {n: model.get_submodule(n) for n in names}
    calls: list[str] = []
    active: list[str] = []
    bad: set[str] = set()
    handles = []
    versions: list[list[tuple[torch.Tensor, int]]] = []

    def pre(name: str):
        def hook(m: nn.Module, args: Any, kwargs: Any) -> None:
            if active or not _plain(args) or not _plain(kwargs):
                bad.add(name)
            active.append(name)
            calls.append(name)
            versions.append([(t, t._version) for t in tensors_in((args, kwargs))])
        return hook

    def post(name: str):
        def hook(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            active.pop()
            if any(t._version != v for t, v in versions.pop()):
                # a checkpoint holds the block's inputs to replay it: one the block writes into would be
                # replayed from its written value
                bad.add(name)
        return hook

    for n, m in mods.items():
        handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(m.register_forward_hook(post(n), with_kwargs=True, always_call=True))
    runs: list[list[str]] = []
    try:
        with preserved_model_state(model), torch.no_grad():
            seen: set[str] = set()
            quiet = 0
            while len(runs) < MAX_RUNS:
                calls.clear()
                model(**env)
                runs.append(list(calls))
                if len(runs) == 2 and runs[1] == runs[0]:
                    break  # the usual case: the same blocks in the same order
                quiet = quiet + 1 if set(calls) <= seen else 0
                seen.update(calls)
                if quiet >= STABLE_RUNS:
                    break
    finally:
        for h in handles:
            h.remove()
    calls = runs[0]
    varies = any(r != calls for r in runs)
    if varies:
        if any(len(set(r)) < len(r) for r in runs):
            log.info("the forward calls its blocks differently from run to run, and some more than once: no stages")
            return None, True
        union = {n for r in runs for n in r}
        calls = [n for n in names if n in union]
        log.info("the forward skips blocks at random (%d runs); every block any run called is a stage", len(runs))
    counts = {n: calls.count(n) for n in names}
    order = [n for n in calls if n not in bad and (counts[n] >= 2 or n not in alone)]
    if bad:
        log.info("blocks not recomputable (handed a stateful object, called inside another block, or writing into "
                 "a tensor handed to it): %s",
                 ", ".join(sorted(bad)))
    return (order if len(order) >= 2 else None), varies


def _block_alone(name: str) -> Callable[..., tuple[Any, ...]]:
    def fn(*args: Any) -> tuple[Any, ...]:
        raise RuntimeError(f"stage {name} is a block of the model's own forward and runs only inside it "
                           "(edgetrain.runtime.executor.ModuleExecutor)")
    return fn


def replay_kwargs(model: nn.Module, env: dict[str, Any]) -> dict[str, Any]:
    """Keyword inputs a training step adds to the model's own call: ``use_cache=False`` where the forward
    takes ``use_cache`` and the inputs do not ask for it (a key/value cache would be appended to again by
    a replay; Hugging Face's own gradient checkpointing turns it off too). A forward taking ``**kwargs`` takes
    it where the model's config has ``use_cache``: a wrapper that hands its keywords on to a Hugging Face model
    (PEFT's ``PeftModel``), whose blocks are otherwise handed a cache and cannot be recomputed."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    takes = "use_cache" in params or (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
                                      and isinstance(getattr(getattr(model, "config", None), "use_cache", None), bool))
    return {"use_cache": False} if takes and not env.get("use_cache") else {}


def module_chain(model: nn.Module, env: dict[str, Any], names: tuple[str, ...],
                  mutates: tuple[str, ...]) -> Chain | None:
    """A chain of the model's repeated blocks (:mod:`edgetrain.capture.modules`), or None without two."""
    call_kwargs = replay_kwargs(model, env)
    blocks, varies = block_stages(model, {**env, **call_kwargs})
    if blocks is None:
        return None
    stages, seen = [], {n: 0 for n in blocks}
    for i, name in enumerate(blocks):
        k, seen[name] = seen[name], seen[name] + 1
        label = f"{name}#{k}" if blocks.count(name) > 1 else name
        stages.append(Stage(i, label, _block_alone(label), (), (), (model.get_submodule(name),),
                            mutates if i == 0 else (), call=k))
    chain = Chain(stages, names, "modules", (), dict.fromkeys(names, len(stages) - 1), model, call_kwargs)
    chain.skips_blocks = varies
    return chain


def in_backward() -> bool:
    """Whether this code runs inside a backward pass: a block called there is the model's own reentrant
    ``torch.utils.checkpoint`` running it again, not a call of the forward (edgetrain's replays call the
    block's ``forward`` directly, never through its hooks or its patched ``forward``)."""
    return torch._C._current_graph_task_id() != -1


class BlockCalls:
    """Which stage of a ``"modules"`` chain each call of a block module is, counted over one forward.

    Call :meth:`reset` before each forward of the model; :meth:`stage` on each call of a block. Calls made
    inside a backward (:func:`in_backward`) are not the forward's and must not be counted.
    """

    def __init__(self, chain: Chain) -> None:
        self.slots: dict[int, list[int]] = {}
        blocks: dict[int, nn.Module] = {}
        for st in chain.stages:
            block = st.modules[0]
            self.slots.setdefault(id(block), []).append(st.index)
            blocks.setdefault(id(block), block)
        named = {id(m): n for n, m in chain.model.named_modules()} if chain.model is not None else {}
        self.names = {k: named.get(k, type(b).__name__) for k, b in blocks.items()}
        self.blocks = list(blocks.values())  # the distinct block modules, in the order of their first call
        self.counts: dict[int, int] = {}

    def reset(self) -> None:
        self.counts = {}

    def stage(self, module: nn.Module) -> int:
        """The stage index of this call of ``module`` (raises if the forward calls it more often than captured)."""
        key = id(module)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        slots = self.slots[key]
        if k >= len(slots):
            raise InputError(_miscount(self.names[key], k + 1, len(slots)))
        return slots[k]


def check_calls(calls: BlockCalls) -> None:
    """Raise if a forward just run called some block fewer times than the example batch did."""
    for key, slots in calls.slots.items():
        if calls.counts.get(key, 0) != len(slots):
            raise InputError(_miscount(calls.names[key], calls.counts.get(key, 0), len(slots)))


def _miscount(name: str, now: int, captured: int) -> str:
    return (f"block {name} ran {now} time(s) in this forward, {captured} on the example batch edgetrain planned "
            "with: its stages no longer match the model's calls (does the number of calls depend on the input?). "
            "Prepare the step with an example batch that calls it as training does.")


def blocks_behind(model: nn.Module, env: dict[str, Any], names: tuple[str, ...], mutates: tuple[str, ...],
                  leaves: set[str], traced: int) -> Chain | None:
    """The module-tree chain, where an opaque leaf of the trace hides a stack of blocks and that chain has
    more stages than the trace's ``traced``: a Hugging Face model handed an attention mask builds it with
    data-dependent code, so its whole encoder stays one opaque module while its layers are plain to see."""
    blocks, _ = find_blocks(model)
    hidden = [b for b in blocks if any(b.startswith(leaf + ".") for leaf in leaves)]
    if len(hidden) < 2 or len(hidden) < traced:
        return None
    try:
        with preserved_model_state(model):
            chain = module_chain(model, env, names, mutates)
    except Exception as e:  # the module tree cannot be followed: the traced chain stands
        log.info("following the module tree of %s failed: %s", type(model).__name__, e)
        return None
    if chain is None or len(chain) <= traced:
        return None
    log.info("%s: the traced graph keeps %s opaque (%d stages); its %d repeated blocks are the stages instead",
             type(model).__name__, ", ".join(sorted(leaves)), traced, len(chain))
    return chain
