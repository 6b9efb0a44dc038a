"""Run one training job in a fresh Python process and report its measured peak memory and step time.

The only honest way to measure a peak RSS is a process that did nothing else before: this module is both
the library helper (:func:`run_isolated`) and the worker it starts (``python -m edgetrain.measure JSON``).
A job is plain data (:class:`Job`), so tests, the benchmark and the CLI describe jobs the same way.

The peak reported is ``VmHWM`` minus the RSS right after ``import torch, edgetrain``: the quantity a
memory budget bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .config import options

__all__ = ["Job", "JobResult", "run_isolated", "build_model_and_batch"]


@dataclass(frozen=True)
class Job:
    """A training job to measure.

    Attributes:
        model: a name from ``edgetrain.models.MODEL_NAMES``.
        model_kwargs: passed to the model builder.
        input_shape: per-sample input shape, e.g. ``(3, 64, 64)`` or ``(28, 28)``.
        batch_size: logical batch per step.
        mode: ``"plain"`` (PyTorch as users write it, with gradient accumulation when ``micro_batch_size``
            is set), ``"checkpoint_sequential"`` (``torch.utils.checkpoint.checkpoint_sequential`` over the
            model's stages with ``segments``), or ``"edgetrain"``.
        budget: memory budget for edgetrain (bytes or a size string; None: unbounded).
        micro_batch_size: for plain (gradient accumulation) and edgetrain (fixed micro-batch).
        segments: for checkpoint_sequential.
        solver: edgetrain planner name.
        steps: optimizer steps to run (the first one is a warm-up and not timed).
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        seed: for the model's initialisation and the random batch.
        threads: torch intra-op threads (0: leave the default).
        env: extra environment variables for the worker (e.g. ``EDGETRAIN_ALLOCATOR=system``).
        paging: for edgetrain, let the planner page saved tensors as well as recompute (``prepare(paging=)``).
        objective: for edgetrain with paging, ``"time"`` or ``"energy"`` (``prepare(objective=)``).
        budget_after: for edgetrain, a budget switched to (``step.set_memory_budget``) after the first step;
            the peak reported is then the peak over the steps after the switch.
        exact_batchnorm: for edgetrain, ``prepare(exact_batchnorm=)``: False lets the planner micro-batch a
            BatchNorm model when that is faster (each micro-batch then normalises with its own statistics,
            as gradient accumulation does).
        activation_memory_budget: for ``mode="compile"`` (plain PyTorch's step around ``torch.compile(model)``,
            with gradient accumulation when ``micro_batch_size`` is set): the ratio (0-1) set as
            ``torch._functorch.config.activation_memory_budget``, PyTorch's own recomputation planner (1.0: its
            default, save what the graph saves; 0.0: recompute as much as it can). The first step compiles;
            the peak reported is over the steps after it (``warmup_peak_bytes``: the first step's;
            ``warmup_rss_bytes``: the resident bytes right after it, compiled code and state included).
        page_optimizer_state: for edgetrain, ``PlanConfig(page_optimizer_state=)``.
        fused_update: for edgetrain, ``PlanConfig(fused_update=)``.
        compile: for edgetrain, ``PlanConfig(compile=)`` (the step runs compiled where a measured trial fits).
        layout: for edgetrain, ``PlanConfig(layout=)`` (``"keep"``, ``"channels_last"`` or ``"auto"``).
    """

    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    mode: str = "edgetrain"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | str | None = None
    micro_batch_size: int | None = None
    segments: int | None = None
    solver: str = "dp"
    steps: int = 3
    optimizer: str = "sgd"
    seed: int = 0
    threads: int = 0
    env: dict[str, str] = field(default_factory=dict)
    paging: bool = False
    objective: str = "time"
    budget_after: int | str | None = None
    exact_batchnorm: bool = True
    activation_memory_budget: float | None = None
    page_optimizer_state: bool | str = "auto"
    fused_update: bool | str = "auto"
    compile: bool = False
    layout: str = "keep"


@dataclass
class JobResult:
    """What a job measured. ``error`` is set (and the numbers are 0) when the job failed."""

    peak_bytes: int = 0
    step_time_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    prepare_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    min_feasible_bytes: int | None = None
    warmup_peak_bytes: int = 0
    warmup_rss_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def build_model_and_batch(job: Job) -> tuple[Any, Any, Any]:
    """The job's model and a random batch (inputs, integer targets), built deterministically from ``seed``."""
    import torch

    from .models import get_model

    torch.manual_seed(job.seed)
    kwargs = dict(job.model_kwargs)
    model = get_model(job.model, **kwargs)
    if job.model == "transformer" and kwargs.get("vocab_size"):
        x = torch.randint(0, kwargs["vocab_size"], (job.batch_size, *job.input_shape))
    else:
        x = torch.randn(job.batch_size, *job.input_shape)
    classes = kwargs.get("num_classes", 1000)
    y = torch.randint(0, classes, (job.batch_size,))
    return model, x, y


def _make_optimizer(job: Job, model: Any) -> Any:
    import torch

    if job.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _single_value_functions(chain: Any) -> list[Any] | None:
    """The chain as functions of the one value crossing each clean cut, for ``checkpoint_sequential``.

    Consecutive stages are grouped until exactly one value produced so far is read later (values such as
    sizes that cross a stage boundary beside the activation stay inside a group); a chain of single-input,
    single-output stages gives one function per stage. None when no such grouping exists.
    """
    from .capture import OUTPUT_KEY

    stages = chain.stages
    if len(chain.input_names) != 1:
        return None
    read_after: list[set[str]] = []
    reads: set[str] = set()
    for st in reversed(stages):
        read_after.append(set(reads))
        reads |= set(st.inputs)
    read_after.reverse()
    produced, start, name_in = set(chain.input_names), 0, chain.input_names[0]
    funcs = []
    for k, st in enumerate(stages):
        produced |= set(st.outputs)
        crossing = {OUTPUT_KEY} & produced if k == len(stages) - 1 else produced & read_after[k]
        if len(crossing) != 1:
            continue
        (name_out,) = crossing

        def run(v: Any, group: tuple[Any, ...] = tuple(stages[start:k + 1]), a: str = name_in,
                b: str = name_out) -> Any:
            env = {a: v}
            for g in group:
                env.update(zip(g.outputs, g(*(env[i] for i in g.inputs))))
            return env[b]

        funcs.append(run)
        start, name_in = k + 1, name_out
    return funcs if start == len(stages) and funcs else None


