"""Per-node settings of an edgetrain Flower client, read from the Flower ``Context``.

A node's device is described by its ``node_config`` (``flower-supernode --node-config
"memory-budget='64MiB' device-profile='rpi4'"``); the run may set defaults in its ``run_config``; the
ClientApp factory gives the rest. The keys are the field names with ``-`` for ``_``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from ..errors import InputError

__all__ = ["ClientSettings"]


@dataclass(frozen=True)
class ClientSettings:
    """How one federated client trains.

    Attributes:
        memory_budget: the bound on the client's peak resident memory, e.g. ``"48MiB"`` (None: unbounded).
            Measured from the resident memory when the client starts handling a message (Flower, torch and
            edgetrain loaded, the received model still in its wire format), as ``prepare`` measures from
            ``import edgetrain`` in a process of its own.
        device_profile: a bundled device profile name (``edgetrain.devices.list_profiles()``) the predicted
            step time and energy are costed on (None: this host, energy not predicted).
        speedup: opt-in ElasticTrainer target (train the tensors that matter most, this many times faster).
        grad_filter_radius: opt-in gradient filtering patch radius (0: off).
        grad_filter_last_n: how many of the last convolutions gradient filtering applies to.
        local_epochs: passes over the client's shard per round.
        batch_size: samples per optimizer step.
        lr: SGD learning rate.
        momentum: SGD momentum (the optimizer is re-created every round, so its state starts at zero).
        threads: torch intra-op threads (0: leave as is).
    """

    memory_budget: str | None = None
    device_profile: str | None = None
    speedup: float | None = None
    grad_filter_radius: int = 0
    grad_filter_last_n: int = 4
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    threads: int = 1

    def overridden(self, *configs: Mapping[str, Any]) -> "ClientSettings":
        """These settings with the keys of ``configs`` applied in order (later ones win).

        Raises:
            InputError: a value of the wrong type (the message names the key).
        """
        types = {f.name: f.type for f in fields(self)}
        changes: dict[str, Any] = {}
        for config in configs:
            for key, value in config.items():
                name = key.replace("-", "_")
                if name not in types:
                    continue  # other keys (partition-id, ...) belong to the data loader or Flower
                changes[name] = _coerce(key, value, str(types[name]))
        return replace(self, **changes)

    @property
    def grad_filter(self) -> Any:
        """The ``edgetrain.GradFilter`` these settings ask for, or None."""
        if self.grad_filter_radius <= 0:
            return None
        from ..approx import GradFilter

        return GradFilter(radius=self.grad_filter_radius, last_n=self.grad_filter_last_n)


def _coerce(key: str, value: Any, type_name: str) -> Any:
    if value in ("", None, "none", "None") and "None" in type_name:
        return None
    try:
        if type_name.startswith("int"):
            return int(value)
        if type_name.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise InputError(f"node/run config {key}={value!r} is not a {type_name.split(' ')[0]}") from None
