"""A federation on Flower's simulation engine (Ray backend), offline: ``edgetrain fl simulate``.

The task is the bundled MNIST digits with a small CNN, or your model and data (``SimulationConfig.task``, a
:class:`~edgetrain.fl.spec_task.SpecTask`). Clients are drawn round-robin from device tiers (a bundled device
profile and a memory budget each); each trains the full model through edgetrain inside its tier's budget,
or, with ``mode="heterofl"`` (the bundled task only), the widest width-sliced sub-model whose plain-PyTorch
peak fits it (:mod:`edgetrain.fl.baseline_heterofl`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from flwr.app import Context

from ..losses import perplexity
from .apps import RunReport, mnist_client_app, mnist_server_app, server_app, task_data_fn
from .settings import ClientSettings
from .spec_task import SpecTask

__all__ = ["DEFAULT_TIERS", "SimulationConfig", "run", "tier_settings"]

log = logging.getLogger(__name__)

#: (device profile, memory budget) per tier: the smallest lies below plain PyTorch's own peak for the full
#: CNN at batch 64 (edgetrain trains it there with micro-batches), the largest above it; the peaks of
#: plain PyTorch and of each HeteroFL width are measured in bench/RESULTS_FL.md.
DEFAULT_TIERS: tuple[tuple[str, str], ...] = (
    ("rpi4", "24MiB"), ("phone-2024", "28MiB"), ("jetson-nano", "34MiB"), ("jetson-tx2", "96MiB"))

OFFLINE_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated federation.

    Attributes:
        clients: number of virtual nodes.
        rounds: federated rounds.
        partition: ``"iid"`` or ``"dirichlet"``.
        alpha: Dirichlet concentration.
        seed: data split, partition and initial model seed.
        tiers: ``(device profile, budget)`` per tier; node ``i`` is in tier ``i % len(tiers)``.
        local_epochs: local epochs per round.
        batch_size: samples per step.
        lr: SGD learning rate.
        mode: ``"edgetrain"`` or ``"heterofl"`` (the width-sliced baseline).
        num_cpus: CPUs Ray may use (one client per CPU at a time).
        heterofl_widths: per tier, the sub-model width (``mode="heterofl"``; None: measured).
        task: your model and data (None: the bundled digits and small CNN).
    """

    clients: int = 8
    rounds: int = 5
    partition: str = "iid"
    alpha: float = 0.5
    seed: int = 0
    tiers: tuple[tuple[str, str], ...] = DEFAULT_TIERS
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    mode: str = "edgetrain"
    num_cpus: int = 2
    heterofl_widths: tuple[float | None, ...] | None = None
    task: SpecTask | None = None


def tier_settings(cfg: SimulationConfig, partition_id: int) -> ClientSettings:
    """The settings of node ``partition_id``: its tier's device profile and budget, the run's training."""
    profile, budget = cfg.tiers[partition_id % len(cfg.tiers)]
    return ClientSettings(memory_budget=None if str(budget).lower() in ("none", "") else budget,
                          device_profile=None if str(profile).lower() in ("none", "") else profile,
                          local_epochs=cfg.local_epochs,
                          batch_size=cfg.batch_size, lr=cfg.lr)


def run(cfg: SimulationConfig) -> RunReport:
    """Run the federation on Flower's simulation engine and return the server's report.

    Raises:
        ValueError: an unknown mode.
    """
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)

    def settings(context: Context) -> ClientSettings:
        return tier_settings(cfg, int(context.node_config.get("partition-id", 0)))

    if cfg.task is not None:
        if cfg.mode != "edgetrain":
            raise ValueError("mode 'heterofl' slices the bundled CNN's width; with your own model use 'edgetrain'")
        return _run(cfg, *_spec_apps(cfg, cfg.task, settings))
    if cfg.mode == "edgetrain":
        client = mnist_client_app(settings, partition=cfg.partition, alpha=cfg.alpha, seed=cfg.seed)
    elif cfg.mode == "heterofl":
        from .baseline_heterofl import heterofl_client_app, widest_fitting

        widths = cfg.heterofl_widths
        if widths is None:
            peaks: dict[float, int] = {}
            widths = tuple(widest_fitting(b, cfg.batch_size, peaks=peaks) for _, b in cfg.tiers)
        tier_widths = tuple(widths)

        def width_of(context: Context, s: ClientSettings) -> float | None:
            return tier_widths[int(context.node_config.get("partition-id", 0)) % len(tier_widths)]

        client = heterofl_client_app(task_data_fn(cfg.partition, cfg.alpha, cfg.seed), width_of, settings)
    else:
        raise ValueError(f"unknown mode {cfg.mode!r}; use 'edgetrain' or 'heterofl'")
    report = RunReport()
    return _run(cfg, client, mnist_server_app(cfg.rounds, report, seed=cfg.seed, min_nodes=cfg.clients), report)


