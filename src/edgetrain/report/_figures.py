"""The report's figures, drawn with matplotlib (an optional extra, imported only here, on first use)."""

from __future__ import annotations

import io
import math
from typing import Any, Sequence

from ..errors import ConfigError
from ._curves import Curve

__all__ = ["pyplot", "timeline_figure", "curves_figure", "png_bytes"]

_MIB = 2**20


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("the plan report's figures need matplotlib: pip install 'edgetrain[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def timeline_figure(planned: tuple[Sequence[float], Sequence[int]], measured: Any, peak_bytes: int,
                    budget_bytes: int | None) -> Any:
    """Planned against measured resident memory over one step."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    pt, pm = planned
    label = "planned (cost model: fixed bytes + live activations)"
    if measured is not None and measured.step_time_s > 0 and pt and pt[-1] > 0:
        # the profile's times come from another moment (and load) of the machine: the planned sequence
        # is drawn over the measured step's duration, so the two shapes line up
        factor = measured.step_time_s / pt[-1]
        pt = [t * factor for t in pt]
        label += f", times x{factor:.2f} to the measured step"
    ax.plot([t * 1e3 for t in pt], [m / _MIB for m in pm], drawstyle="steps-post", color="tab:blue", label=label)
    if measured is not None and measured.times_s:
        ax.plot([t * 1e3 for t in measured.times_s], [m / _MIB for m in measured.rss_bytes], color="tab:orange",
                lw=1.2, label=f"measured RSS above import baseline ({len(measured.times_s)} samples)")
    ax.axhline(peak_bytes / _MIB, color="tab:blue", ls="--", lw=0.8, label="predicted peak")
    top = max([peak_bytes, *pm, *(measured.rss_bytes if measured is not None else ())])
    title = "Memory over one step: planned vs measured"
    if budget_bytes is not None and budget_bytes <= 2 * top:
        ax.axhline(budget_bytes / _MIB, color="tab:red", lw=1.2, label="budget")
    elif budget_bytes is not None:  # far above: drawing it would flatten the curves
        title += f" (budget {budget_bytes / _MIB:.0f} MiB, off the chart)"
    ax.set_xlabel("time within one training step (ms)")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def curves_figure(curves: Sequence[Curve], ylabel: str, title: str, scale: float, mark: tuple[int, float] | None,
                  budget_bytes: int | None) -> Any:
    """One line per planner over budgets (gaps where nothing fits); ``mark``: the plan in force."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    styles = ["-o", "--s", "-.^", ":v", "--d"]
    for c, style in zip(curves, styles):
        ys = [v * scale if not math.isnan(v) else float("nan") for v in c.values]
        ax.plot([b / _MIB for b in c.budgets_bytes], ys, style, ms=3.5, lw=2.4 if "edgetrain" in c.label else 1.1,
                label=c.label, alpha=1.0 if "edgetrain" in c.label else 0.8)
    right = max(b for c in curves for b in c.budgets_bytes) if curves else 0
    if mark is not None and mark[0] > 1.5 * right:
        mark = None
        title += " (plan in force: budget beyond the chart, plans there as at its right end)"
    if mark is not None:
        ax.plot([mark[0] / _MIB], [mark[1] * scale], "*", color="black", ms=12, label="plan in force")
    if budget_bytes is not None and budget_bytes <= 1.5 * right:
        ax.axvline(budget_bytes / _MIB, color="tab:red", lw=1, label="budget")
    ax.set_xlabel("memory budget (MiB)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig
