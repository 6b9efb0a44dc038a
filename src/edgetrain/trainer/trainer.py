"""`Trainer`: a fit loop over :func:`edgetrain.prepare` with evaluation, schedules, clipping and crash-safe resume.

The step stays the core: every optimizer step is one ``TrainStep`` call on one logical batch, so the
Trainer trains exactly what a plain PyTorch loop over the same batches would. What the Trainer adds is
bookkeeping around it: the data order (reseeded per epoch), the position in the epoch, checkpoints that
hold everything needed to continue bit for bit, and the hooks users plug into.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .._state import modes_kept
from ..batch import batch_signature, batch_size_of, call_model, describe_signature, larger_per_sample, slice_batch
from ..errors import ConfigError
from ..graph import run_micro_batch_sizes
from ..plan import Plan
from ._checkpoints import CheckpointDir, TrainerState
from .data import as_pair, epoch_batches, num_batches, short_batch_size
from ._rng import capture_rng, restore_rng
from .callbacks import CSVLogger, TensorBoardLogger, progress_bar, progress_enabled
from .config import TrainerConfig

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

Metric = Callable[[Any, Any], "float | torch.Tensor"]


def _slices(x: Any, y: Any, n: int, size: int) -> Iterator[tuple[Any, Any, int]]:
    """``(inputs, targets, samples)`` of a batch of ``n`` in the micro-batch sizes a step of ``size`` runs (the
    whole batch unsliced when it fits, as the step does)."""
    if n <= size:
        yield x, y, n
        return
    start = 0
    for m in run_micro_batch_sizes(n, size):
        yield slice_batch(x, start, start + m), slice_batch(y, start, start + m), m
        start += m


class Trainer:
    """Train ``model`` for some epochs inside a memory budget, with checkpoints a crash cannot corrupt.

    Args:
        model: the ``nn.Module`` to train (in place).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(output, targets)``, the mean loss over the samples it is given.
        train_data: a ``torch.utils.data.DataLoader``, any re-iterable of ``(inputs, targets)`` batches, or a
            callable ``epoch -> iterable``. A DataLoader's ``RandomSampler`` is reseeded every epoch from
            ``config.seed`` (so a resumed run sees the same order); other data must iterate the same way
            each time it is asked for the same epoch.
        val_data: batches to evaluate on after each epoch (None: no evaluation).
        memory_budget: the step's budget (bytes or a size like ``"300MiB"``; None: unbounded), or a
            budget source (a callable returning the budget in force, polled between micro-batches).
            Assign :attr:`memory_budget` later to change it while training.
        config: a :class:`TrainerConfig`; keyword arguments named like its fields override it.
        scheduler: an LR scheduler over ``optimizer`` (stepped per ``config.scheduler_interval``).
        metrics: ``{"name": fn(output, targets)}`` evaluated on ``val_data`` (each averaged over samples).
        callbacks: objects with any of ``on_fit_start``, ``on_step_end``, ``on_eval_end``, ``on_epoch_end``,
            ``on_fit_end`` (see :class:`~edgetrain.trainer.Callback`).
        example: the batch ``prepare`` plans for (default: the first training batch, drawn with every RNG
            restored afterwards). Shorter batches run on its plan; a full batch longer per sample (a
            collator padding to each batch's longest) makes the Trainer plan again on it (logged, counted
            in :attr:`replans`): pass the longest batch to plan once.
        resume: continue from the newest usable checkpoint in ``config.checkpoint_dir`` (a fresh start when
            there is none).
        prepare_options: further keyword arguments of :func:`edgetrain.prepare` (``planning=PlanConfig(...)``,
            ``paging=PagingConfig(...)``, ``speedup``, ``grad_filter``, ``name``).

    Raises:
        ConfigError: an option is invalid (``resume=True`` without a checkpoint directory, ...).
        CheckpointError: checkpoints exist but none is usable.
        BudgetError: no plan fits the memory budget.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                 train_data: Any, val_data: Iterable[Any] | None = None, *,
                 memory_budget: int | str | Callable[[], int | str | None] | None = None,
                 config: TrainerConfig | None = None, scheduler: Any = None,
                 metrics: Mapping[str, Metric] | None = None, callbacks: Sequence[Any] = (),
                 example: Any = None, resume: bool = False, prepare_options: Mapping[str, Any] | None = None,
                 **options: Any) -> None:
        from ..api import prepare

        config = config or TrainerConfig()
        unknown = set(options) - set(TrainerConfig.field_names())
        if unknown:
            raise ConfigError(f"unknown Trainer option(s) {', '.join(sorted(unknown))}; valid: "
                              f"{', '.join(TrainerConfig.field_names())}")
        self.config = replace(config, **options)
        if resume and self.config.checkpoint_dir is None:
            raise ConfigError("resume=True needs checkpoint_dir (where the checkpoints are)")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.train_data, self.val_data = train_data, val_data
        self.scheduler = scheduler
        self.metrics = dict(metrics or {})
        self.callbacks: list[Any] = list(callbacks)
        if self.config.log_dir is not None:
            self.callbacks.append(CSVLogger(self.config.log_dir))
            if self.config.tensorboard:
                self.callbacks.append(TensorBoardLogger(self.config.log_dir))
        self.state = TrainerState()
        self.history: list[dict[str, float]] = []
        self.stopped_early = False
        self._best: float | None = None
        self._bad_evals = 0
        self._resume_rng: dict[str, Any] | None = None
        self._checkpoints = (CheckpointDir(self.config.checkpoint_dir, self.config.keep_checkpoints)
                             if self.config.checkpoint_dir is not None else None)
        self.example = as_pair(example) if example is not None else self._peek()
        static_budget = None if callable(memory_budget) else memory_budget
        options = dict(prepare_options or {})
        if self.config.grad_clip_norm or self.config.grad_clip_value:  # clipping needs every gradient first
            options["planning"] = _unfused(options.get("planning"), options)
        self._options = options
        self.replans = 0  # plans made again on a batch longer per sample than the example (see _plan_for)
        self.step = prepare(model, optimizer, loss_fn, self.example, memory_budget=static_budget, **options)
        self.step.before_optimizer_step = self._clip if (self.config.grad_clip_norm or
                                                         self.config.grad_clip_value) else None
        short = short_batch_size(train_data, self.step.plan.batch_size)
        if short is not None:  # its kernels stay resident once it has run: room is made for them now
            self.step.expect_batch_size(short)
        self._pending_budget: int | str | None = None
        self._user_source = memory_budget if callable(memory_budget) else None
        if self._user_source is not None:
            self.step.budget_source = self._poll_budget
        if resume:
            self._restore()

    # -- budget ---------------------------------------------------------------------------------------
    @property
    def memory_budget(self) -> int | None:
        """The step's budget in force (bytes); assign a new one (bytes or a size string) to change it.

        The change goes through the step's budget source, so it takes effect at the next micro-batch
        boundary, as a table lookup (the table is built on the first change).
        """
        return self.step.budget_bytes

    @memory_budget.setter
    def memory_budget(self, value: int | str) -> None:
        self._pending_budget = value
        if self.step.budget_source is None:
            self.step.budget_source = self._poll_budget

    def _poll_budget(self) -> int | str | None:
        if self._pending_budget is not None:
            value, self._pending_budget = self._pending_budget, None
            return value
        return self._user_source() if self._user_source is not None else None

    # -- one step -------------------------------------------------------------------------------------
    def _clip(self) -> None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.grad_clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.config.grad_clip_value)
        if self.config.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip_norm)

    def _plan_for(self, x: Any, y: Any) -> None:
        """Plan the step again on this batch when it is a full batch longer per sample than the one the step
        was planned for (a collator padding each batch to its longest met a longer one): the plan, its budget
        and its exactness hold for batches no larger than its example, and the longest so far becomes the
        example. Any other misfit is left to the step, which refuses it with what to do."""
        from ..api import prepare

        old = self.step
        sig = batch_signature((x, y))
        if sig == old.example_signature or not larger_per_sample(sig, old.example_signature):
            return
        if batch_size_of(x, y) != old.plan.batch_size:
            return  # a short batch cannot stand for full ones; the step says what to do
        t0, rng = time.perf_counter(), capture_rng()
        try:  # the batches after it draw what they would have drawn without the new plan
            step = prepare(self.model, self.optimizer, self.loss_fn, (x, y), memory_budget=old.budget_bytes,
                           **self._options)
        finally:
            restore_rng(rng)
        step.before_optimizer_step, step.budget_source = old.before_optimizer_step, old.budget_source
        step.steps_done = old.steps_done
        old.close()
        self.step, self.example = step, (x, y)
        self.replans += 1
        log.warning("batch %d of epoch %d is longer per sample than the step's example (%s, planned for %s): "
                    "planned again on it in %.1f s; give example= a batch as long as the longest to plan once",
                    self.state.batch_in_epoch + 1, self.state.epoch + 1, describe_signature(sig),
                    describe_signature(old.example_signature), time.perf_counter() - t0)

    def _peek(self) -> tuple[Any, Any]:
        rng = capture_rng()
        try:
            first = next(iter(epoch_batches(self.train_data, 0, self.config.seed)), None)
        finally:
            restore_rng(rng)
        if first is None:
            raise ConfigError("the training data yields no batch")
        return as_pair(first)

    def _call(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(self, *args)

    # -- checkpoints ----------------------------------------------------------------------------------
    def _trainer_json(self) -> str:
        return json.dumps({"history": self.history, "best": self._best, "bad_evals": self._bad_evals,
                           "stopped_early": self.stopped_early})

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the current position now (no-op without ``checkpoint_dir``)."""
        if self._checkpoints is None:
            return
        self._checkpoints.save(self.state, self.model, self.optimizer, self.scheduler, capture_rng(),
                               self.step.plan.to_json(), self._trainer_json())

    def _restore(self) -> None:
        assert self._checkpoints is not None
        payload = self._checkpoints.load_latest(self.model, self.optimizer, self.scheduler)
        if payload is None:
            log.info("no checkpoint in %s: starting afresh", self.config.checkpoint_dir)
            return
        self.state = TrainerState(int(payload["epoch"]), int(payload["batch_in_epoch"]),
                                  int(payload["global_step"]))
        t = json.loads(payload["trainer"])
        self.history, self._best, self._bad_evals = t["history"], t["best"], t["bad_evals"]
        self.stopped_early = bool(t["stopped_early"])
        self.step.steps_done = self.state.global_step
        plan = Plan.from_json(payload["plan"])
        if plan.num_stages == len(self.step.costs.stages) and plan.batch_size == self.step.plan.batch_size:
            # the same micro-batches as before the crash: accumulation order, hence rounding, is identical
            self.step.set_plan(plan)
        else:
            log.warning("the checkpoint's plan does not fit this step's chain; keeping the new plan (results "
                        "may differ from an uninterrupted run by rounding)")
        self._resume_rng = payload["rng"]
        log.info("resumed at epoch %d, batch %d (step %d)", self.state.epoch, self.state.batch_in_epoch,
                 self.state.global_step)

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """Mean loss and metrics over ``data`` (default ``val_data``), without gradients, in eval mode.

        Runs under a forked torch RNG, so evaluating never changes what training draws. A batch larger than
        the step's micro-batch is run in slices of that size (the loss combined as training combines its
        micro-batches', metrics weighted by samples): a forward at the batch's size would build kernels and
        activations for a shape training never runs, outside the budget (``edgetrain train data=mnist
        memory_budget=80MiB`` trained in micro-batches of 8 inside it, then evaluated at 32 to 81.5 MiB).
        """
        data = self.val_data if data is None else data
        if data is None:
            return {}
        sums = {"val_loss": 0.0, **{f"val_{k}": 0.0 for k in self.metrics}}
        total = 0
        loss_total = 0.0  # a mean over the targets that count (tokens) is weighted by their count, as training does
        norm = self.step.loss_norm
        by_targets = norm is not None and norm.kind == "weighted"
        size = self.step.plan.micro_batch_size
        # every module's own flag comes back (a frozen part left in eval mode stays so)
        with modes_kept(self.model):
            self.model.eval()
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                for batch in data:
                    x, y = as_pair(batch)
                    n = len(y) if hasattr(y, "__len__") else 1
                    losses, w = [], 0.0
                    for xs, ys, m in _slices(x, y, n, size if isinstance(y, torch.Tensor) else n):
                        out = call_model(self.model, xs)
                        wc = norm.weight(ys, m) if by_targets else m
                        if wc:  # a slice with no target that counts has a loss of 0/0 and adds nothing
                            losses.append((float(self.loss_fn(out, ys)), wc))
                        w += wc
                        for k, fn in self.metrics.items():
                            sums[f"val_{k}"] += float(fn(out, ys)) * m
                    if w:
                        sums["val_loss"] += self._batch_loss(losses, w) * w
                    loss_total += w
                    total += n
        metrics = {k: v / max(total, 1) for k, v in sums.items()}
        metrics["val_loss"] = sums["val_loss"] / loss_total if loss_total else 0.0
        self._call("on_eval_end", metrics)
        return metrics

    def _batch_loss(self, losses: list[tuple[float, float]], weight: float) -> float:
        """A batch's loss from its slices' ``(loss, weight)``, as the step combines its micro-batches'."""
        if len(losses) == 1:
            return losses[0][0]
        norm = self.step.loss_norm
        if norm is not None:
            return norm.combine(losses, weight)
        return sum(v * w for v, w in losses) / weight

    def _improved(self, logs: dict[str, float]) -> bool:
        value = logs.get(self.config.monitor)
        if value is None:
            raise ConfigError(f"monitor {self.config.monitor!r} is not among the epoch values "
                              f"{', '.join(sorted(logs))}")
        sign = 1.0 if self.config.monitor_mode == "min" else -1.0
        if self._best is None or sign * (self._best - value) > self.config.min_delta:
            self._best, self._bad_evals = value, 0
            return True
        self._bad_evals += 1
        return False

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self, epochs: int) -> list[dict[str, float]]:
        """Train until ``epochs`` epochs are done (counting those before a resume) or early stopping.

        Returns:
            One dict per epoch done: ``epoch``, ``step``, ``train_loss`` and the evaluation's values.
        """
        cfg = self.config
        self._call("on_fit_start", self.state.global_step)
        bar_on = progress_enabled(cfg.progress)
        while self.state.epoch < epochs and not self.stopped_early:
            epoch = self.state.epoch
            skip = self.state.batch_in_epoch
            batches = epoch_batches(self.train_data, epoch, cfg.seed, skip)
            if self._resume_rng is not None:  # after skipping: the skipped batches drew from the RNGs too
                restore_rng(self._resume_rng)
                self._resume_rng = None
            total = num_batches(self.train_data)
            loss_sum, n_steps = 0.0, 0
            for batch in progress_bar(batches, total, f"epoch {epoch + 1}/{epochs}", bar_on, initial=skip):
                x, y = as_pair(batch)
                self._plan_for(x, y)
                loss = self.step(x, y)
                self.state.global_step += 1
                self.state.batch_in_epoch += 1
                loss_sum, n_steps = loss_sum + loss, n_steps + 1
                if self.scheduler is not None and cfg.scheduler_interval == "step" and not _plateau(self.scheduler):
                    self.scheduler.step()
                self._call("on_step_end", {"step": self.state.global_step, "epoch": epoch, "loss": loss,
                                           "lr": float(self.optimizer.param_groups[0]["lr"])})
                if cfg.checkpoint_every_steps and self.state.global_step % cfg.checkpoint_every_steps == 0:
                    self.save_checkpoint()
            logs: dict[str, float] = {"step": self.state.global_step,
                                      "train_loss": loss_sum / n_steps if n_steps else math.nan}
            last = epoch + 1 == epochs
            if self.val_data is not None and ((epoch + 1) % cfg.eval_every_epochs == 0 or last):
                logs.update(self.evaluate())
            if self.scheduler is not None:
                if _plateau(self.scheduler):
                    if cfg.monitor in logs:
                        self.scheduler.step(logs[cfg.monitor])
                elif cfg.scheduler_interval == "epoch":
                    self.scheduler.step()
            if cfg.early_stopping_patience is not None and cfg.monitor in logs:
                if not self._improved(logs) and self._bad_evals >= cfg.early_stopping_patience:
                    log.info("early stopping after epoch %d: %s did not improve for %d evaluations", epoch + 1,
                             cfg.monitor, self._bad_evals)
                    self.stopped_early = True
            self.history.append({"epoch": epoch, **logs})
            self.state = TrainerState(epoch + 1, 0, self.state.global_step)
            self.save_checkpoint()
            self._call("on_epoch_end", epoch, logs)
        self._call("on_fit_end")
        return self.history

    def report(self, path: str, **options: Any) -> Any:
        """Write the plan report for this Trainer's step (memory timeline measured on its example batch)."""
        return self.step.report(path, batch=self.example, **options)

    def close(self) -> None:
        """Release the step's hooks and page file."""
        self.step.close()


def _plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _unfused(planning: Any, options: dict[str, Any]) -> Any:
    """``planning`` (a PlanConfig or None) with the optimizer update kept after the backward; the deprecated
    planning keywords in ``options`` move into it."""
    from ..config import LEGACY_KWARGS, PlanConfig, _warn_once

    if planning is None:
        names = [k for k in list(options) if k in LEGACY_KWARGS and LEGACY_KWARGS[k][0] == "planning"]
        for k in names:  # as prepare would have warned, had they reached it
            _warn_once(k, "planning", LEGACY_KWARGS[k][1])
        planning = PlanConfig(**{LEGACY_KWARGS[k][1]: options.pop(k) for k in names})
    return replace(planning, fused_update=False)
