"""The arrays a client sends back, and which parts of each it trained.

Flower's strategies need every reply to carry the same array keys, so a client always sends every tensor
of the model's ``state_dict``, and says in a ``ConfigRecord`` (key ``"trained"``) what it trained of each:
``True`` (all of it), ``False`` (nothing: the value is the global one it received) or a list of ints, the
shape of the leading block it trained (a HeteroFL width-sliced client trains ``w[:c_out, :c_in]``). The
mask-aware strategy averages each element over the clients that trained it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["TRAINED_KEY", "trained_mask", "region_of", "load_arrays", "model_arrays"]

#: the ConfigRecord key of the trained-region record in a train reply
TRAINED_KEY = "trained"


def model_arrays(model: nn.Module) -> Any:
    """The model's ``state_dict`` as a Flower ``ArrayRecord`` (detached copies)."""
    from flwr.app import ArrayRecord

    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def load_arrays(model: nn.Module, arrays: Any) -> None:
    """Load a Flower ``ArrayRecord`` into ``model`` (strict: the same keys and shapes)."""
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)


def trained_mask(model: nn.Module, trained_params: set[str], before: Mapping[str, torch.Tensor]) -> dict[str, bool]:
    """Per ``state_dict`` key, whether this client trained it.

    Args:
        model: the model after local training.
        trained_params: names of the parameters that received a gradient in some step.
        before: the buffers as received (a buffer counts as trained when its value changed, e.g. BatchNorm
            running statistics).
    """
    # a tied parameter (GPT-2's lm_head.weight is its token embedding) is in the state dict under every name it
    # has, and in named_parameters() under its first only: each name counts as that parameter
    first = {id(p): name for name, p in model.named_parameters()}
    params = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for key, value in model.state_dict().items():
        if key in params:
            out[key] = params[key] in trained_params
        else:
            out[key] = not torch.equal(value, before[key])
    return out


def region_of(entry: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A boolean array of ``shape``: True where a ``"trained"`` entry says the client trained."""
    mask = np.zeros(shape, dtype=bool)
    if entry is True:
        mask[...] = True
    elif entry is False:
        pass
    else:
        block = tuple(int(b) for b in entry)
        if len(block) != len(shape) or any(b > s or b < 0 for b, s in zip(block, shape)):
            raise ValueError(f"trained block {block} does not fit a tensor of shape {shape}")
        mask[tuple(slice(0, b) for b in block)] = True
    return mask
