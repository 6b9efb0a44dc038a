"""Shared helpers for the bench scripts: tables printed as aligned text and as markdown, number formats,
machine description and progress lines.

Nothing here imports torch at module level, so the table code can be tested without running a job.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Progress", "Table", "machine_info", "mib", "rate", "ratio", "render", "secs"]

MIB = 2**20


def mib(n_bytes: float | None, digits: int = 1) -> str:
    """Bytes as a MiB number without unit (``"-"`` for None)."""
    return "-" if n_bytes is None else f"{n_bytes / MIB:.{digits}f}"


def ratio(x: float | None, digits: int = 2) -> str:
    """A ratio such as ``1.23x`` (``"-"`` for None)."""
    return "-" if x is None else f"{x:.{digits}f}x"


def secs(s: float | None, digits: int = 2) -> str:
    """Seconds without unit (``"-"`` for None or 0)."""
    return "-" if not s else f"{s:.{digits}f}"


def rate(x: float | None, digits: int = 1) -> str:
    """A throughput in samples/s without unit (``"-"`` for None or 0)."""
    return "-" if not x else f"{x:.{digits}f}"


@dataclass
class Table:
    """A titled table of string cells, rendered as aligned plain text or as GitHub markdown.

    Attributes:
        title: printed above the table.
        headers: column names.
        rows: one list of cells per row (converted with ``str``; missing cells are blank).
        notes: lines printed under the table.
        left: indices of left-aligned columns (the others are right-aligned); default: the first.
    """

    title: str
    headers: Sequence[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    left: tuple[int, ...] = (0,)

    def add(self, *cells: Any) -> None:
        """Append a row (cells beyond the header count are an error)."""
        if len(cells) > len(self.headers):
            raise ValueError(f"row has {len(cells)} cells, table {self.title!r} has {len(self.headers)} columns")
        self.rows.append([str(c) for c in cells] + [""] * (len(self.headers) - len(cells)))

    def _widths(self) -> list[int]:
        return [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.headers)]

    def _cell(self, text: str, i: int, width: int) -> str:
        return text.ljust(width) if i in self.left else text.rjust(width)

    def to_text(self) -> str:
        """Aligned plain text: title, header, a rule, the rows, then the notes."""
        w = self._widths()
        line = lambda cells: "  ".join(self._cell(c, i, w[i]) for i, c in enumerate(cells)).rstrip()  # noqa: E731
        out = [self.title, line(self.headers), "  ".join("-" * x for x in w)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def to_markdown(self) -> str:
        """A GitHub markdown table under a bold title, notes as a list below it."""
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        rule = ["---" if i in self.left else "---:" for i in range(len(self.headers))]
        out = [f"**{self.title}**", "", "| " + " | ".join(esc(h) for h in self.headers) + " |",
               "|" + "|".join(rule) + "|"]
        out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in self.rows]
        if self.notes:
            out += [""] + [f"- {esc(n)}" for n in self.notes]
        return "\n".join(out)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the benches train it (``name`` from ``edgetrain.models.MODEL_NAMES``)."""

    name: str
    kwargs: dict[str, Any]
    input_shape: tuple[int, ...]
    batch_size: int
    batchnorm: bool = False  # trains BatchNorm layers (micro-batching then changes their statistics)


#: job environments: plain PyTorch as users run it (glibc's allocator), edgetrain without its profile cache
SYSTEM_ALLOC = {"EDGETRAIN_ALLOCATOR": "system"}
NO_CACHE = {"EDGETRAIN_NO_CACHE": "1"}

MNV2_KW = {"num_classes": 10, "in_channels": 3}
RN18_KW = {"num_classes": 10, "in_channels": 3, "small_input": True}
TF_KW = {"num_classes": 10, "input_dim": 28}
#: The three models of the issues at the sizes every full bench run uses.
FULL_MODELS = {"mobilenet_v2": ModelSpec("mobilenet_v2", MNV2_KW, (3, 64, 64), 32, batchnorm=True),
               "resnet18": ModelSpec("resnet18", RN18_KW, (3, 32, 32), 32, batchnorm=True),
               "transformer": ModelSpec("transformer", TF_KW, (28, 28), 64)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine_info() -> dict[str, str]:
    """nproc, CPU model, memory, OS, Python and torch versions, and the current load average."""
    info = {"nproc": str(os.cpu_count()), "cpu": _cpu_model(), "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", "loadavg (1/5/15 min)": _loadavg()}
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        info["memory"] = f"{kib / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        info["torch"] = f"{torch.__version__} ({torch.get_num_threads()} intra-op threads by default)"
    except ImportError:  # pragma: no cover - the bench needs torch anyway
        info["torch"] = "not installed"
    return info


class Progress:
    """Progress lines on stdout, prefixed with the time since the run started."""

    def __init__(self, quiet: bool = False) -> None:
        self.start = time.perf_counter()
        self.quiet = quiet

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            m, s = divmod(int(self.elapsed_s()), 60)
            print(f"[{m:3d}:{s:02d}] {msg}", flush=True)


def render(title: str, meta: Sequence[tuple[str, str]], sections: Sequence[tuple[str, Sequence[Table | str]]],
           markdown: bool) -> str:
    """A whole report: a title, ``key: value`` lines, then sections of tables and free text paragraphs."""
    if markdown:
        out = [f"# {title}", ""] + [f"- **{k}**: {v}" for k, v in meta]
    else:
        out = [title, "=" * len(title)] + [f"{k}: {v}" for k, v in meta]
    for heading, items in sections:
        out += ["", f"## {heading}" if markdown else f"{heading}\n{'-' * len(heading)}"]
        for item in items:
            if isinstance(item, Table):
                out += ["", item.to_markdown() if markdown else item.to_text()]
            else:
                out += ["", str(item)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit("helpers for the bench scripts; run bench/bench_budget.py")
