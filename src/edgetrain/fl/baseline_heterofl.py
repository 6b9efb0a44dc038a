"""The baseline the field uses for weak devices: HeteroFL width-sliced sub-models, trained with plain PyTorch.

HeteroFL (Diao et al., ICLR 2021) gives a client whose memory cannot hold the model the sub-model of width
``r``: the leading ``ceil(r * c)`` channels of every layer. It trains that with plain PyTorch and sends back
the leading blocks; the server averages each element over the clients whose block holds it, which is
:class:`edgetrain.fl.MaskedFedAvg` with block-shaped ``"trained"`` entries. A client's width is the largest
whose plain-PyTorch peak, measured in a fresh process (:func:`measure_plain_peak`), fits its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..profile import memory
from ..units import parse_bytes
from .client import BUDGET_ERROR_CODE, ClientData, _message_scope, _server_round, _settings
from .payload import TRAINED_KEY
from .settings import ClientSettings
from .task import small_cnn

__all__ = ["WIDTHS", "measure_plain_peak", "widest_fitting", "slice_state", "heterofl_client_app"]

#: the widths a client may get, widest first
WIDTHS = (1.0, 0.75, 0.5, 0.25)


def measure_plain_peak(width: float, batch_size: int, steps: int = 3, timeout_s: float = 300.0) -> int:
    """Peak resident bytes of plain PyTorch SGD steps on the small CNN at ``width``, in a fresh Python process
    (nothing else run there first), above its resident memory once torch, edgetrain and Flower are loaded:
    the zero point the federated clients measure from."""
    code = ("import sys, torch, edgetrain\n"
            "from edgetrain import memory\n"
            "from edgetrain.fl.task import small_cnn\n"
            "torch.set_num_threads(1); torch.manual_seed(0)\n"
            "memory.record_baseline()\n"
            f"m = small_cnn({width!r}); opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)\n"
            f"x = torch.randn({batch_size}, 1, 28, 28); y = torch.randint(0, 10, ({batch_size},))\n"
            "with memory.measure_peak() as p:\n"
            f"    for _ in range({steps}):\n"
            "        opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()\n"
            "print('PEAK', p.above_baseline_bytes)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("PEAK "):
            return int(line.split()[1])
    raise RuntimeError(f"plain-peak worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def widest_fitting(budget: int | str | None, batch_size: int, widths: Sequence[float] = WIDTHS,
                   peaks: dict[float, int] | None = None) -> float | None:
    """The widest of ``widths`` whose measured plain peak fits ``budget`` (None: none fits).

    ``peaks`` caches measurements (width -> bytes) across calls.
    """
    peaks = {} if peaks is None else peaks
    limit = None if budget is None else parse_bytes(budget)
    for w in sorted(widths, reverse=True):
        if limit is None:
            return w
        if w not in peaks:
            peaks[w] = measure_plain_peak(w, batch_size)
        if peaks[w] <= limit:
            return w
    return None


def slice_state(full: dict[str, torch.Tensor], sub_model: nn.Module) -> dict[str, torch.Tensor]:
    """The leading blocks of ``full`` shaped like ``sub_model``'s state (HeteroFL's sub-model extraction)."""
    out = {}
    for k, v in sub_model.state_dict().items():
        out[k] = full[k][tuple(slice(0, d) for d in v.shape)].clone()
    return out


def heterofl_client_app(data_fn: Callable[[Context, ClientSettings], ClientData],
                        width_of: Callable[[Context, ClientSettings], float | None],
                        settings: Any = ClientSettings(),
                        loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> ClientApp:
    """A ClientApp training the width-``width_of(context, settings)`` sub-model of the small CNN with plain
    PyTorch (no edgetrain), replying with full-size arrays and its blocks as the ``"trained"`` record, and
    the same metrics keys as :func:`edgetrain.fl.client_app` (plan fields 0). ``width_of`` returning None
    (no width fits the budget) replies with an error."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        s = _settings(settings, context)
        width = width_of(context, s)
        if width is None:
            return Message(Error(code=BUDGET_ERROR_CODE, reason=f"heterofl: no width fits budget {s.memory_budget}"),
                           reply_to=msg)
        data = data_fn(context, s)  # as the edgetrain client: data loading before the zero point
        with _message_scope(s.threads), memory.measure_peak() as peak:
            full = msg.content["arrays"].to_torch_state_dict()
            model = small_cnn(width)
            model.load_state_dict(slice_state(full, model))
            opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum)
            first = (_server_round(msg) - 1) * s.local_epochs
            losses, times = [], []
            for epoch in range(s.local_epochs):
                for x, y in data.train(first + epoch):
                    t = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
                    times.append(time.perf_counter() - t)
                    losses.append(float(loss.detach()))
            trained: dict[str, Any] = {}
            for k, v in model.state_dict().items():
                block = tuple(slice(0, d) for d in v.shape)
                full[k][block] = v.detach()
                trained[k] = True if tuple(v.shape) == tuple(full[k].shape) else [int(d) for d in v.shape]
            arrays = ArrayRecord(full)
        budget = 0 if s.memory_budget is None else parse_bytes(s.memory_budget)
        metrics = {
            "num-examples": data.num_train, "partition-id": int(context.node_config.get("partition-id", -1)),
            "budget-bytes": budget, "peak-bytes": peak.above_baseline_bytes,
            "within-budget": int(budget == 0 or peak.above_baseline_bytes <= budget),
            "predicted-peak-bytes": 0, "step-time-s": sum(times) / max(1, len(times)),
            "predicted-step-time-s": 0.0, "predicted-energy-j": -1.0, "measured-energy-j": -1.0,
            "train-loss": sum(losses) / max(1, len(losses)), "prepare-time-s": 0.0, "plan-cached": 0,
            "micro-batch-size": s.batch_size, "recomputed-stages": 0, "trained-tensors": len(trained),
            "width": float(width),
        }
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics),
                                   TRAINED_KEY: ConfigRecord(trained)}), reply_to=msg)

    return app


if __name__ == "__main__":  # python -m edgetrain.fl.baseline_heterofl WIDTH BATCH: print the plain peak
    print(json.dumps({"width": float(sys.argv[1]), "peak_bytes": measure_plain_peak(float(sys.argv[1]),
                                                                                      int(sys.argv[2]))}))
