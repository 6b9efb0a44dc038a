"""Measured per-tensor step-time costs for ElasticTrainer: forward, weight-gradient, input-gradient seconds.

How :func:`measure_timing` measures, on this machine and the real batch shape:

1. **Capture.** One real forward with hooks on every module that owns trainable parameters records
   the execution order and a copy of each such layer's real inputs. Tensors are ordered by their
   layer's first call (forward order), then by the module's own parameter order (weight, bias).
2. **Per layer, in isolation** (median over ``repeats`` after a warm-up): the layer's forward; for each
   of its tensors, ``torch.autograd.grad(outputs, [tensor])`` (the weight gradient alone); and
   ``torch.autograd.grad(outputs, inputs)`` with the parameters frozen (the input gradient alone).
3. **Whole model** (what the isolated numbers miss: parameter-free ops such as activations, pooling,
   residual adds and attention matmuls, plus autograd overhead): forward + loss; full backward; and the
   backward of a frozen model cut at the output of selected layers (``max_cuts`` of them, always the
   first and last), which is exactly the input-gradient time from the loss down to that layer.
   Between cut points the cumulative input-gradient time is interpolated in proportion to the isolated
   per-layer input-gradient times. Weight-gradient times are scaled by one factor so that they add up
   to (full backward) - (backward cut at the first layer). The optimizer update is timed with all
   gradients and with the smaller half of the tensors and fitted as ``a + b * numel`` seconds per tensor.
4. **Fallback.** A layer that cannot be re-run in isolation (it raises on its captured inputs, e.g. it
   keeps state between calls) gets FLOPs-based estimates: forward and input gradient ``2 * MACs``
   (Linear/Conv) or ``2 * output elements`` (others), weight gradient ``2 * MACs`` for a Linear/Conv
   weight else output elements, converted to seconds with the median seconds-per-FLOP of the layers
   that were timed (1e-10 s/FLOP when none was). Its name is listed in ``TensorTiming.fallback_layers``.

Results are cached per model structure + batch shapes + thread count, in memory and optionally in a
JSON file. A module called several times per forward is timed on its first call and its costs are
multiplied by its call count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import InputError, ProfileError
from .elastic_state import TrainingSnapshot

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


# ----------------------------------------------------------------------------------------- batches
def _tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_tree_map(fn, v) for v in x)
    if isinstance(x, Mapping):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return x


def _leaves(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _tree_map(lambda t: out.append(t), x)
    return out


def _model_output(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_loss(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
    """Loss of ``batch = (inputs, target)``: ``loss_fn(model(inputs), target)``.

    ``inputs`` is a tensor, a tuple/list (passed positionally) or a dict (passed as keywords).

    Raises:
        InputError: the batch is not an ``(inputs, target)`` pair.
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise InputError("a batch must be an (inputs, target) pair; wrap other layouts in a small "
                         "nn.Module and a loss_fn(output, target)")
    return loss_fn(_model_output(model, batch[0]), batch[1])


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor in the batch (dimension 0)."""
    return _tree_map(lambda t: t[:n] if t.dim() > 0 else t, batch)


def batch_size(batch: Any) -> int:
    """Number of samples: dimension 0 of the first tensor in the batch."""
    leaves = [t for t in _leaves(batch) if t.dim() > 0]
    if not leaves:
        raise InputError("the batch holds no tensor with a batch dimension")
    return int(leaves[0].shape[0])


# --------------------------------------------------------------------------------------- measuring
def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class _Layer:
    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    args: Any = None
    kwargs: Any = None
    calls: int = 0
    order: int = -1
    tensor_out: bool = False
    out_numel: int = 0


def _capture(model: nn.Module, batch: Any, loss_fn: Callable) -> list[_Layer]:
    """Layers owning trainable tensors, in first-call order, with a copy of their real inputs."""
    seen: set[int] = set()
    layers: list[_Layer] = []
    for mname, mod in model.named_modules():
        own = []
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            layers.append(_Layer(mname, mod, own))
    counter = [0]

    def make_hook(layer: _Layer) -> Callable:
        def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            layer.calls += 1
            if layer.calls == 1:
                layer.order, counter[0] = counter[0], counter[0] + 1
                layer.args = _tree_map(lambda t: t.detach().clone(), args)
                layer.kwargs = _tree_map(lambda t: t.detach().clone(), kwargs)
                layer.tensor_out = isinstance(out, torch.Tensor) and out.is_floating_point()
                layer.out_numel = sum(t.numel() for t in _leaves(out))
        return hook

    handles = [ly.module.register_forward_hook(make_hook(ly), with_kwargs=True) for ly in layers]
    try:
        batch_loss(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
    return sorted((ly for ly in layers if ly.calls > 0), key=lambda ly: ly.order)


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _leaves(out) if t.is_floating_point() and t.requires_grad]


def _time_layer(layer: _Layer, repeats: int) -> tuple[float, list[float], float]:
    """Isolated (forward_s, weight_grad_s per tensor, input_grad_s) of one layer's first call."""
    m, params = layer.module, [p for _, p in layer.params]
    flags = [p.requires_grad for p in params]
    gen = torch.Generator().manual_seed(0)

    def grads_like(outs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]

    try:
        with torch.enable_grad():
            fwd = _median_s(lambda: m(*layer.args, **layer.kwargs), repeats)
            dws = []
            for p in params:
                for q in params:
                    q.requires_grad_(q is p)
                outs = _float_outputs(m(*layer.args, **layer.kwargs))
                g = grads_like(outs)
                dws.append(_median_s(lambda: torch.autograd.grad(
                    outs, [p], g, retain_graph=True, allow_unused=True), repeats) if outs else 0.0)
            for q in params:
                q.requires_grad_(False)
            args = _tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point()),
                             (layer.args, layer.kwargs))
            xs = [t for t in _leaves(args) if t.requires_grad]
            outs = _float_outputs(m(*args[0], **args[1])) if xs else []
            g = grads_like(outs)
            dy = _median_s(lambda: torch.autograd.grad(
                outs, xs, g, retain_graph=True, allow_unused=True), repeats) if outs else 0.0
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return fwd, dws, dy


def _flops(layer: _Layer) -> tuple[float, list[float], float]:
    """FLOPs-based (forward, weight-grad per tensor, input-grad) estimates of one layer."""
    m, out = layer.module, max(layer.out_numel, 1)
    if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
        per_out = m.weight[0].numel()            # MACs per output element (in/groups x kernel)
        macs = out * per_out
        return 2.0 * macs, [2.0 * macs if p is m.weight else float(out) for _, p in layer.params], 2.0 * macs
    return 2.0 * out, [float(out) for _ in layer.params], 2.0 * out


def _loss_backward_s(model: nn.Module, batch: Any, loss_fn: Callable, repeats: int,
                     cut: _Layer | None = None) -> tuple[float, float]:
    """Median (forward+loss seconds, backward seconds); with ``cut``, the graph is cut at that layer's
    output (frozen model) and the backward is timed down to the cut only."""
    fwd_t, bwd_t = [], []
    leaf: list[torch.Tensor] = []

    def cut_hook(mod: nn.Module, args: Any, out: Any) -> Any:
        x = out.detach().requires_grad_()
        leaf.append(x)
        return x.clone()   # a non-leaf, so in-place ops downstream (ReLU(inplace=True)) stay legal

    handle = cut.module.register_forward_hook(cut_hook) if cut is not None else None
    try:
        for i in range(max(1, repeats) + 1):
            for p in model.parameters():
                p.grad = None
            leaf.clear()
            t0 = time.perf_counter()
            loss = batch_loss(model, batch, loss_fn)
            t1 = time.perf_counter()
            if cut is None:
                loss.backward()
            elif loss.requires_grad:
                torch.autograd.grad(loss, leaf, allow_unused=True)
            t2 = time.perf_counter()
            if i > 0:   # the first run warms up
                fwd_t.append(t1 - t0)
                bwd_t.append(t2 - t1)
    finally:
        if handle is not None:
            handle.remove()
    return statistics.median(fwd_t), statistics.median(bwd_t)


