"""The plan report: a self-contained HTML page (and PNG files) showing where a step's memory goes.

``step.report(path, batch=(x, y))`` or ``edgetrain report`` writes, for a prepared step:

* the per-stage policy table (keep / recompute / page, group, saved and output bytes, times);
* the memory timeline over one step, planned (the cost model) against measured (resident memory sampled
  every 0.5 ms during a real step on ``batch``; model and optimizer restored afterwards);
* the budget-vs-step-time curve of edgetrain's exact planner against the baselines (no saving with
  accumulation, checkpoint every stage, Chen sqrt(n), ``checkpoint_sequential``), as the cost model predicts;
* where the plan pages or models energy, the energy per step over budgets, with and without paging.

matplotlib (``pip install 'edgetrain[report]'``) is imported on the first report, not with edgetrain.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

from ..units import format_bytes
from ._curves import budget_curves, energy_curves, planned_timeline
from ._figures import curves_figure, png_bytes, pyplot, timeline_figure
from ._html import figure, page, table
from .measure import MeasuredStep, measure_step

__all__ = ["write_report", "MeasuredStep", "measure_step"]

log = logging.getLogger(__name__)


def _stage_rows(step: Any) -> tuple[list[list[object]], list[str]]:
    plan, costs = step.plan, step.costs
    m = plan.micro_batch_size
    names = plan.stage_names or tuple(s.name for s in costs.stages)
    rows, classes = [], []
    for i, (s, pol, grp) in enumerate(zip(costs.stages, plan.policies, plan.groups)):
        two = " (two-level)" if pol == "recompute" and grp in plan.nested_groups else ""
        rows.append([i, names[i] if i < len(names) else s.name, pol + two, grp,
                     format_bytes(s.saved_bytes.at(m)), format_bytes(s.out_bytes.at(m)),
                     f"{s.fwd_s.at(m) * 1e3:.2f}", f"{s.bwd_s.at(m) * 1e3:.2f}"])
        classes.append(pol)
    return rows, classes


def write_report(step: Any, path: str | Path, *, batch: Any = None, device: Any = "host",
                 n_points: int = 16) -> Path:
    """Write the report of ``step`` to ``path`` (HTML) and its figures as PNG files beside it.

    Args:
        step: a :class:`~edgetrain.TrainStep`.
        path: the HTML file to write; PNGs go to ``<stem>-timeline.png``, ``<stem>-budget-time.png`` and,
            with paging or an energy figure, ``<stem>-energy.png`` in the same directory.
        batch: ``(inputs, targets)`` to measure the timeline on (one real step, everything restored); None:
            the planned timeline only.
        device: device profile for the energy figure (``"host"``, a bundled profile name or a profile).
        n_points: budgets on the curves.

    Returns:
        The HTML file's path.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # ValueError: a stub module without a spec
        found = False
    if not found:
        pyplot()  # raises the ConfigError naming the extra, before any work
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan, costs = step.plan, step.costs
    # measured before matplotlib is imported: its import (tens of MiB) is not the step's memory
    measured = measure_step(step, batch) if batch is not None else None
    figures: list[tuple[str, str, str]] = []  # (heading, html, note)

    def emit(fig: Any, suffix: str, alt: str) -> str:
        png = png_bytes(fig)
        name = f"{path.stem}-{suffix}.png"
        (path.parent / name).write_bytes(png)
        return figure(png, alt, name)

    tl = emit(timeline_figure(planned_timeline(costs, plan), measured, plan.peak_bytes, step.budget_bytes),
              "timeline", "memory timeline over one step")
    curves = budget_curves(costs, n_points=n_points)
    bt = emit(curves_figure(curves, "predicted step time (ms)", "Budget vs step time: edgetrain and the baselines",
                            1e3, (plan.budget_bytes or plan.peak_bytes, plan.step_time_s), step.budget_bytes),
              "budget-time", "budget versus step time")
    figures.append(("Memory timeline over one step", tl, ""))
    figures.append(("Budget vs step time", bt, "Each planner's fastest plan at each budget (cost model); a gap: "
                    "nothing of that planner fits."))
    if "page" in plan.policies or plan.energy_j is not None:
        from ..devices import DeviceProfile, load_profile

        dev = device if isinstance(device, DeviceProfile) else load_profile(device)
        en = energy_curves(costs, dev, n_points=max(8, n_points // 2))
        mark = (plan.budget_bytes or plan.peak_bytes, plan.energy_j) if plan.energy_j is not None else None
        figures.append(("Energy per step", emit(curves_figure(en, "predicted energy per step (J)",
                                                              f"Energy per step on {dev.name}", 1.0, mark,
                                                              step.budget_bytes), "energy", "energy per step"),
                        "POET-style planner, energy objective, with paging and with recomputation only."))
    else:
        figures.append(("Energy per step", "<p class=\"note\">Not shown: this plan neither pages nor models energy "
                        "(prepare with paging=True or objective='energy' to plan and report it).</p>", ""))

    budget = "unbounded" if step.budget_bytes is None else format_bytes(step.budget_bytes)
    kv = [["model", costs.name or "model"], ["solver", plan.solver], ["budget", budget],
          ["batch / micro-batch", f"{plan.batch_size} / {plan.micro_batch_size} ({plan.num_micro_batches} "
                                  "micro-batches)"],
          ["stages kept / recomputed / paged", f"{plan.policies.count('keep')} / {plan.policies.count('recompute')}"
                                               f" / {plan.policies.count('page')}"],
          ["predicted peak", format_bytes(plan.peak_bytes)],
          ["predicted step time", f"{plan.step_time_s * 1e3:.1f} ms"]]
    if plan.energy_j is not None:
        kv.append(["predicted energy per step", f"{plan.energy_j:.4f} J"])
    if measured is not None:
        kv.append(["measured peak (RSS above import baseline, one step)", format_bytes(measured.peak_bytes)])
        kv.append(["measured step time", f"{measured.step_time_s * 1e3:.1f} ms"])
        if step.budget_bytes is not None:
            kv.append(["measured peak within budget", "yes" if measured.peak_bytes <= step.budget_bytes else "NO"])
    rows, classes = _stage_rows(step)
    stage_table = table(["#", "stage", "policy", "group", "saved / micro-batch", "output / micro-batch",
                         "fwd ms", "bwd ms"], rows, left=2, row_classes=classes)
    curve_rows = []
    for i, b in enumerate(curves[0].budgets_bytes):
        curve_rows.append([f"{b / 2**20:.2f} MiB"] + ["-" if math.isnan(c.values[i]) else f"{c.values[i] * 1e3:.1f}"
                                               for c in curves])
    sections = [("", table(["", ""], kv, css="kv")), ("Per-stage policy", stage_table)]
    for heading, body, note in figures:
        sections.append((heading, body + (f'<p class="note">{note}</p>' if note else "")))
    sections.append(("Budget vs step time (ms), table", table(["budget"] + [c.label for c in curves], curve_rows)))
    sections.append(("", "<p class=\"note\">Notes: " + " ".join(plan.notes) + "</p>" if plan.notes else ""))
    title = f"edgetrain plan report: {costs.name or 'model'}"
    path.write_text(page(title, sections))
    log.info("plan report written to %s", path)
    return path.resolve()
