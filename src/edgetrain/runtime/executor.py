"""Execute a Plan over a captured chain: the only code that touches autograd for recomputation.

A ``keep`` group runs its stage as written. A ``recompute`` group (one or more consecutive stages) runs under
``torch.utils.checkpoint`` in its non-reentrant form (a two-level group, ``plan.nested_groups``, checkpoints
each of its stages again inside, so its replay keeps only the stage outputs): saved tensors are dropped during
forward and rebuilt by re-running the group when backward first needs one. The CPU (and CUDA) RNG state is
replayed so dropout masks are identical, and a :class:`RecomputeGuard` undoes BatchNorm running-statistics
updates made by the replay. A ``selective:NAME`` group (one or more stages) runs under the same checkpoint
with a selective policy that keeps the outputs of the op classes in ``NAME`` and re-runs the rest
(:mod:`.selective`).

A replay stops once every saved tensor is back (PyTorch's early stop), unless the chain has an op that
writes into an argument autograd saves (``Chain.early_stop`` False, see
:func:`~edgetrain.capture.chain.argument_writer_nodes`): its replay then runs to the end, or the argument
would never be written.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..capture.draws import EXACT_DRAWS_NOTE, BatchDraws, batch_draws
from ..capture.modules import BlockCalls, check_calls, in_backward, replay_kwargs
from ..capture import OUTPUT_KEY, Chain
from ..errors import InputError
from ..graph import PAGE, RECOMPUTE, selective_name
from ..plan import Plan
from .batchnorm import FullBatchStats, RecomputeGuard
from .selective import selective_context_fn

__all__ = ["Executor", "ModuleExecutor", "PlainExecutor", "make_executor", "needs_stages", "checkpoint", "step_draws"]


def checkpoint(chain: Chain, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant ``torch.utils.checkpoint`` of ``fn`` with RNG replay, stopping its replay early only
    where ``chain`` allows (the flag is read when the checkpointed forward runs, so a checkpoint nested in a
    replay is called through here too)."""
    with set_checkpoint_early_stop(getattr(chain, "early_stop", True)):
        return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


@dataclass
class _Group:
    first: int
    last: int
    policy: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    modules: tuple[Any, ...]


