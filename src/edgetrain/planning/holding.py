"""How a step may hold the optimizer state and the gradients, as ``prepare()`` decides before planning: the
:class:`~edgetrain.planning.analysis.Analysis` fields of paging the state (:mod:`~edgetrain.runtime.optstate`)
and of fusing the update into the backward (:mod:`~edgetrain.runtime.fused`). The planner then orders the ways
they allow by predicted time (``Analysis._state_modes``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import InputError

__all__ = ["FUSED_CALL_S", "fusing_fields", "state_paging_fields"]

log = logging.getLogger("edgetrain.api")


#: below this much pageable optimizer state, paging it is not worth a page file
_MIN_PAGEABLE_STATE = 2**20


def state_paging_fields(optimizer: torch.optim.Optimizer, opt_costs: Any, cfg: Any, budget: int | None,
                        poet: bool) -> dict[str, Any]:
    """The :class:`Analysis` fields of optimizer-state paging: whether it may be planned, the bytes it
    moves (the state there now and the state the first update creates, tensors of 64 KiB and more), and
    the page file's cost per byte, measured here on a 4 MiB probe."""
    mode = cfg.page_optimizer_state
    if budget is None or mode is False or (mode == "auto" and poet):  # POET costs storage by its device
        return {}
    from ..runtime.optstate import measure_bandwidth, pageable_state_bytes

    old = pageable_state_bytes(optimizer)
    new = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            nbytes = p.numel() * p.element_size()
            if p.requires_grad and not optimizer.state.get(p) and nbytes >= 65536:
                new += int(opt_costs.state_per_param * nbytes)
    if old + new < (_MIN_PAGEABLE_STATE if mode == "auto" else 1):  # True: whatever there is
        return {}
    try:
        w, r = measure_bandwidth(cfg.state_dir, min(old + new, 4 * 2**20))
    except OSError as e:
        if mode is True:
            from ..runtime.paging import PagingError

            where = cfg.state_dir or "the temporary directory"
            raise PagingError(f"cannot write a page file for the optimizer state in {where}: {e}; give "
                              "PlanConfig(state_dir=) a writable directory") from e
        log.info("optimizer state stays resident: no page file (%s)", e)
        return {}
    return {"state_mode": mode, "pageable_state": old + new, "pageable_new": new, "state_dir": cfg.state_dir,
            "state_s_per_byte": w + r}


#: seconds one fused update of a parameter adds to a step (the optimizer's step() called for it alone): 21 us
#: (SGD) to 42 us (Adam) a call on the x86 host of bench/RESULTS.md, against 6-19 us a parameter in one step()
FUSED_CALL_S = 30e-6


def fusing_fields(optimizer: torch.optim.Optimizer, opt_costs: Any, cfg: Any, budget: int | None, *,
                  whole_batch: bool, other: str | None = None) -> dict[str, Any]:
    """The :class:`Analysis` fields of the optimizer update fused into the backward (:mod:`~edgetrain.runtime.fused`):
    whether it may be planned (``PlanConfig(fused_update=)`` not False, a budget, a step that may train the
    batch in one piece, an optimizer that updates each parameter on its own), what it holds at once and what
    it costs. ``other``: a reason given by the caller that rules it out (None: none)."""
    from ..runtime.fused import unsupported

    mode = cfg.fused_update
    if budget is None or mode is False or not whole_batch:
        return {}
    why = other or unsupported(optimizer)
    if why is not None:
        if mode is True:
            raise InputError(f"PlanConfig(fused_update=True) cannot update this step's parameters inside the "
                             f"backward exactly: {why}. Leave fused_update at 'auto' or set it False.")
        log.info("optimizer update not fused into the backward: %s", why)
        return {}
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    largest = max((p.numel() * p.element_size() for p in params), default=0)
    # one update holds the parameter's gradient and state; Adam's kind makes a temporary of its size too
    per = 1 + opt_costs.state_per_param + (1 if opt_costs.state_per_param >= 2 else 0)
    return {"fuse": mode, "fused_bytes": int(largest * per),
            "fused_s": FUSED_CALL_S * len(params)}
