"""Values of command-line flags that more than one command parses (shapes, JSON keyword objects)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_kwargs", "parse_shape"]


def parse_shape(text: str) -> tuple[int, ...]:
    from ..errors import ConfigError

    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ConfigError(f"--input-shape {text!r} must be whole numbers separated by commas, e.g. 3,64,64") from None
    if not shape or min(shape) < 1:
        raise ConfigError(f"--input-shape {text!r} must be positive sizes, e.g. 3,64,64")
    return shape


def parse_kwargs(text: str) -> dict[str, Any]:
    from ..errors import ConfigError

    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--model-kwargs {text!r} is not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--model-kwargs {text!r} must be a JSON object, e.g. '{{\"num_classes\": 10}}'")
    return value
