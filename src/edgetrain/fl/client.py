"""``client_app``: a Flower ClientApp that trains the full model exactly, inside each node's memory budget.

Each train message: the node's settings are read from its ``Context``; the model is built and loaded with
the global arrays; ``edgetrain.prepare`` plans the step for the node's budget (once per node: the plan and
its costs are kept in ``context.state``, and on disk when a cache directory is given, and reused with
``prepare(plan=, costs=)`` in later rounds); the local epochs run through the step; the reply carries every
array, which of them were trained (:mod:`edgetrain.fl.payload`) and the metrics below. A budget that cannot
be met is answered with a Flower ``Error`` reply naming the smallest feasible budget: the server logs it,
the run goes on with the other clients.

Reply metrics (``MetricRecord``, the same keys for every client): ``num-examples``, ``partition-id``
(-1 outside simulation), ``budget-bytes`` (0: unbounded), ``peak-bytes`` (measured in the client: peak
resident memory above what the process held when the message arrived), ``within-budget`` (1/0),
``predicted-peak-bytes``, ``step-time-s`` (mean measured), ``predicted-step-time-s`` (on the device
profile), ``predicted-energy-j`` (per round, on the device profile; -1 without one), ``measured-energy-j``
(RAPL over the round; -1 where unreadable), ``train-loss``, ``prepare-time-s``, ``plan-cached`` (1/0),
``micro-batch-size``, ``recomputed-stages``, ``trained-tensors``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from ..api import prepare
from ..errors import BudgetError
from ..profile import memory
from ..runtime import pool
from ..units import format_bytes, parse_bytes
from .energy import RaplMeter, predicted_step_energy_j
from .payload import TRAINED_KEY, load_arrays, model_arrays, trained_mask
from .plan_cache import load_plan, plan_key, store_plan
from .settings import ClientSettings

__all__ = ["ClientData", "client_app", "BUDGET_ERROR_CODE"]

log = logging.getLogger(__name__)

#: ``Error.code`` of the reply of a client whose budget cannot be met
BUDGET_ERROR_CODE = 4001

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ClientData:
    """What a node trains and evaluates on.

    Attributes:
        train: ``train(epoch)`` yields that epoch's ``(x, y)`` batches, each of the same size; ``epoch``
            counts over the whole run (round ``r``'s local epoch ``e`` is ``(r - 1) * local_epochs + e``),
            so each round may draw a new order.
        num_train: samples in one epoch (the FedAvg weight).
        test: ``(x, y)`` to evaluate on, or None (evaluate then replies with no examples).
    """

    train: Callable[[int], Batches]
    num_train: int
    test: tuple[torch.Tensor, torch.Tensor] | None = None


SettingsSource = ClientSettings | Callable[[Context], ClientSettings]


def _settings(source: SettingsSource, context: Context) -> ClientSettings:
    base = source(context) if callable(source) else source
    return base.overridden(dict(context.run_config), dict(context.node_config))


def _start_clean() -> None:
    """Free what earlier messages left, then make the current resident memory the budget's zero point.

    A simulation runs many virtual nodes in one process: what one left behind (freed heap glibc keeps,
    the tensor pool's cache) is not the next one's memory.
    """
    gc.collect()  # first, so that the tensors it frees go back to the pool before the pool is released
    if pool.installed():
        pool.release()
    memory.record_baseline(release=True)


@contextlib.contextmanager
def _message_scope(threads: int) -> Iterator[None]:
    """Within: the budget's zero point is the resident memory now (:func:`_start_clean`) and torch runs
    ``threads`` intra-op threads; both are restored after, so the process's own code (or a test suite
    sharing it) keeps its ``import edgetrain`` zero point and thread count."""
    old_baseline, old_threads = memory.baseline_rss_bytes(), torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    _start_clean()
    try:
        yield
    finally:
        memory._BASELINE_RSS = old_baseline  # noqa: SLF001 -- memory has no setter for a value read earlier
        torch.set_num_threads(old_threads)


def client_app(model_fn: Callable[[], nn.Module], data_fn: Callable[[Context, ClientSettings], ClientData], *,
               settings: SettingsSource = ClientSettings(),
               loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy,
               cache_dir: str | None = None) -> ClientApp:
    """Build the ClientApp.

    Args:
        model_fn: builds the (untrained) model; the global arrays are loaded into it.
        data_fn: ``data_fn(context, settings)`` returns the node's :class:`ClientData`.
        settings: the node's :class:`ClientSettings`, or a function of the ``Context`` returning them;
            ``run_config`` and then ``node_config`` keys override them.
        loss_fn: ``loss_fn(output, y)``, the mean loss.
        cache_dir: also keep plans on disk here (survives a restarted node).

    Returns:
        A ``flwr.clientapp.ClientApp`` with ``train`` and ``evaluate`` handlers.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        s = _settings(settings, context)
        data = data_fn(context, s)  # loading the data set is not training memory: before the zero point
        with _message_scope(s.threads), memory.measure_peak() as peak:
            rapl = RaplMeter()
            try:
                reply, metrics = _train(msg, context, s, model_fn, data, loss_fn, cache_dir)
            except BudgetError as e:
                need = "" if e.min_feasible_bytes is None else f"; smallest feasible {format_bytes(e.min_feasible_bytes)}"
                reason = f"edgetrain: budget {s.memory_budget} cannot be met on this node{need}: {e}"
                log.warning("%s", reason)
                return Message(Error(code=BUDGET_ERROR_CODE, reason=reason), reply_to=msg)
            energy_j = rapl.joules()
        budget = 0 if s.memory_budget is None else parse_bytes(s.memory_budget)
        metrics["peak-bytes"] = peak.above_baseline_bytes
        metrics["budget-bytes"] = budget
        metrics["within-budget"] = int(budget == 0 or peak.above_baseline_bytes <= budget)
        metrics["measured-energy-j"] = energy_j
        reply["metrics"] = MetricRecord(metrics)
        log.info("node %s: peak %s of budget %s, %.1f ms/step", context.node_config.get("partition-id", "-"),
                 format_bytes(peak.above_baseline_bytes), s.memory_budget, metrics["step-time-s"] * 1e3)
        return Message(reply, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        s = _settings(settings, context)
        model = model_fn()
        load_arrays(model, msg.content["arrays"])
        data = data_fn(context, s)
        loss, acc, n = 0.0, 0.0, 0
        if data.test is not None:
            from .task import evaluate_accuracy

            acc, loss = evaluate_accuracy(model, *data.test)
            n = int(data.test[1].numel())
        return Message(RecordDict({"metrics": MetricRecord({"eval-loss": loss, "eval-acc": acc, "num-examples": n})}),
                       reply_to=msg)

    return app


def _server_round(msg: Message) -> int:
    configs = msg.content.config_records
    for record in configs.values():
        if "server-round" in record:
            return int(record["server-round"])
    return 1


def _train(msg: Message, context: Context, s: ClientSettings, model_fn: Callable[[], nn.Module],
           data: ClientData, loss_fn: Callable[..., torch.Tensor],
           cache_dir: str | None) -> tuple[RecordDict, dict[str, Any]]:
    model = model_fn()
    load_arrays(model, msg.content["arrays"])
    buffers_before = {k: v.clone() for k, v in model.named_buffers()}
    optimizer = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum)
    first_epoch = (_server_round(msg) - 1) * s.local_epochs
    example = next(iter(data.train(first_epoch)))
    key = plan_key(model, example, budget=s.memory_budget, profile=s.device_profile, speedup=s.speedup,
                   grad_filter=[s.grad_filter_radius, s.grad_filter_last_n])
    cached = load_plan(context.state, key, cache_dir)
    t0 = time.perf_counter()
    step = prepare(model, optimizer, loss_fn, example=example, memory_budget=s.memory_budget, speedup=s.speedup,
                   grad_filter=s.grad_filter, plan=None if cached is None else cached[0],
                   costs=None if cached is None else cached[1])
    prepare_s = time.perf_counter() - t0
    if cached is None:
        store_plan(context.state, key, step.plan, step.costs, cache_dir)
    trained: set[str] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    losses, times = [], []
    try:
        for epoch in range(s.local_epochs):
            for x, y in data.train(first_epoch + epoch):
                t = time.perf_counter()
                losses.append(step(x, y))
                times.append(time.perf_counter() - t)
                trained.update(names[id(p)] for p in step.trained_parameters())
    finally:
        step.close()
    mask = trained_mask(model, trained, buffers_before)
    step_s, step_j = predicted_step_energy_j(step.plan, step.costs, s.device_profile)
    metrics: dict[str, Any] = {
        "num-examples": data.num_train,
        "partition-id": int(context.node_config.get("partition-id", -1)),
        "predicted-peak-bytes": int(step.plan.peak_bytes),
        "step-time-s": sum(times) / max(1, len(times)),
        "predicted-step-time-s": float(step_s),
        "predicted-energy-j": float(step_j * len(times)) if step_j >= 0 else -1.0,
        "train-loss": sum(losses) / max(1, len(losses)),
        "prepare-time-s": prepare_s,
        "plan-cached": int(cached is not None),
        "micro-batch-size": int(step.plan.micro_batch_size),
        "recomputed-stages": int(step.plan.policies.count("recompute")),
        "trained-tensors": sum(mask.values()),
    }
    reply = RecordDict({"arrays": model_arrays(model), TRAINED_KEY: ConfigRecord(mask)})
    return reply, metrics
