"""Losses that micro-batches split exactly, for models whose outputs are per token.

A language model's loss is a mean over the tokens that count (padding and prompt tokens, labelled
``-100``, do not), so a slice of the batch weighs its own count of such tokens, not its share of samples.
edgetrain splits ``nn.CrossEntropyLoss(ignore_index=...)`` that way, but only when the loss is handed the
logits with the classes in dimension 1, which a Hugging Face model's ``(batch, tokens, vocabulary)``
logits inside a ``ModelOutput`` are not; a lambda that flattens them, or the loss a model computes from
``labels=`` itself, hides the normaliser, and a step that would need micro-batches is refused.
:class:`TokenCrossEntropyLoss` is that mean written as a loss module: it takes the model's output as it
comes, shifts for next-token prediction when asked, and tells edgetrain how much each slice weighs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .errors import InputError

__all__ = ["TokenCrossEntropyLoss", "counted_weight", "perplexity"]


def counted_weight(targets: torch.Tensor, ignore_index: int, weight: torch.Tensor | None) -> float:
    """What class ``targets`` weigh in a cross-entropy mean's normaliser: the count of those other than
    ``ignore_index``, each by its class ``weight`` where there is one."""
    counted = targets != ignore_index
    if weight is None:
        return float(counted.sum())
    return float((weight[targets.clamp_min(0)] * counted).sum())


def perplexity(loss: float) -> float:
    """The perplexity of a mean next-token cross-entropy (its exponential; overflow-safe)."""
    return math.exp(min(loss, 700.0))


def _logits_of(output: Any, key: str) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, ``output[key]`` of a mapping (a ``ModelOutput``
    is one), or the first element of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "keys") and key in output.keys():
        return output[key]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InputError(f"TokenCrossEntropyLoss found no logits in the model's output ({type(output).__name__}"
                     f"{' with keys ' + ', '.join(map(str, output.keys())) if hasattr(output, 'keys') else ''}): "
                     f"pass output_key= naming the entry that holds them, or have the model return them")


class TokenCrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross-entropy over every token of a batch of sequences, averaged over the tokens that count.

    The same objective as a Hugging Face model's own loss from ``labels=`` (``shift=True`` for a causal
    language model, as ``*ForCausalLM`` computes it; ``shift=False`` for token classification and masked
    language modelling), written so that edgetrain can split the batch into micro-batches exactly: each
    slice's loss is weighted by its count of counted tokens (:meth:`target_weight`) over the batch's.

    The logits have their classes in the last dimension (``(batch, tokens, classes)``, or ``(batch,
    classes)``), the targets the logits' shape without it; targets equal to ``ignore_index`` count for
    nothing, class ``weight`` and ``label_smoothing`` are those of ``nn.CrossEntropyLoss``.

    Args:
        ignore_index: the target of tokens that do not count (``-100``, as in Hugging Face labels).
        shift: the logits at position ``t`` predict the target at ``t + 1`` (next-token prediction): the last
            position's logits and the first target are dropped.
        weight: a weight per class, as for ``nn.CrossEntropyLoss``.
        label_smoothing: as for ``nn.CrossEntropyLoss``.
        reduction: ``"mean"`` (over the tokens that count, by weight) or ``"sum"``.
        output_key: the entry of a mapping output (a ``ModelOutput``) that holds the logits.

    Example::

        loss_fn = edgetrain.TokenCrossEntropyLoss(shift=True)   # labels: input ids, padding at -100
        step = edgetrain.prepare(model, opt, loss_fn, ({"input_ids": ids, "attention_mask": mask}, labels),
                                 memory_budget="300MiB")
    """

    def __init__(self, ignore_index: int = -100, shift: bool = False, weight: torch.Tensor | None = None,
                 label_smoothing: float = 0.0, reduction: str = "mean", output_key: str = "logits") -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}: a per-token loss "
                             "(reduction='none') is not a loss a step can backpropagate")
        super().__init__(weight=weight, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
        self.shift = shift
        self.output_key = output_key

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, shift={self.shift}, reduction={self.reduction!r}"

    def _counted(self, targets: torch.Tensor) -> torch.Tensor:
        return targets[:, 1:] if self.shift else targets

    def forward(self, output: Any, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = _logits_of(output, self.output_key)
        if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            raise InputError("TokenCrossEntropyLoss takes integer class targets (token ids, -100 where a token "
                             f"does not count), got {type(targets).__name__} "
                             f"{getattr(targets, 'dtype', '')}".rstrip())
        if self.shift:
            if logits.dim() < 3 or targets.dim() < 2:
                raise InputError(f"TokenCrossEntropyLoss(shift=True) needs per-token logits (batch, tokens, classes) "
                                 f"and targets (batch, tokens); got logits {tuple(logits.shape)} and targets "
                                 f"{tuple(targets.shape)}")
            logits = logits[:, :-1]
        targets = self._counted(targets)
        if logits.shape[:-1] != targets.shape:
            raise InputError(f"TokenCrossEntropyLoss: logits {tuple(logits.shape)} (classes last"
                             f"{', after the shift' if self.shift else ''}) do not match targets "
                             f"{tuple(targets.shape)}: the targets have the logits' shape without the class "
                             "dimension (for next-token prediction on unshifted labels, pass shift=True)")
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), weight=self.weight,
                               ignore_index=self.ignore_index, reduction=self.reduction,
                               label_smoothing=self.label_smoothing)

    def target_weight(self, targets: torch.Tensor) -> float:
        """What ``targets`` weigh in the mean's normaliser: their count of tokens that count (by class
        weight, with ``weight``), after the shift."""
        return counted_weight(self._counted(targets), self.ignore_index, self.weight)