def _replayed_buffers(chain: Chain) -> list[list[Any]]:
    """Per stage: the buffers written in some forward (by any stage) that the BatchNorm mechanisms do not
    own and that the stage reads, as a graph attribute or through one of its modules. A replay of the stage
    must see them as its first forward did, even when a later stage writes them."""
    model = chain.model
    if model is None or not chain.unmanaged_mutations:
        return [[] for _ in chain.stages]
    written = {id(b): b for b in (model.get_buffer(n) for n in chain.unmanaged_mutations)}
    out: list[list[Any]] = []
    for st in chain.stages:
        seen: dict[int, Any] = {}
        graph = getattr(st.fn, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "get_attr":
                t = st.fn.get_buffer(str(node.target)) if _is_buffer(st.fn, str(node.target)) else None
                if t is not None and id(t) in written:
                    seen[id(t)] = t
        for m in st.modules:
            for b in m.buffers():
                if id(b) in written:
                    seen[id(b)] = b
        out.append(list(seen.values()))
    return out


def _is_buffer(module: Any, target: str) -> bool:
    try:
        module.get_buffer(target)
    except AttributeError:
        return False
    return True


class Executor:
    """Runs the forward pass of one micro-batch according to a plan (backward is autograd's)."""

    def __init__(self, chain: Chain, plan: Plan, bn: FullBatchStats | None = None, pager: Any = None) -> None:
        if plan.num_stages != len(chain):
            raise ValueError(f"plan has {plan.num_stages} stages, the captured chain {len(chain)}; "
                             "re-run edgetrain.prepare for this model")
        self.chain = chain
        self.plan = plan
        self.bn = bn
        self.pager = pager
        if pager is None and PAGE in plan.policies:
            raise ValueError("the plan pages stages but no pager was given; prepare with paging=True")
        self.async_stages = set(plan.metadata.get("async_stages", ()))
        self.groups = self._make_groups()
        self._written = _replayed_buffers(chain)

    def _guard(self, first: int, last: int, modules: tuple[Any, ...]) -> tuple[Any, Any]:
        """``context_fn`` result for a checkpoint of stages ``first..last``."""
        guard = RecomputeGuard(modules, self.bn, [b for t in range(first, last + 1) for b in self._written[t]])
        return guard.forward_context(), guard

    def _make_groups(self) -> list[_Group]:
        groups: list[_Group] = []
        gids = self.plan.groups
        start = 0
        for t in range(1, len(gids) + 1):
            if t < len(gids) and gids[t] == gids[start]:
                continue
            i, j = start, t - 1
            produced: set[str] = set()
            inputs: list[str] = []
            for st in self.chain.stages[i:j + 1]:
                inputs.extend(k for k in st.inputs if k not in produced and k not in inputs)
                produced.update(st.outputs)
            outputs = tuple(k for k in produced
                            if k == OUTPUT_KEY or self.chain.last_use.get(k, -1) > j)
            mods = tuple(m for st in self.chain.stages[i:j + 1] for m in st.modules)
            groups.append(_Group(i, j, self.plan.policies[i], tuple(inputs), outputs, mods))
            start = t
        return groups

    def _group_fn(self, g: _Group) -> Callable[..., tuple[Any, ...]]:
        stages = self.chain.stages[g.first:g.last + 1]
        two_level = self.plan.groups[g.first] in set(self.plan.nested_groups) and g.policy == RECOMPUTE

        def run(*args: Any) -> tuple[Any, ...]:
            env = dict(zip(g.inputs, args))
            for st in stages:
                if two_level:  # checkpoint each stage again: the group's replay keeps only stage outputs
                    def ctx(st: Any = st) -> tuple[Any, Any]:
                        return self._guard(st.index, st.index, st.modules)

                    outs = checkpoint(self.chain, st, *(env[k] for k in st.inputs), context_fn=ctx)
                else:
                    outs = st(*(env[k] for k in st.inputs))
                env.update(zip(st.outputs, outs))
                self.chain.release(env, st.index)
            return tuple(env[k] for k in g.outputs)

        return run

    def forward(self, env: dict[str, Any]) -> Any:
        """Run every group on ``env`` (model inputs by name, one micro-batch); returns the model output."""
        hooks = self.pager.hooks() if self.pager is not None else contextlib.nullcontext()
        with hooks:
            for g in self.groups:
                if g.policy == RECOMPUTE:
                    def ctx(g: _Group = g) -> tuple[Any, Any]:
                        return self._guard(g.first, g.last, g.modules)

                    outs = checkpoint(self.chain, self._group_fn(g), *(env[k] for k in g.inputs), context_fn=ctx)
                    env.update(zip(g.outputs, outs))
                    self.chain.release(env, g.last)
                    continue
                option = selective_name(g.policy)
                if option is not None:  # one checkpoint: some op outputs kept, the rest re-run in backward
                    def guard(g: _Group = g) -> tuple[Any, Any]:
                        return self._guard(g.first, g.last, g.modules)

                    outs = checkpoint(self.chain, self._group_fn(g), *(env[k] for k in g.inputs),
                                      context_fn=selective_context_fn(option, guard))
                    env.update(zip(g.outputs, outs))
                    del outs
                    self.chain.release(env, g.last)
                    continue
                for st in self.chain.stages[g.first:g.last + 1]:
                    if g.policy == PAGE:
                        with self.pager.stage(st.index, asynchronous=st.index in self.async_stages):
                            outs = st(*(env[k] for k in st.inputs))
                        if st.index + 1 < len(self.chain):  # the output is paged with this stage too
                            for k, o in zip(st.outputs, outs):
                                if k != OUTPUT_KEY and hasattr(o, "untyped_storage"):
                                    self.pager.page_boundary(st.index, o)
                    else:
                        outs = st(*(env[k] for k in st.inputs))
                    env.update(zip(st.outputs, outs))
                    del outs
                    self.chain.release(env, st.index)
        return env.pop(OUTPUT_KEY)  # not kept in the caller's environment: freed when the loss no longer needs it


class ModuleExecutor:
    """Runs the model's own forward with each block stage (a ``"modules"`` chain) executed by its policy.

    For the duration of a forward, a recomputed block's ``forward`` is replaced (an instance attribute,
    removed afterwards) by a non-reentrant ``torch.utils.checkpoint`` call of the original with RNG replay
    and the same guards as :class:`Executor`. Plans for such chains recompute blocks one at a time (the
    model's code between blocks is not ours to re-run), so every recompute group is a single stage. A block
    the forward calls several times (shared weights) gets a ``forward`` that runs each call by its own
    stage's policy, and a forward that calls it a different number of times than planned is refused.
    """

    def __init__(self, chain: Chain, plan: Plan, bn: FullBatchStats | None = None, pager: Any = None) -> None:
        if plan.num_stages != len(chain):
            raise ValueError(f"plan has {plan.num_stages} stages, the captured chain {len(chain)}; "
                             "re-run edgetrain.prepare for this model")
        if PAGE in plan.policies:
            raise ValueError("paging needs a model torch.fx can trace; this one runs as blocks of its module tree")
        if len(set(plan.groups)) != len(plan.groups):
            raise ValueError("a plan for a model run as blocks of its module tree recomputes blocks one at a time; "
                             "this plan groups several (plan it with solver='dp', allow_segments=False)")
        self.chain = chain
        self.plan = plan
        self.bn = bn
        self.pager = None
        self._written = _replayed_buffers(chain)
        self._calls = BlockCalls(chain)
        self._shared = any(len(s) > 1 for s in self._calls.slots.values())

    def _checkpointed(self, st: Any, forward: Callable[..., Any], option: str | None = None) -> Callable[..., Any]:
        def ctx() -> tuple[Any, Any]:
            guard = RecomputeGuard(st.modules, self.bn, self._written[st.index])
            return guard.forward_context(), guard

        context_fn = ctx if option is None else selective_context_fn(option, ctx)

        def run(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(self.chain, forward, *args, context_fn=context_fn, **kwargs)
        return run

    def _by_policy(self, i: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` as stage ``i``'s policy runs it: unchanged when kept, else checkpointed."""
        option = selective_name(self.plan.policies[i])
        if self.plan.policies[i] != RECOMPUTE and option is None:
            return forward
        return self._checkpointed(self.chain.stages[i], forward, option)

    def _dispatch(self, block: Any) -> Callable[..., Any] | None:
        """``block.forward`` as the plan runs it, or None where it runs unchanged. A block the forward calls
        several times runs each call by its own stage's policy (:class:`~edgetrain.capture.modules.BlockCalls`
        says which stage a call is); in such a model every block's calls are counted, kept or not, for
        :func:`~edgetrain.capture.modules.check_calls`."""
        forward = block.forward
        runs = {i: self._by_policy(i, forward) for i in self._calls.slots[id(block)]}
        if not self._shared:  # every block has one call, and nothing needs counting
            (only,) = runs.values()
            return None if only is forward else only

        def run(*args: Any, **kwargs: Any) -> Any:
            if in_backward():  # the model's own reentrant checkpoint running the block again
                return forward(*args, **kwargs)
            return runs[self._calls.stage(block)](*args, **kwargs)
        return run

    def forward(self, env: dict[str, Any]) -> Any:
        """Run the model on ``env`` (its inputs by name, one micro-batch); returns its output."""
        patched = []
        self._calls.reset()
        try:
            for block in self._calls.blocks:
                run = self._dispatch(block)
                if run is not None:
                    block.forward = run
                    patched.append(block)
            out = self.chain.model(**{**env, **self.chain.call_kwargs})
            if self._shared:
                check_calls(self._calls)
            return out
        finally:
            for block in patched:
                del block.forward


class PlainExecutor:
    """Runs the model's own forward, unchanged: a plan that recomputes and pages nothing needs no stages.

    Used by a step prepared without a budget (plain PyTorch's schedule, micro-batched or not), which then
    runs exactly the code plain PyTorch runs, and holds no captured graph: the stages are captured only
    if a later plan recomputes (:attr:`edgetrain.api.TrainStep.chain`).
    """

    pager = None

    def __init__(self, model: Any) -> None:
        self.model = model

    def forward(self, env: dict[str, Any]) -> Any:
        """Run the model on ``env`` (its inputs by name, one micro-batch); returns its output."""
        return self.model(**{**env, **replay_kwargs(self.model, env)})


def needs_stages(plan: Plan) -> bool:
    """Whether running ``plan`` needs the captured stages (it recomputes or pages some)."""
    return any(p in (RECOMPUTE, PAGE) for p in plan.policies)


def make_executor(chain: Chain, plan: Plan, bn: FullBatchStats | None = None, pager: Any = None) -> Any:
    """The executor for ``chain``: :class:`ModuleExecutor` for a chain of module-tree blocks, else
    :class:`Executor`."""
    if not getattr(chain, "replayable", True) and needs_stages(plan):
        raise InputError("this plan recomputes or pages, but the model's forward does not reproduce its output from "
                         "the same random state and buffers (see the warning at capture), so a replay would differ "
                         "from the first forward; plan with solver='no_saving' (micro-batching only) or a larger "
                         "budget")
    if chain.method == "modules":
        return ModuleExecutor(chain, plan, bn, pager)
    return Executor(chain, plan, bn, pager)


def step_draws(step: Any, n: int) -> BatchDraws | None:
    """The whole batch's dropout draws (:mod:`edgetrain.capture.draws`) for ``step``'s next split step of ``n``
    samples, or None: the batch is not split, the forward draws nothing, the plan's BatchNorm normalises each
    micro-batch (accumulation's semantics), the model's own forward or compiled code runs, or the check or the
    budget rules them out (then a plan that said otherwise warns once)."""
    plan = step.plan
    if (not step.draws_random or plan.micro_batch_size >= n or plan.bn_micro_batched
            or type(step._executor) is not Executor):
        return None
    room = None if step.budget_bytes is None else step.budget_bytes - step.margin_bytes
    draws = batch_draws(step.chain, step.draw_example, n, plan.peak_bytes, room)
    if isinstance(draws, str):
        if EXACT_DRAWS_NOTE in plan.notes and getattr(step.chain, "draws_warned", None) is not True:
            step.chain.draws_warned = True
            warnings.warn("the split step now draws dropout masks per micro-batch, not as one full-batch step: "
                          f"{draws}", stacklevel=3)
        return None
    return draws