def _accumulating_step(job: Job, forward: Callable[[Any], Any], opt: Any, loss_fn: Any, x: Any,
                       y: Any) -> Callable[[], float]:
    """One optimizer step as users write it: gradient accumulation over micro-batches of the job's size."""
    m = job.micro_batch_size or job.batch_size

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, job.batch_size, m):
            xb, yb = x[i:i + m], y[i:i + m]
            loss = loss_fn(forward(xb), yb)
            (loss * (xb.shape[0] / job.batch_size)).backward()
            total += float(loss) * xb.shape[0]
        opt.step()
        return total / job.batch_size

    return run


def _worker(job: Job) -> JobResult:
    import torch

    import edgetrain
    from edgetrain.errors import BudgetError
    from edgetrain.profile import memory

    if job.threads:
        torch.set_num_threads(job.threads)
    res = JobResult()
    model, x, y = build_model_and_batch(job)
    opt = _make_optimizer(job, model)
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    if job.mode == "edgetrain":
        try:
            step = edgetrain.prepare(model, opt, loss_fn, (x, y), memory_budget=job.budget,
                                     **options(micro_batch_size=job.micro_batch_size, solver=job.solver,
                                               paging=job.paging, objective=job.objective,
                                               exact_batchnorm=job.exact_batchnorm,
                                               page_optimizer_state=job.page_optimizer_state,
                                               fused_update=job.fused_update, compile=job.compile,
                                               layout=job.layout))
        except BudgetError as e:
            res.error, res.error_type, res.min_feasible_bytes = str(e), "BudgetError", e.min_feasible_bytes
            res.peak_bytes = max(0, memory.peak_rss_bytes() - memory.baseline_rss_bytes())
            return res
        res.plan = json.loads(step.plan.to_json())
        run = lambda: step(x, y)  # noqa: E731
    elif job.mode == "plain":
        run = _accumulating_step(job, model, opt, loss_fn, x, y)
    elif job.mode == "checkpoint_sequential":
        from torch.utils.checkpoint import checkpoint_sequential

        from .capture import capture

        chain = capture(model, x[:2], carry_cuts=False)  # checkpoint_sequential: one tensor per cut
        funcs = _single_value_functions(chain)
        if funcs is None:
            res.error, res.error_type = "model is not a plain sequence of single-tensor stages", "ValueError"
            return res
        segments = max(1, min(job.segments or 1, len(funcs)))
        run = _accumulating_step(job, lambda xb: checkpoint_sequential(funcs, segments, xb, use_reentrant=False),
                                 opt, loss_fn, x, y)
    elif job.mode == "compile":
        import torch._functorch.config as functorch_config

        if job.activation_memory_budget is not None:
            functorch_config.activation_memory_budget = float(job.activation_memory_budget)
        run = _accumulating_step(job, torch.compile(model), opt, loss_fn, x, y)
    else:
        raise ValueError(f"unknown mode {job.mode!r}")
    res.prepare_time_s = time.perf_counter() - t0
    for i in range(job.steps):
        if i == 1 and job.mode == "compile":  # the first step compiled: report the steps that train
            res.warmup_peak_bytes = max(0, memory.peak_rss_bytes() - memory.baseline_rss_bytes())
            res.warmup_rss_bytes = max(0, memory.rss_bytes() - memory.baseline_rss_bytes())
            memory.reset_peak()
        if i == 1 and job.budget_after is not None and job.mode == "edgetrain":
            try:
                res.plan = json.loads(step.set_memory_budget(job.budget_after).to_json())
            except BudgetError as e:
                res.error, res.error_type, res.min_feasible_bytes = str(e), "BudgetError", e.min_feasible_bytes
                break
            memory.reset_peak()  # report the peak under the new budget only
        t = time.perf_counter()
        res.losses.append(float(run()))
        res.step_times_s.append(time.perf_counter() - t)
    timed = sorted(res.step_times_s[1:] or res.step_times_s)
    res.step_time_s = timed[len(timed) // 2]
    res.peak_bytes = max(0, memory.peak_rss_bytes() - memory.baseline_rss_bytes())
    return res


def run_isolated(job: Job, timeout_s: float = 900.0) -> JobResult:
    """Run ``job`` in a fresh ``python`` process and return what it measured.

    Raises:
        RuntimeError: the worker crashed or printed no result (its stderr is in the message).
    """
    env = dict(os.environ)
    env.update(job.env)
    env.setdefault("PYTHONHASHSEED", "0")
    proc = subprocess.run([sys.executable, "-m", "edgetrain.measure", json.dumps(asdict(job))],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("EDGETRAIN_RESULT "):
            return JobResult(**json.loads(line[len("EDGETRAIN_RESULT "):]))
    raise RuntimeError(f"measurement worker failed (exit {proc.returncode}): {proc.stderr[-3000:]}")


def _main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    spec["input_shape"] = tuple(spec["input_shape"])
    res = _worker(Job(**spec))
    print("EDGETRAIN_RESULT " + json.dumps(asdict(res)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
