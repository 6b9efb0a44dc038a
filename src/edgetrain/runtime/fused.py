"""The optimizer update fused into the backward pass: each parameter is stepped, and its gradient freed, as soon
as its gradient is complete.

A step that trains the batch in one piece holds every gradient from the moment it is made until
``optimizer.step()``: one copy of the trainable parameters, most of it made early in the backward (a network's
last layers hold most of its parameters) while the earlier layers' activations still wait. With
:class:`FusedUpdate` armed around that one backward, a hook on each parameter (PyTorch's
``register_post_accumulate_grad_hook``, which fires once the parameter's gradient has every contribution)
steps the optimizer on that parameter alone and drops its gradient; with an
:class:`~edgetrain.runtime.optstate.OptimizerStatePager`, the parameter's state is read back just before and
written out again just after. At most one parameter's gradient (and state) is then resident beside the
activations, instead of all of them (ResNet-18, SGD with momentum: 42.6 MiB of gradients and 42.6 MiB of
momentum).

The update is the optimizer's own ``step()``, called with a parameter group holding the one parameter and the
group's hyper-parameters: for the optimizers of :data:`SUPPORTED`, whose update of a parameter reads only that
parameter, its gradient, its state and the group's options, the result is bit for bit that of one
``step()`` over every parameter (tests compare them). A parameter's hook fires after every backward node that
makes a gradient for it has run, so no later gradient sees its new value. A parameter that more than one stage
of the chain reads is the exception: one stage may read it without a gradient (a ``detach()``, an alias handed
on to a later stage) and run again in the backward after the other stages completed its gradient, so it is
updated after the backward, as before, and its gradient held until then (:func:`deferred`). A model that reads
a parameter without its gradient inside the stage that completes it, after that, fails autograd's in-place
check (loudly); ``PlanConfig(fused_update=False)`` trains it. A gradient wanted after the backward (clipping
by the global norm, inspecting it) does not exist in this mode: :func:`unsupported` names what rules it out,
and the planner does not choose it then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FusedUpdate", "SUPPORTED", "deferred", "dropping_gradients", "shared_parameter_bytes", "shared_parameters",
           "unsupported"]

#: optimizers whose update of a parameter reads only that parameter, its gradient and state and its group's
#: options (their subclasses may not: they are not taken)
SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)


def _user_hooks(optimizer: torch.optim.Optimizer, own: tuple[Any, ...] = ()) -> int:
    from torch.optim import optimizer as opt_mod

    hooks = [*optimizer._optimizer_step_pre_hooks.values(), *optimizer._optimizer_step_post_hooks.values(),
             *getattr(opt_mod, "_global_optimizer_pre_hooks", {}).values(),
             *getattr(opt_mod, "_global_optimizer_post_hooks", {}).values()]
    return sum(1 for h in hooks if getattr(h, "__self__", None) not in own)


def unsupported(optimizer: torch.optim.Optimizer, state_pager: Any = None) -> str | None:
    """Why ``optimizer`` cannot be stepped parameter by parameter inside the backward with the same result
    as one ``step()`` after it; None when it can."""
    if type(optimizer) not in SUPPORTED:
        return (f"{type(optimizer).__name__} is not one of the optimizers known to update each parameter on its "
                "own (" + ", ".join(c.__name__ for c in SUPPORTED) + ")")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "the optimizer is differentiable"
        for p in group["params"]:
            if p.requires_grad and p.device.type != "cpu":
                return "a parameter is not on the CPU"
    if _user_hooks(optimizer, (state_pager,) if state_pager is not None else ()):
        return "the optimizer has step hooks, which would run once per parameter"
    return None


def _stage_parameters(stage: Any) -> dict[int, torch.Tensor]:
    """The parameters a stage reads: those of the modules it runs and those its traced code fetches."""
    found = {id(p): p for m in stage.modules for p in m.parameters()}
    graph = getattr(stage.fn, "graph", None)
    for node in graph.nodes if graph is not None else ():
        if node.op == "get_attr":
            try:
                t = stage.fn.get_parameter(str(node.target))
            except AttributeError:
                continue
            found[id(t)] = t
    return found


def _shared(chain: Any) -> tuple[dict[int, tuple[int, ...]], dict[int, torch.Tensor]]:
    readers: dict[int, list[int]] = {}
    params: dict[int, torch.Tensor] = {}
    for st in chain.stages:
        for pid, p in _stage_parameters(st).items():
            readers.setdefault(pid, []).append(st.index)
            params[pid] = p
    return {pid: tuple(idx) for pid, idx in readers.items() if len(idx) > 1}, params


def shared_parameters(chain: Any) -> dict[int, tuple[int, ...]]:
    """Parameters that more than one stage of ``chain`` reads: id -> the indices of those stages."""
    return _shared(chain)[0]


def shared_parameter_bytes(chain: Any) -> int:
    """Bytes of the parameters more than one stage reads (the most a fused update may hold back)."""
    shared, params = _shared(chain)
    return sum(params[pid].numel() * params[pid].element_size() for pid in shared)


def deferred(chain: Any) -> set[int]:
    """Ids of the parameters a fused update leaves until after the backward: those several stages read. One
    stage may read a parameter without a gradient (``detach()``, an alias handed to a later stage) while
    another's backward completes its gradient; a re-run of the first after that update would read the new
    value, and a saved copy of it would fail autograd's in-place check."""
    return set(shared_parameters(chain))


