"""Measured per-tensor step-time costs for ElasticTrainer: forward, weight-gradient, input-gradient seconds.

How :func:`measure_timing` measures, on this machine and the real batch shape (raw samples come from
:mod:`.measure`, taken round-robin with medians over ``repeats`` rounds after a warm-up):

1. **Capture.** One real forward with hooks on every module that owns trainable parameters records
   the execution order and a copy of each such layer's real inputs. Tensors are ordered by their
   layer's first call (forward order), then by the module's own parameter order (weight, bias).
2. **Per layer, in isolation**: the layer's forward; for each of its tensors,
   ``torch.autograd.grad(outputs, [tensor])`` (the weight gradient alone); and
   ``torch.autograd.grad(outputs, inputs)`` with the parameters frozen (the input gradient alone).
3. **Whole model** (what isolated numbers miss: parameter-free ops such as activations, pooling,
   residual adds and attention matmuls, autograd overhead, and the cheaper forward of a frozen prefix
   that records no graph): forward + loss and backward of full fine-tuning; and forward + backward of
   the frozen model cut at the output of up to ``max_cuts`` layers (always the first and the last),
   whose backward is exactly the input-gradient time from the loss down to that layer and whose
   forward is that of a model trained from that layer up. Between cuts both are interpolated in
   proportion to the isolated per-layer times. **Weight gradients** are measured the same way: right
   after each cut's run, the same model trains the static suffix from that layer up; the difference of
   the two backwards in the same round is the suffix's weight-gradient time. Differences between
   consecutive cuts give each segment's time, split among its layers in proportion to their isolated
   weight-gradient times. Isolated times thus set proportions only, never totals: they are taken in an
   earlier phase, and on a shared machine the load can change between phases by a factor of 2-7 (issue
   20: one global factor fitted isolated to whole-model times came out at 0.146 and was clamped, and
   2x delivered 3.06x). The optimizer update is timed with all gradients and with the smaller half of
   the tensors, fitted as ``a + b * numel`` per tensor.
4. **Fallback.** A layer that cannot be re-run in isolation (it raises on its captured inputs) gets
   FLOPs estimates (:func:`.measure.layer_flops`) converted to seconds with the median
   seconds-per-FLOP of the layers that were timed (1e-10 s/FLOP when none was); it is listed in
   ``TensorTiming.fallback_layers``. The whole-model measurements still apply to it.

Results are cached per model structure + batch shapes + optimizer type + thread count, in memory and
optionally in a JSON file. A module called several times per forward is timed on its first call and
its costs are multiplied by its call count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ...errors import ProfileError
from .measure import (Layer, batch_loss, batch_size, capture_layers, layer_flops, leaves,
                              slice_batch, time_layers, time_model, time_updates)
from .state import TrainingSnapshot

__all__ = ["TensorTiming", "measure_timing", "batch_loss", "slice_batch", "batch_size"]

logger = logging.getLogger(__name__)
_MEMORY_CACHE: dict[str, "TensorTiming"] = {}
_DEFAULT_S_PER_FLOP = 1e-10


@dataclass
class TensorTiming:
    """Seconds per step attributed to each trainable tensor, in forward order (index 0 = input-most).

    Training a set ``S`` whose deepest member is ``d`` is predicted to take
    ``fixed_s + depth_s[d] + sum(train_s[k] for k in S)`` seconds per step.

    Attributes:
        names: parameter names.
        layers: name of the module owning each tensor.
        numels: element counts.
        forward_s: forward seconds of the tensor's layer (carried by the layer's first tensor, else 0).
        weight_grad_s: weight-gradient seconds (calibrated to the whole model).
        update_s: optimizer-update seconds.
        input_grad_s: input-gradient seconds through the tensor's layer and the parameter-free ops
            just above it (carried by the layer's first tensor, else 0).
        input_grad_cum_s: input-gradient seconds from the loss down to the output of the tensor's layer
            (the deepest tensor's own input gradient is never needed, so never charged).
        forward_graph_cum_s: extra forward seconds of recording the autograd graph from the tensor's
            layer up (a frozen prefix runs faster: it records nothing and saves no activations).
        forward_total_s: forward + loss of full fine-tuning (graph everywhere).
        forward_base_s: forward + loss when only the last layer's output needs a gradient.
        backward_base_s: backward of the loss down to the last layer's output.
        backward_full_s: backward of full fine-tuning.
        update_full_s: optimizer update of all tensors (0 without an optimizer).
        fallback_layers: layers whose isolated costs are FLOPs estimates.
        key: the cache key.
    """

    names: list[str]
    layers: list[str]
    numels: list[int]
    forward_s: list[float]
    weight_grad_s: list[float]
    update_s: list[float]
    input_grad_s: list[float]
    input_grad_cum_s: list[float]
    forward_graph_cum_s: list[float]
    forward_total_s: float
    forward_base_s: float
    backward_base_s: float
    backward_full_s: float
    update_full_s: float
    fallback_layers: list[str] = field(default_factory=list)
    key: str = ""

    @property
    def fixed_s(self) -> float:
        """Seconds paid whatever is trained: frozen forward, loss and the loss's backward."""
        return self.forward_base_s + self.backward_base_s

    @property
    def full_step_s(self) -> float:
        """Step time of full fine-tuning: forward + full backward + update of every tensor."""
        return self.forward_total_s + self.backward_full_s + self.update_full_s

    @property
    def train_s(self) -> list[float]:
        """Weight-gradient plus update seconds of each tensor (its cost when not the deepest)."""
        return [w + u for w, u in zip(self.weight_grad_s, self.update_s)]

    @property
    def depth_s(self) -> list[float]:
        """What making each tensor the deepest trained one costs: graph recording and input gradients
        from the output down to its layer."""
        return [f + y for f, y in zip(self.forward_graph_cum_s, self.input_grad_cum_s)]

    def step_time_s(self, indices: list[int] | tuple[int, ...]) -> float:
        """Predicted step time of training exactly the tensors ``indices``."""
        if not indices:
            return self.forward_base_s
        train = self.train_s
        return self.fixed_s + self.depth_s[min(indices)] + sum(train[k] for k in indices)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "TensorTiming":
        return TensorTiming(**json.loads(text))


def _pick_cuts(layers: list[Layer], max_cuts: int) -> list[int]:
    ok = [i for i, ly in enumerate(layers) if ly.tensor_out]
    if len(ok) <= max_cuts:
        return ok
    picks = {ok[0], ok[-1]}
    if max_cuts > 2:
        picks.update(ok[round(j * (len(ok) - 1) / (max_cuts - 1))] for j in range(max_cuts))
    return sorted(picks)


def _cumulative(iso: list[float], cut_s: dict[int, float], base_s: float) -> list[float]:
    """Seconds spent above each layer's output: measured at the cut layers (minus ``base_s``),
    interpolated between cuts in proportion to the isolated per-layer seconds ``iso``."""
    m = len(iso)
    above = [0.0] * m                      # isolated seconds of the layers after i
    for i in range(m - 2, -1, -1):
        above[i] = above[i + 1] + iso[i + 1]
    if not cut_s:                          # no layer output can be cut: isolated times only
        return above
    pts = {i: max(0.0, s - base_s) for i, s in cut_s.items()}
    idx = sorted(pts)
    for j in range(len(idx) - 2, -1, -1):  # deeper cuts cost at least as much (noise)
        pts[idx[j]] = max(pts[idx[j]], pts[idx[j + 1]])
    cum = [0.0] * m
    for i in range(m):
        lo = max([j for j in idx if j <= i], default=None)
        hi = min([j for j in idx if j >= i], default=None)
        if lo is None:                     # deeper than every cut: scale by the deepest cut's ratio
            r = pts[hi] / above[hi] if above[hi] > 0 else 1.0
            cum[i] = pts[hi] + r * (above[i] - above[hi])
        elif hi is None or lo == hi:
            cum[i] = pts[lo] if hi is not None else 0.0
        else:
            span = above[lo] - above[hi]
            f = (above[i] - above[hi]) / span if span > 0 else (hi - i) / (hi - lo)
            cum[i] = pts[hi] + f * (pts[lo] - pts[hi])
    return cum


def _suffix_weight_grads(iso_dw: list[float], suffix_dw: dict[int, float]) -> list[float]:
    """Weight-gradient seconds of each layer, from the measured weight-gradient seconds of static suffixes.

    ``suffix_dw[i]`` is what training every tensor from layer ``i`` up adds to the frozen model's
    backward cut at ``i`` (measured on the whole model); ``iso_dw`` the layers' isolated weight-gradient
    seconds, which only split a measured difference among the layers between two cuts (and extrapolate
    below the deepest cut). Isolated times set proportions, never the total: timed in another phase than
    the whole-model runs, their scale follows the machine's load then, not the model.
    """
    m = len(iso_dw)
    # inclusive sums (layer i and up) are _cumulative's "above" over a list shifted by one; layer m
    # (past the end) trains nothing
    cum = _cumulative([0.0] + [max(0.0, w) for w in iso_dw], {**suffix_dw, m: 0.0}, 0.0)
    return [max(0.0, cum[i] - cum[i + 1]) for i in range(m)]


def _cache_key(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None) -> str:
    parts = [type(model).__qualname__, repr(model), str(model.training), type(optimizer).__qualname__,
             str(torch.get_num_threads())]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in model.named_parameters()]
    parts += [f"{tuple(t.shape)}:{t.dtype}:{t.device}" for t in leaves(batch)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]


def measure_timing(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer: torch.optim.Optimizer | None = None, *, repeats: int = 5,
                   cut_repeats: int = 3, max_cuts: int = 24, max_suffixes: int = 8,
                   cache_path: str | os.PathLike | None = None, use_cache: bool = True) -> TensorTiming:
    """Measure (or fetch from cache) the per-tensor costs of one training step on this machine.

    The model's parameters, buffers, gradients, flags, optimizer state and RNG are restored afterwards.

    Args:
        model: the model, in the mode it trains in.
        batch: a real training batch ``(inputs, target)`` of the size used in training.
        loss_fn: ``loss_fn(model_output, target) -> scalar``.
        optimizer: the optimizer, to time its update per tensor (None: updates cost 0).
        repeats: timed repetitions per isolated layer measurement (medians).
        cut_repeats: timed repetitions per whole-model measurement.
        max_cuts: how many layers to cut the frozen model at (more: better interpolation, slower).
        max_suffixes: at how many of the cuts (spread evenly, always the first and the last) the static
            suffix from that layer up is trained, to measure weight-gradient times (more: slower).
        cache_path: optional JSON file holding measured timings by key (read and updated).
        use_cache: look up and store results in the caches.

    Returns:
        The :class:`TensorTiming`.

    Raises:
        ProfileError: the model has no trainable tensor used by its forward, or measuring failed.
    """
    key = _cache_key(model, batch, optimizer)
    if use_cache and key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    if use_cache and cache_path is not None and os.path.exists(cache_path):
        with open(cache_path) as f:
            stored = json.load(f)
        if key in stored:
            _MEMORY_CACHE[key] = TensorTiming(**stored[key])
            return _MEMORY_CACHE[key]
    with TrainingSnapshot(model, optimizer):
        try:
            timing = _measure(model, batch, loss_fn, optimizer, repeats, cut_repeats, max_cuts, max_suffixes)
        except ProfileError:
            raise
        except Exception as exc:
            raise ProfileError(f"timing the model's training step failed ({type(exc).__name__}: {exc}); "
                               "check that loss_fn(model(inputs), target) runs and backpropagates on the "
                               "example batch") from exc
    timing.key = key
    if use_cache:
        _MEMORY_CACHE[key] = timing
        if cache_path is not None:
            stored = {}
            if os.path.exists(cache_path):
                with open(cache_path) as f:
                    stored = json.load(f)
            stored[key] = asdict(timing)
            tmp = f"{cache_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(stored, f)
            os.replace(tmp, cache_path)
    return timing


def _measure(model: nn.Module, batch: Any, loss_fn: Callable, optimizer: torch.optim.Optimizer | None,
             repeats: int, cut_repeats: int, max_cuts: int, max_suffixes: int) -> TensorTiming:
    layers = capture_layers(model, batch, loss_fn)
    if not layers:
        raise ProfileError("the model has no trainable parameter used by its forward pass; nothing to "
                           "select (check requires_grad and that the example batch reaches the layers)")
    iso = time_layers(layers, repeats)
    timed = [(t[0], layer_flops(ly)[0] * ly.calls) for t, ly in zip(iso, layers) if t is not None]
    ratios = [s / f for s, f in timed if f > 0]
    s_per_flop = statistics.median(ratios) if ratios else _DEFAULT_S_PER_FLOP
    fallback = []
    for i, ly in enumerate(layers):
        if iso[i] is None:
            k = s_per_flop * ly.calls
            fl, wl, yl = layer_flops(ly)
            iso[i] = (fl * k, [w * k for w in wl], yl * k)
            fallback.append(ly.name)
    params = [p for ly in layers for _, p in ly.params]
    cuts = _pick_cuts(layers, max_cuts)
    first_param = {id(p): k for k, p in enumerate(params)}
    timed = set(_pick_cuts([layers[i] for i in cuts], max_suffixes)) if cuts else set()
    suffixes = [params[first_param[id(layers[i].params[0][1])]:] if j in timed else None
                for j, i in enumerate(cuts)]
    runs = time_model(model, batch, loss_fn, params, [layers[i] for i in cuts], cut_repeats, suffixes)
    fwd_total, bwd_full = runs.full
    # physical invariants that single noisy samples may break: a model trained from some layer up
    # runs its forward no slower than full fine-tuning does, and backpropagates no more
    cut_runs = {i: (min(f, fwd_total), min(b, bwd_full)) for i, (f, b) in zip(cuts, runs.cuts)}
    per_tensor_s, per_elem_s, update_full = time_updates(model, optimizer, params, batch, loss_fn, repeats)
    base_fwd, base_bwd = cut_runs[cuts[-1]] if cuts else (fwd_total, 0.0)
    dy_cum = _cumulative([t[2] for t in iso], {i: r[1] for i, r in cut_runs.items()}, base_bwd)
    fwd_cum = _cumulative([t[0] for t in iso], {i: r[0] for i, r in cut_runs.items()}, base_fwd)
    if cuts:
        layer_dw = _suffix_weight_grads([sum(t[1]) for t in iso],
                                        {i: w for i, w in zip(cuts, runs.suffix_dw) if w is not None})
        scale = sum(layer_dw) / max(sum(w for t in iso for w in t[1]), 1e-12)
    else:   # no layer output can be cut: one factor fits the isolated times to the whole backward
        layer_dw = None
        dw_iso_total = sum(w for t in iso for w in t[1])
        scale = bwd_full / dw_iso_total if dw_iso_total > 0 and bwd_full > 0 else 1.0
    fwd_scale = fwd_total / max(sum(t[0] for t in iso), 1e-12)
    out: dict[str, list] = {k: [] for k in ("names", "layers", "numels", "forward_s", "weight_grad_s",
                                            "update_s", "input_grad_s", "input_grad_cum_s",
                                            "forward_graph_cum_s")}
    for i, (ly, (fwd, dws, dy)) in enumerate(zip(layers, iso)):
        through = (dy_cum[i - 1] - dy_cum[i]) if i > 0 else dy * scale
        own = sum(dws)
        for j, ((name, p), dw) in enumerate(zip(ly.params, dws)):
            if layer_dw is None:
                dw *= scale
            else:   # the layer's measured share, split among its tensors as the isolated times split it
                dw = layer_dw[i] * (dw / own if own > 0 else 1.0 / len(dws))
            out["names"].append(name)
            out["layers"].append(ly.name)
            out["numels"].append(p.numel())
            out["forward_s"].append(fwd * fwd_scale if j == 0 else 0.0)
            out["weight_grad_s"].append(dw)
            out["update_s"].append(per_tensor_s + per_elem_s * p.numel() if optimizer is not None else 0.0)
            out["input_grad_s"].append(max(0.0, through) if j == 0 else 0.0)
            out["input_grad_cum_s"].append(dy_cum[i])
            out["forward_graph_cum_s"].append(fwd_cum[i])
    logger.info("timed %d tensors in %d layers: forward %.4g s (frozen %.4g s), full backward %.4g s, "
                "update %.4g s, weight-grad scale %.3g, %d FLOPs fallbacks", len(out["names"]), len(layers),
                fwd_total, base_fwd, bwd_full, update_full, scale, len(fallback))
    return TensorTiming(**out, forward_total_s=fwd_total, forward_base_s=base_fwd, backward_base_s=base_bwd,
                        backward_full_s=bwd_full, update_full_s=update_full, fallback_layers=fallback)
