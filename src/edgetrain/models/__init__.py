"""In-project model definitions (MobileNetV2, ResNet-18, a transformer classifier) and a registry.

Every model here traces with ``torch.fx.symbolic_trace``, takes one tensor batched on dim 0, and is a
chain at the level of its children (and of the entries of its ``nn.Sequential`` containers): exactly
one tensor flows from each to the next, so capture can cut it into stages there.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .mobilenetv2 import MobileNetV2, mobilenet_v2
from .resnet import ResNet, resnet18
from .transformer import TransformerClassifier, transformer_classifier

__all__ = [
    "MODEL_NAMES", "get_model", "mobilenet_v2", "resnet18", "transformer_classifier",
    "MobileNetV2", "ResNet", "TransformerClassifier",
]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "mobilenet_v2": mobilenet_v2,
    "resnet18": resnet18,
    "transformer": transformer_classifier,
}

MODEL_NAMES: tuple[str, ...] = ("mobilenet_v2", "resnet18", "transformer")


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by name.

    Args:
        name: one of :data:`MODEL_NAMES`.
        **kwargs: passed to the builder (:func:`mobilenet_v2`, :func:`resnet18`,
            :func:`transformer_classifier`; the last needs ``num_classes`` and one of ``vocab_size`` /
            ``input_dim``).

    Returns:
        The randomly initialised model.

    Raises:
        ValueError: when ``name`` is unknown (the message lists the known names) or the builder
            rejects a value.
        TypeError: when the builder does not take one of ``kwargs``.
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}") from None
    return builder(**kwargs)
