"""Mask-aware federated averaging: every tensor element averaged over the clients that trained it.

With elastic selection or gradient filtering, clients train different tensors; a HeteroFL client trains a
leading block of each. Plain FedAvg would average the untouched values (the global model each client
received) as if they were trained, pulling every update towards the old model by the share of clients
that did not train it. :class:`MaskedFedAvg` reads each reply's ``"trained"`` record
(:mod:`edgetrain.fl.payload`) and computes, per element,

    new = sum_i n_i m_i x_i / sum_i n_i m_i      where sum_i n_i m_i > 0, else the global value,

with ``n_i`` the client's examples and ``m_i`` 1 where it trained. When every client trains everything this
is FedAvg exactly. It also keeps every client's metrics per round (``history``) and logs failures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from .payload import TRAINED_KEY, region_of

__all__ = ["MaskedFedAvg", "masked_average"]

log = logging.getLogger(__name__)


def masked_average(global_arrays: dict[str, np.ndarray], replies: list[tuple[dict[str, np.ndarray], Any, float]],
                   ) -> dict[str, np.ndarray]:
    """The mask-aware average of client arrays (plain NumPy: the strategy's arithmetic, testable alone).

    Args:
        global_arrays: the model the clients received, per key.
        replies: per client ``(arrays, trained, num_examples)``; ``trained`` maps each key to ``True``,
            ``False`` or a leading-block shape (see :mod:`edgetrain.fl.payload`); None means all trained.

    Returns:
        The new global arrays, per key, in the global arrays' dtypes.
    """
    out = {}
    for key, g in global_arrays.items():
        num = np.zeros(g.shape, dtype=np.float64)
        den = np.zeros(g.shape, dtype=np.float64)
        for arrays, trained, n in replies:
            entry = True if trained is None else trained.get(key, True)
            mask = region_of(entry, g.shape)
            num += np.where(mask, arrays[key].astype(np.float64) * n, 0.0)
            den += mask * float(n)
        avg = np.where(den > 0, num / np.maximum(den, 1e-300), g.astype(np.float64))
        if np.issubdtype(g.dtype, np.integer):
            avg = np.rint(avg)
        # np.rint of a 0-d array is a NumPy scalar, which Flower's Array refuses (BatchNorm's
        # num_batches_tracked is one): keep every value an ndarray of the global value's shape
        out[key] = np.asarray(avg).astype(g.dtype).reshape(g.shape)
    return out


class MaskedFedAvg(FedAvg):
    """FedAvg whose array aggregation is :func:`masked_average`; replies without a ``"trained"`` record
    count as having trained everything.

    Attributes:
        history: one entry per round, ``{"round", "clients": [per-client metrics], "failures": [reasons]}``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: list[dict[str, Any]] = []
        self._global: ArrayRecord | None = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._global = arrays  # what the clients start from: the value of anything nobody trains
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        valid, errors = self._check_and_log_replies(replies, is_train=True)
        entry: dict[str, Any] = {"round": server_round, "clients": [], "failures": []}
        for msg in errors:
            reason = msg.error.reason or f"error code {msg.error.code}"
            log.warning("round %d: client on node %d failed: %s", server_round, msg.metadata.src_node_id, reason)
            entry["failures"].append(reason)
        self.history.append(entry)
        if not valid:
            return None, None
        contents: list[RecordDict] = [m.content for m in valid]
        for c in contents:
            metrics = next(iter(c.metric_records.values()))
            entry["clients"].append({k: metrics[k] for k in metrics})
        arrays = aggregate_masked(contents, self._global, self.weighted_by_key, self.arrayrecord_key)
        return arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)


def aggregate_masked(contents: list[RecordDict], global_arrays: ArrayRecord | None, weight_key: str,
                     array_key: str) -> ArrayRecord:
    """Unpack replies, :func:`masked_average` them, pack the result as an ``ArrayRecord``."""
    first = contents[0][array_key]
    g = {k: (global_arrays[k] if global_arrays is not None and k in global_arrays else first[k]).numpy()
         for k in first.keys()}
    parsed = []
    for c in contents:
        metrics = next(iter(c.metric_records.values()))
        trained = dict(c[TRAINED_KEY]) if TRAINED_KEY in c.config_records else None
        parsed.append(({k: c[array_key][k].numpy() for k in g}, trained, float(metrics[weight_key])))
    return ArrayRecord({k: Array(v) for k, v in masked_average(g, parsed).items()})