def _update_fit(model: nn.Module, optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter],
                batch: Any, loss_fn: Callable, repeats: int) -> tuple[float, float, float]:
    """(seconds per tensor, seconds per element, full update seconds) of ``optimizer.step()``."""
    if optimizer is None:
        return 0.0, 0.0, 0.0
    batch_loss(model, batch, loss_fn).backward()
    grads = [p.grad for p in params]
    small = set(sorted(range(len(params)), key=lambda i: params[i].numel())[: len(params) // 2])

    def step(subset: set[int] | None) -> None:
        for i, p in enumerate(params):
            p.grad = grads[i] if (subset is None or i in subset) and grads[i] is not None else None
        optimizer.step()

    full_s = _median_s(lambda: step(None), repeats)
    n_all, e_all = len(params), sum(p.numel() for p in params)
    if not small:
        return 0.0, full_s / max(e_all, 1), full_s
    sub_s = _median_s(lambda: step(small), repeats)
    n_sub, e_sub = len(small), sum(params[i].numel() for i in small)
    det = n_all * e_sub - n_sub * e_all
    a = (full_s * e_sub - sub_s * e_all) / det if det else -1.0
    b = (n_all * sub_s - n_sub * full_s) / det if det else -1.0
    if a < 0 or b < 0:
        a, b = 0.0, full_s / max(e_all, 1)
    return a, b, full_s


def _pick_cuts(layers: list[_Layer], max_cuts: int) -> list[int]:
    ok = [i for i, ly in enumerate(layers) if ly.tensor_out]
    if len(ok) <= max_cuts:
        return ok
    picks = {ok[0], ok[-1]}
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


def _cache_key(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None) -> str:
    parts = [type(model).__qualname__, repr(model), type(optimizer).__qualname__,
             str(torch.get_num_threads())]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in model.named_parameters()]
    parts += [f"{tuple(t.shape)}:{t.dtype}:{t.device}" for t in _leaves(batch)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]


def measure_timing(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer: torch.optim.Optimizer | None = None, *, repeats: int = 5,
                   cut_repeats: int = 3, max_cuts: int = 24, cache_path: str | os.PathLike | None = None,
                   use_cache: bool = True) -> TensorTiming:
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
        timing = _measure(model, batch, loss_fn, optimizer, repeats, cut_repeats, max_cuts)
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
             repeats: int, cut_repeats: int, max_cuts: int) -> TensorTiming:
    layers = _capture(model, batch, loss_fn)
    if not layers:
        raise ProfileError("the model has no trainable parameter used by its forward pass; nothing to "
                           "select (check requires_grad and that the example batch reaches the layers)")
    iso: list[tuple[float, list[float], float] | None] = []
    for ly in layers:
        try:
            fwd, dws, dy = _time_layer(ly, repeats)
            iso.append((fwd * ly.calls, [w * ly.calls for w in dws], dy * ly.calls))
        except Exception as exc:  # noqa: BLE001 - any failure to re-run a layer means "estimate it"
            logger.info("layer %s cannot be timed in isolation (%s); using its FLOPs estimate", ly.name, exc)
            iso.append(None)
    timed = [(t[0], _flops(ly)[0]) for t, ly in zip(iso, layers) if t is not None]
    s_per_flop = (statistics.median(s / f for s, f in timed if f > 0) if any(f > 0 for _, f in timed)
                  else _DEFAULT_S_PER_FLOP)
    fallback = []
    for i, ly in enumerate(layers):
        if iso[i] is None:
            f, ws, y = _flops(ly)
            iso[i] = (f * s_per_flop * ly.calls, [w * s_per_flop * ly.calls for w in ws], y * s_per_flop * ly.calls)
            fallback.append(ly.name)
    params = [p for ly in layers for _, p in ly.params]
    with torch.enable_grad():
        fwd_total, bwd_full = _loss_backward_s(model, batch, loss_fn, cut_repeats)
        for p in params:
            p.requires_grad_(False)
        cuts = _pick_cuts(layers, max_cuts)
        cut_runs = {i: _loss_backward_s(model, batch, loss_fn, cut_repeats, layers[i]) for i in cuts}
        for p in params:
            p.requires_grad_(True)
        per_tensor_s, per_elem_s, update_full = _update_fit(model, optimizer, params, batch, loss_fn, repeats)
    base_fwd, base_bwd = cut_runs[cuts[-1]] if cuts else (fwd_total, 0.0)
    dy_cum = _cumulative([t[2] for t in iso], {i: r[1] for i, r in cut_runs.items()}, base_bwd)
    fwd_cum = _cumulative([t[0] for t in iso], {i: r[0] for i, r in cut_runs.items()}, base_fwd)
    dw_iso_total = sum(w for t in iso for w in t[1])
    dw_real = bwd_full - (cut_runs[cuts[0]][1] if cuts else 0.0)
    scale = dw_real / dw_iso_total if dw_iso_total > 0 and dw_real > 0 else 1.0
    if not 0.2 <= scale <= 5.0:
        logger.warning("weight-gradient calibration factor %.3g is implausible (noisy machine?); clamping",
                       scale)
        scale = min(max(scale, 0.2), 5.0)
    fwd_scale = fwd_total / max(sum(t[0] for t in iso), 1e-12)
    out: dict[str, list] = {k: [] for k in ("names", "layers", "numels", "forward_s", "weight_grad_s",
                                            "update_s", "input_grad_s", "input_grad_cum_s",
                                            "forward_graph_cum_s")}
    for i, (ly, (fwd, dws, dy)) in enumerate(zip(layers, iso)):
        through = (dy_cum[i - 1] - dy_cum[i]) if i > 0 else dy * scale
        for j, ((name, p), dw) in enumerate(zip(ly.params, dws)):
            out["names"].append(name)
            out["layers"].append(ly.name)
            out["numels"].append(p.numel())
            out["forward_s"].append(fwd * fwd_scale if j == 0 else 0.0)
            out["weight_grad_s"].append(dw * scale)
            out["update_s"].append(per_tensor_s + per_elem_s * p.numel() if optimizer is not None else 0.0)
            out["input_grad_s"].append(max(0.0, through) if j == 0 else 0.0)
            out["input_grad_cum_s"].append(dy_cum[i])
            out["forward_graph_cum_s"].append(fwd_cum[i])
    logger.info("timed %d tensors in %d layers: forward %.4g s (frozen %.4g s), full backward %.4g s, "
                "update %.4g s, weight-grad scale %.3g, %d FLOPs fallbacks", len(out["names"]), len(layers),
                fwd_total, base_fwd, bwd_full, update_full, scale, len(fallback))
    return TensorTiming(**out, forward_total_s=fwd_total, forward_base_s=base_fwd, backward_base_s=base_bwd,
                        backward_full_s=bwd_full, update_full_s=update_full, fallback_layers=fallback)