@contextlib.contextmanager
def dropping_gradients(params: Any, keep: set[int] = frozenset()) -> Iterator[None]:
    """Inside, each parameter's gradient is dropped as soon as it is complete (except those in ``keep``):
    the memory of a fused update's backward without its updates, for a validation run that must leave the
    model as it was."""
    handles = [p.register_post_accumulate_grad_hook(_drop) for p in params if p.requires_grad and id(p) not in keep]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _drop(p: torch.Tensor) -> None:
    p.grad = None


class FusedUpdate:
    """Steps ``optimizer`` parameter by parameter inside one backward (module doc).

    Args:
        optimizer: the optimizer (see :func:`unsupported`).
        state_pager: an :class:`~edgetrain.runtime.optstate.OptimizerStatePager` of the same optimizer, or
            None: each parameter's state is read back before its update and written out after it.
        defer: ids of parameters updated after the backward instead (:func:`deferred`); settable.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state_pager: Any = None,
                 defer: set[int] | None = None) -> None:
        self.optimizer = optimizer
        self.state_pager = state_pager
        self.defer: set[int] = set(defer or ())
        #: ids of the parameters the last armed backward updated
        self.stepped_ids: set[int] = set()
        #: when a dict: each gradient, copied by parameter id before its update (verification; costs memory)
        self.record: dict[int, torch.Tensor] | None = None
        #: parameters stepped by the armed backward so far (by the last one, once it is over)
        self.stepped = 0

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Hooks on every trainable parameter of the optimizer for the backward run inside; on leaving, the
        hooks go. Parameters whose gradient the backward did not make are not stepped (as ``step()`` skips a
        parameter without a gradient).

        Raises:
            ValueError: a parameter already holds a gradient (it would be stepped without the earlier one).
        """
        opt = self.optimizer
        group_of: dict[int, dict[str, Any]] = {}
        params = []
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in group_of:
                    if p.grad is not None:
                        raise ValueError("a fused update needs the gradients cleared (zero_grad(set_to_none=True)) "
                                         "before the backward")
                    group_of[id(p)] = group
                    params.append(p)
        self.stepped = 0
        self.stepped_ids = set()
        handles = []
        muted = self.state_pager.muted() if self.state_pager is not None else contextlib.nullcontext()
        try:
            with muted:
                for p in params:
                    if id(p) not in self.defer:
                        handles.append(p.register_post_accumulate_grad_hook(
                            lambda p, g=group_of[id(p)]: self._step_one(p, g)))
                yield
                for p in params:
                    if id(p) in self.defer and p.grad is not None:
                        self._step_one(p, group_of[id(p)])
        finally:
            for h in handles:
                h.remove()

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        opt = self.optimizer
        sp = self.state_pager
        if self.record is not None:
            self.record[id(p)] = p.grad.detach().clone()
        if sp is not None:
            sp.page_in_params((p,))
        # the group itself narrowed to this parameter: an option the update writes lands where it belongs
        groups, params = opt.param_groups, group["params"]
        group["params"] = [p]
        opt.param_groups = [group]
        try:
            opt.step()
        finally:
            opt.param_groups = groups
            group["params"] = params
        p.grad = None
        if sp is not None:
            sp.page_out_params((p,))
        self.stepped += 1
        self.stepped_ids.add(id(p))
