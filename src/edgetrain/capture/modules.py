"""Stages for models torch.fx cannot trace: the repeated blocks of the module tree.

Hugging Face models (their forwards take ``**kwargs``, build masks with data-dependent code and return
``ModelOutput`` objects) and many others do not trace. Their structure is still plain to see: a stack of
blocks in a ``ModuleList`` or ``Sequential`` that the model's own forward calls one after another, the
unit Hugging Face's per-layer gradient checkpointing wraps. Each such block becomes a stage, and the
model's own forward keeps running as written: :class:`~edgetrain.runtime.executor.ModuleExecutor` swaps a
block's ``forward`` for a checkpointed call of it while the step runs. What the forward does outside the
blocks (embeddings, masks, the head) is always kept; the profiler counts it as resident memory
(``CostChain.input_bytes``) and time beside the loss's.

A block qualifies when, on the example batch, it is called exactly once per forward and not inside
another block, and it is handed nothing but tensors and plain values (a block handed a cache object it
appends to, such as a key/value cache, would append twice when recomputed: the model then stays one
stage; Hugging Face models are run with ``use_cache=False``, as their own gradient checkpointing does).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from torch import nn

from .._state import preserved_model_state
from .trace import Chain, Stage

__all__ = ["find_blocks", "block_stages", "module_chain"]

log = logging.getLogger(__name__)

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _containers_children(m: nn.Module) -> list[tuple[str, nn.Module]] | None:
    if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
        return list(m.named_children())
    return None


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the candidate blocks: children of every ``ModuleList`` / ``Sequential`` with two
    or more entries, each replaced by its own blocks where those hold (nearly) all of its parameters (a T5
    block's list of attention and feed-forward layers; not a ViT block's MLP, which leaves its attention out)."""
    def walk(prefix: str, m: nn.Module) -> list[str]:
        out: list[str] = []
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            kids = _containers_children(child)
            if kids is not None:
                for kname, k in kids:
                    inner = walk(f"{path}.{kname}.", k)
                    covered = sum(_numel(model.get_submodule(n)) for n in inner)
                    fine = len(inner) >= 2 and covered >= 0.9 * _numel(k)
                    out.extend(inner if fine else [f"{path}.{kname}"])
            else:
                out.extend(walk(f"{path}.", child))
        return out

    return walk("", model)


def _plain(v: Any) -> bool:
    if isinstance(v, (torch.Tensor,) + _PLAIN):
        return True
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(x) for x in v.values())
    return False


def block_stages(model: nn.Module, env: dict[str, Any]) -> list[str] | None:
    """The blocks that qualify, in call order (None when fewer than two do)."""
    names = find_blocks(model)
    if len(names) < 2:
        return None
    mods = {n: model.get_submodule(n) for n in names}
    calls: list[str] = []
    active: list[str] = []
    bad: set[str] = set()
    handles = []

    def pre(name: str):
        def hook(m: nn.Module, args: Any, kwargs: Any) -> None:
            if active or not _plain(args) or not _plain(kwargs):
                bad.add(name)
            active.append(name)
            calls.append(name)
        return hook

    def post(name: str):
        def hook(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            active.pop()
        return hook

    for n, m in mods.items():
        handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(m.register_forward_hook(post(n), with_kwargs=True, always_call=True))
    try:
        with preserved_model_state(model), torch.no_grad():
            model(**env)
    finally:
        for h in handles:
            h.remove()
    counts = {n: calls.count(n) for n in names}
    order = [n for n in dict.fromkeys(calls) if counts[n] == 1 and n not in bad]
    if bad:
        log.info("blocks not recomputable (handed a stateful object, or called inside another block): %s",
                 ", ".join(sorted(bad)))
    return order if len(order) >= 2 else None


def _block_alone(name: str) -> Callable[..., tuple[Any, ...]]:
    def fn(*args: Any) -> tuple[Any, ...]:
        raise RuntimeError(f"stage {name} is a block of the model's own forward and runs only inside it "
                           "(edgetrain.runtime.executor.ModuleExecutor)")
    return fn


def module_chain(model: nn.Module, env: dict[str, Any], names: tuple[str, ...],
                  mutates: tuple[str, ...]) -> Chain | None:
    """A chain of the model's repeated blocks (:mod:`edgetrain.capture.modules`), or None without two."""
    call_kwargs: dict[str, Any] = {}
    if "use_cache" in inspect.signature(model.forward).parameters and not env.get("use_cache"):
        call_kwargs["use_cache"] = False  # a key/value cache would be appended to again by a replay
    blocks = block_stages(model, {**env, **call_kwargs})
    if blocks is None:
        return None
    stages = [Stage(i, name, _block_alone(name), (), (), (model.get_submodule(name),), mutates if i == 0 else ())
              for i, name in enumerate(blocks)]
    return Chain(stages, names, "modules", (), dict.fromkeys(names, len(stages) - 1), model, call_kwargs)
