"""Federated scale-out with Flower (``pip install 'edgetrain[flower]'``): every client trains the full model,
exactly, inside its own device's memory budget.

- :func:`client_app`: a Flower ``ClientApp`` from a model builder and a data loader; per-node budget,
  device profile, speed-up target and gradient filter from the node's ``Context``; one plan per node, kept
  across rounds.
- :class:`MaskedFedAvg`: FedAvg that averages each tensor over the clients that trained it.
- :func:`simulate`: a federation on Flower's simulation engine (``edgetrain fl simulate``): the bundled MNIST
  task, or your model and data from the specs ``edgetrain train`` takes (:mod:`edgetrain.fl.spec_task`).

``import edgetrain`` never imports this package (nor Flower); importing it without Flower installed raises
an ImportError that says what to install.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("edgetrain.fl needs Flower: pip install 'edgetrain[flower]'") from exc

from .client import BUDGET_ERROR_CODE, ClientData, client_app
from .partition import dirichlet_partition, iid_partition
from .settings import ClientSettings
from .strategy import MaskedFedAvg, masked_average

__all__ = ["BUDGET_ERROR_CODE", "ClientData", "ClientSettings", "MaskedFedAvg", "client_app",
           "dirichlet_partition", "iid_partition", "masked_average", "simulate"]


def simulate(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`edgetrain.fl.simulation.run` (imported on first use: it loads Ray)."""
    from .simulation import run

    return run(*args, **kwargs)
