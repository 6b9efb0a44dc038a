"""What a prepared step checks about the model and the loss it was prepared for.

* :func:`model_key` and :func:`describe_change`: a step runs the model as it was captured (traced code holds
  ``self.training`` and the module objects of the capture), so a model changed after ``prepare`` (eval
  mode, a replaced submodule or parameter) is refused by name, never trained as something else.
* :func:`loss_norm_safely`: how the loss normalises (:mod:`edgetrain.planning.loss`), found in a forked child.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .loss import LossNorm, loss_normalisation

__all__ = ["model_key", "describe_change", "loss_norm_safely"]


def model_key(model: nn.Module) -> tuple[Any, ...]:
    """What a prepared step depends on beyond parameter values: which module objects sit where, their
    training flags (traced code holds ``self.training`` as a constant) and which parameter objects there are."""
    return (tuple((name, id(m), m.training) for name, m in model.named_modules()),
            tuple((name, id(p)) for name, p in model.named_parameters()))


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    old_mods = {name: (ident, training) for name, ident, training in old[0]}
    new_mods = {name: (ident, training) for name, ident, training in new[0]}
    for name, (ident, training) in new_mods.items():
        label = f"'{name}'" if name else "the model"
        if name not in old_mods:
            return f"submodule {label} was added"
        if old_mods[name][0] != ident:
            return f"submodule {label} was replaced by another module"
        if old_mods[name][1] != training:
            return f"{label} is now in {'training' if training else 'eval'} mode (it was prepared in " \
                   f"{'training' if old_mods[name][1] else 'eval'} mode)"
    for name in old_mods:
        if name not in new_mods:
            return f"submodule '{name}' was removed"
    old_p, new_p = dict(old[1]), dict(new[1])
    for name in set(old_p) | set(new_p):
        if old_p.get(name) != new_p.get(name):
            return f"parameter '{name}' was added, removed or replaced by another tensor"
    return "its modules or parameters changed"


def loss_norm_safely(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                      batch: int) -> LossNorm:
    """:func:`loss_normalisation` in a forked child where possible: its forwards at 1-3 samples load kernels
    for shapes no step uses, which would stay resident here."""
    from ..profile import fork as _fork

    if _fork.available():
        res = _fork.run_in_child(lambda: loss_normalisation(model, env, loss_fn, targets, batch).kind)
        if res is not None and res.error is None and res.value is not None:
            return LossNorm(res.value, loss_fn)
    return loss_normalisation(model, env, loss_fn, targets, batch)  # raises here what the child raised
