"""The bundled task's ClientApp and ServerApp: the small CNN on the MNIST digits, one shard per node.

A node's shard is ``partition-id`` of ``num-partitions`` (node config; Flower's simulation engine sets
both), drawn with the run's ``partition`` scheme (``"iid"`` or ``"dirichlet"``), ``alpha`` and ``seed``.
The server evaluates the global model on the 1,000 held-out digits after every round.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from .client import ClientData, client_app
from .settings import ClientSettings
from .strategy import MaskedFedAvg
from .task import client_batches, evaluate_accuracy, load_task, small_cnn

__all__ = ["RunReport", "mnist_client_app", "mnist_server_app", "server_app", "task_data_fn"]

log = logging.getLogger(__name__)


@dataclass
class RunReport:
    """What the server saw: global accuracy per round (0: before training) and each round's client metrics."""

    accuracy: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"accuracy": self.accuracy, "loss": self.loss, "rounds": self.rounds,
                           "wall_s": self.wall_s}, indent=1)


def _task_args(context: Context, defaults: dict[str, Any]) -> tuple[str, float, int]:
    cfg = {**defaults, **dict(context.run_config)}
    return str(cfg.get("partition", "iid")), float(cfg.get("alpha", 0.5)), int(cfg.get("seed", 0))


def task_data_fn(partition: str = "iid", alpha: float = 0.5, seed: int = 0
                 ) -> Callable[[Context, ClientSettings], ClientData]:
    """The ``data_fn`` of :func:`edgetrain.fl.client_app` for the bundled digits (run config overrides)."""
    defaults = {"partition": partition, "alpha": alpha, "seed": seed}

    def data_fn(context: Context, s: ClientSettings) -> ClientData:
        scheme, a, sd = _task_args(context, defaults)
        pid = int(context.node_config.get("partition-id", 0))
        n = int(context.node_config.get("num-partitions", 1))
        data = load_task(n, scheme, a, sd)
        num = (len(data.shards[pid]) // s.batch_size) * s.batch_size
        return ClientData(train=lambda epoch: client_batches(data, pid, s.batch_size, epoch, sd),
                          num_train=num, test=(data.test_x, data.test_y))
    return data_fn


def mnist_client_app(settings: Any = ClientSettings(), width: float = 1.0, partition: str = "iid",
                     alpha: float = 0.5, seed: int = 0, cache_dir: str | None = None) -> Any:
    """:func:`edgetrain.fl.client_app` for the small CNN on the bundled digits."""
    return client_app(lambda: small_cnn(width), task_data_fn(partition, alpha, seed), settings=settings,
                      cache_dir=cache_dir)


def mnist_server_app(num_rounds: int = 3, report: RunReport | None = None, seed: int = 0, width: float = 1.0,
                     min_nodes: int = 2, strategy: MaskedFedAvg | None = None) -> ServerApp:
    """:func:`server_app` for the small CNN, evaluated on the 1,000 held-out digits."""

    def evaluate(model: torch.nn.Module, context: Context) -> tuple[float, float]:
        data = load_task(1, "iid", 0.5, int(context.run_config.get("seed", seed)))
        return evaluate_accuracy(model, data.test_x, data.test_y)

    return server_app(lambda: small_cnn(width), evaluate, num_rounds, report, seed=seed, min_nodes=min_nodes,
                      strategy=strategy)


def server_app(model_fn: Callable[[], torch.nn.Module],
               evaluate: Callable[[torch.nn.Module, Context], tuple[float, float]], num_rounds: int = 3,
               report: RunReport | None = None, seed: int = 0, min_nodes: int = 2,
               strategy: MaskedFedAvg | None = None) -> ServerApp:
    """A ServerApp running :class:`MaskedFedAvg` for ``num_rounds`` (run config ``num-server-rounds``) from
    the model ``model_fn`` builds (seeded with ``seed``), evaluating the global model centrally after each
    round with ``evaluate(model, context) -> (accuracy, loss)`` into ``report`` (and, with run config
    ``report-path``, writing the report there as JSON)."""
    app = ServerApp()
    report = report if report is not None else RunReport()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        import time

        rounds = int(context.run_config.get("num-server-rounds", num_rounds))
        torch.manual_seed(seed)
        model = model_fn()
        strat = strategy or MaskedFedAvg(fraction_evaluate=0.0, min_train_nodes=min_nodes,
                                         min_available_nodes=min_nodes)

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            acc, loss = evaluate(model, context)
            report.accuracy[server_round], report.loss[server_round] = acc, loss
            return MetricRecord({"accuracy": acc, "loss": loss})

        t0 = time.perf_counter()
        strat.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                    evaluate_fn=central)
        report.wall_s = time.perf_counter() - t0
        report.rounds = strat.history
        path = context.run_config.get("report-path")
        if path:
            with open(str(path), "w") as f:
                f.write(report.to_json())

    return app
