"""The torch, NumPy and Python RNG states as tensors and plain values (loadable with ``weights_only=True``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .._state import rng_state, set_rng_state

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """Every RNG a training loop may draw from: torch (CPU, and CUDA when initialised), NumPy, Python."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {"torch": rng_state(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss": py_gauss}}


def restore_rng(state: dict[str, Any]) -> None:
    """Set every RNG to a state :func:`capture_rng` returned."""
    set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