def _spec_apps(cfg: SimulationConfig, task: SpecTask, settings: Callable[[Context], ClientSettings]
               ) -> tuple[Any, Any, RunReport]:
    from .client import client_app
    from .spec_task import evaluate_spec, load_spec_task, spec_data_fn, spec_loss_fn, spec_model_fn

    load_spec_task(task)  # a bad data spec fails here, once, before Ray starts
    report = RunReport()
    client = client_app(spec_model_fn(task), spec_data_fn(task, cfg.partition, cfg.alpha), settings=settings,
                        loss_fn=spec_loss_fn(task))
    server = server_app(spec_model_fn(task), lambda model, context: evaluate_spec(task, model), cfg.rounds, report,
                        seed=task.seed, min_nodes=cfg.clients)
    return client, server, report


def _run(cfg: SimulationConfig, client: Any, server: Any, report: RunReport) -> RunReport:
    from flwr.simulation import run_simulation

    backend: dict[str, Any] = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"num_cpus": cfg.num_cpus, "include_dashboard": False}}
    t0 = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=cfg.clients, backend_config=backend)
    report.wall_s = time.perf_counter() - t0
    return report


def _global(report: RunReport, n: int, lm: bool = False) -> str:
    acc, loss = report.accuracy.get(n, float("nan")), report.loss.get(n, float("nan"))
    if lm:  # the token-mean cross-entropy's exponential
        return f"global loss {loss:.4f}, perplexity {perplexity(loss):.2f}"
    return f"global loss {loss:.4f}" if acc != acc else f"global accuracy {acc:.4f}, loss {loss:.4f}"


def format_report(report: RunReport, cfg: SimulationConfig) -> str:
    """Per round the global accuracy, and per client its peak memory against its budget."""
    from ..spec.lm import TASK as LM_TASK

    what = f"{cfg.task.model} on {cfg.task.data}, " if cfg.task is not None else ""
    lm = cfg.task is not None and cfg.task.task == LM_TASK
    partition = "iid" if lm else cfg.partition  # blocks of text have no class to skew shards by
    lines = [f"{what}{cfg.mode}, {cfg.clients} clients, {partition}"
             + (f" (alpha {cfg.alpha})" if partition == "dirichlet" else "")
             + f", {cfg.rounds} rounds x {cfg.local_epochs} local epoch(s), batch {cfg.batch_size}",
             f"round 0: {_global(report, 0, lm)}"]
    for r in report.rounds:
        n = r["round"]
        lines.append(f"round {n}: {_global(report, n, lm)}")
        for c in sorted(r["clients"], key=lambda c: c["partition-id"]):
            mib = 1 << 20
            ok = "ok" if c["within-budget"] else "OVER"
            extra = f" width {c['width']:.2f}" if "width" in c else \
                f" micro-batch {int(c['micro-batch-size'])}, plan {'cached' if c['plan-cached'] else 'new'}"
            budget = f"budget {c['budget-bytes'] / mib:6.1f} MiB {ok}" if c["budget-bytes"] else "no budget"
            lines.append(f"  client {int(c['partition-id'])}: peak {c['peak-bytes'] / mib:6.1f} MiB / {budget},"
                         f"{extra}, {c['step-time-s'] * 1e3:.0f} ms/step")
        for f in r["failures"]:
            lines.append(f"  failed: {f}")
    lines.append(f"wall time {report.wall_s:.1f} s")
    return "\n".join(lines)
