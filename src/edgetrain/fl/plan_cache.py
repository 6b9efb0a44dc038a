"""Keep a client's plan across Flower rounds: in ``context.state`` and, optionally, on disk.

Flower builds the ClientApp afresh for every message; the node's ``Context`` (and its ``state``) is what
persists. A plan is only valid for the model structure, the batch shape, the budget and the options it was
made for, so the key hashes all of them; a change of any of them is a miss and a fresh ``prepare``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..graph import CostChain
from ..plan import Plan

__all__ = ["STATE_KEY", "plan_key", "load_plan", "store_plan"]

log = logging.getLogger(__name__)

#: the ConfigRecord in ``context.state`` holding ``{key: plan and costs as JSON}``
STATE_KEY = "edgetrain-plans"


def _layout(x: Any) -> str:
    """Shapes and dtypes of a batch's tensors, with the keys and nesting of dict and tuple inputs."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)}:{x.dtype}"
    if isinstance(x, Mapping):
        return "{" + ",".join(f"{k}={_layout(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_layout(v) for v in x) + ")"
    return repr(type(x).__name__)


def plan_key(model: nn.Module, example: tuple[Any, Any], **options: Any) -> str:
    """A hash of the model's structure and tensor shapes, the example's shapes and dtypes, and ``options``
    (budget, device profile, speed-up, gradient filter: whatever changes the plan)."""
    parts = [repr(model)]
    parts += [f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in model.state_dict().items()]
    parts.append(_layout(example))
    parts.append(json.dumps(options, sort_keys=True, default=str))
    parts.append(torch.__version__)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_plan(state: Any, key: str, cache_dir: str | os.PathLike[str] | None = None,
              ) -> tuple[Plan, CostChain] | None:
    """The plan and costs stored under ``key`` in ``state`` (a Flower ``RecordDict``) or ``cache_dir``."""
    text = None
    if STATE_KEY in state.config_records and key in state.config_records[STATE_KEY]:
        text = str(state.config_records[STATE_KEY][key])
    elif cache_dir is not None:
        path = Path(cache_dir) / f"{key}.json"
        if path.exists():
            text = path.read_text()
    if text is None:
        return None
    try:
        d = json.loads(text)
        return Plan.from_json(d["plan"]), CostChain.from_dict(d["costs"])
    except (ValueError, KeyError, TypeError) as e:
        log.warning("stored plan %s unreadable (%s); planning afresh", key, e)
        return None


def store_plan(state: Any, key: str, plan: Plan, costs: CostChain,
               cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Store ``plan`` and ``costs`` under ``key`` in ``state`` and, if given, in ``cache_dir``."""
    from flwr.app import ConfigRecord

    text = json.dumps({"plan": plan.to_json(), "costs": costs.to_dict()})
    if STATE_KEY not in state.config_records:
        state[STATE_KEY] = ConfigRecord()
    state.config_records[STATE_KEY][key] = text
    if cache_dir is not None:
        path = Path(cache_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(path / f"{key}.json")
