"""What a model's forward touches besides its output, found from one forward with gradients on two samples (by
:func:`~edgetrain.planning.loss.loss_normalisation`, in a forked child): whether the loss reads activations
other than through the output, which ops write into arguments autograd saves, and which inputs and parameters
the forward writes."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from .._state import preserved_model_state
from ..batch import tensors_in
from ..capture.chain import argument_writer_nodes, written_parameters
from ..capture.checks import autograd_nodes
from ..errors import InputError
from .mixing import take

__all__ = ["check_reads_only_outputs"]

log = logging.getLogger("edgetrain.planning.loss")


def _detached(x: Any) -> Any:
    """``x`` with every tensor detached, its containers (a ``ModelOutput`` included) rebuilt as they were."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict):
        items = {k: _detached(v) for k, v in x.items()}
        try:
            return type(x)(**items) if hasattr(x, "to_tuple") else type(x)(items)
        except Exception:
            return items
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_detached(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x


def _graph_nodes(roots: list[Any]) -> set[Any]:
    """The autograd nodes reachable from ``roots``, parameters' own gradient accumulators left out."""
    return {fn for fn in autograd_nodes(roots) if not hasattr(fn, "variable")}


def check_reads_only_outputs(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor],
                              targets: Any, idx: torch.Tensor) -> tuple[tuple[str, ...] | None, tuple[str, ...],
                                                                         tuple[str, ...]]:
    """Refuse a loss that reads the forward's activations other than through its output: an intermediate a
    forward hook kept (a feature-matching term), or a tensor the model stored on itself. edgetrain measures
    the model's backward from its output's gradient, and would backpropagate such a term twice. A loss that
    reads parameters (weight decay written into the loss) is fine.

    Returns the ops of the forward's graph that write into an argument autograd saves
    (:func:`~edgetrain.capture.chain.argument_writer_nodes`), for capture, None where the forward failed; and
    the inputs the forward wrote into in place (``x.div_(255)``: their version counters moved), by name; and the
    parameters it wrote (:func:`~edgetrain.capture.chain.written_parameters`).

    Raises:
        InputError: the loss, given the model's output detached, still reaches the forward's graph.
    """
    taken = {k: take(v, idx) for k, v in env.items()}
    versions = {k: [t._version for t in tensors_in(v)] for k, v in taken.items()}
    written: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    try:
        with torch.enable_grad(), preserved_model_state(model):
            params, out = written_parameters(model, lambda: model(**taken))
            written = tuple(k for k, v in taken.items() if [t._version for t in tensors_in(v)] != versions[k])
            forward = _graph_nodes([t.grad_fn for t in tensors_in(out)])
            writers = tuple(sorted(n.removesuffix("Backward0") for n in {type(fn).__name__ for fn in forward}
                                   & argument_writer_nodes()))
            if not forward:
                return writers, written, params
            loss = loss_fn(_detached(out), take(targets, idx))
            reached = _graph_nodes([loss.grad_fn]) if isinstance(loss, torch.Tensor) else set()
    except Exception as e:  # the checks after this one run the same forward and loss, and say what fails
        log.info("check that the loss reads only the model's output skipped: %s: %s", type(e).__name__, e)
        return None, written, params
    if reached & forward:
        raise InputError("loss_fn reads the forward's activations other than through the model's output (a tensor "
                         "a forward hook kept, or one the model stored on itself): edgetrain measures and runs the "
                         "backward from the output's gradient, so such a term would be backpropagated wrongly. "
                         "Return what the loss needs as part of the model's output (a tuple or dict), and read it "
                         "there")
    return writers, written, params
