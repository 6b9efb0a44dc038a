"""Raw timing samples for ElasticTrainer: layer capture, isolated per-layer gradients, whole-model cuts.

Everything here measures; :mod:`.timing` turns the medians into per-tensor costs. All
measurements are taken *round-robin*: each round takes one sample of every quantity, and medians are
taken over rounds, so a load burst on a shared machine hits all quantities alike instead of inflating
one of them. The first round only warms up and is discarded.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ...batch import call_model
from ...errors import InputError

__all__ = ["batch_loss", "slice_batch", "batch_size", "Layer", "capture_layers", "time_layers",
           "layer_flops", "ModelRuns", "time_model", "time_updates", "measure_speedup"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


# ----------------------------------------------------------------------------------------- batches
def _tree_map(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_tree_map(fn, v) for v in x)
    if isinstance(x, Mapping):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return x


def leaves(x: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    out: list[torch.Tensor] = []
    _tree_map(out.append, x)
    return out


def batch_loss(model: nn.Module, batch: Any, loss_fn: LossFn) -> torch.Tensor:
    """Loss of ``batch = (inputs, target)``: ``loss_fn(model(inputs), target)``.

    ``inputs`` is a tensor, a tuple/list (passed positionally) or a dict (passed as keywords).

    Raises:
        InputError: the batch is not an ``(inputs, target)`` pair.
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise InputError("a batch must be an (inputs, target) pair; wrap other layouts in a small "
                         "nn.Module and a loss_fn(output, target)")
    return loss_fn(call_model(model, batch[0]), batch[1])


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor in the batch (dimension 0)."""
    return _tree_map(lambda t: t[:n] if t.dim() > 0 else t, batch)


def batch_size(batch: Any) -> int:
    """Number of samples: dimension 0 of the first tensor in the batch.

    Raises:
        InputError: the batch holds no tensor with a batch dimension.
    """
    sized = [t for t in leaves(batch) if t.dim() > 0]
    if not sized:
        raise InputError("the batch holds no tensor with a batch dimension")
    return int(sized[0].shape[0])


# ----------------------------------------------------------------------------------------- capture
@dataclass
class Layer:
    """A module owning trainable tensors, with a copy of the inputs of its first call."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    args: Any = None
    kwargs: Any = None
    calls: int = 0
    order: int = -1
    tensor_out: bool = False
    out_numel: int = 0


def capture_layers(model: nn.Module, batch: Any, loss_fn: LossFn) -> list[Layer]:
    """Layers owning trainable tensors, in first-call (forward) order, from one real forward."""
    seen: set[int] = set()
    layers: list[Layer] = []
    for mname, mod in model.named_modules():
        own = []
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            layers.append(Layer(mname, mod, own))
    counter = [0]

    def make_hook(layer: Layer) -> Callable:
        def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            layer.calls += 1
            if layer.calls == 1:
                layer.order, counter[0] = counter[0], counter[0] + 1
                layer.args = _tree_map(lambda t: t.detach().clone(), args)
                layer.kwargs = _tree_map(lambda t: t.detach().clone(), kwargs)
                layer.tensor_out = isinstance(out, torch.Tensor) and out.is_floating_point()
                layer.out_numel = sum(t.numel() for t in leaves(out))
        return hook

    handles = [ly.module.register_forward_hook(make_hook(ly), with_kwargs=True) for ly in layers]
    try:
        batch_loss(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
    return sorted((ly for ly in layers if ly.calls > 0), key=lambda ly: ly.order)


# --------------------------------------------------------------------------------- isolated layers
def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in leaves(out) if t.is_floating_point() and t.requires_grad]


def _layer_sample(layer: Layer, gen: torch.Generator) -> tuple[float, list[float], float]:
    """One sample of (forward s, weight-grad s per tensor, input-grad s) of a layer's first call."""
    m, params = layer.module, [p for _, p in layer.params]
    flags = [p.requires_grad for p in params]

    def grad_s(outs: list[torch.Tensor], wrt: list[torch.Tensor]) -> float:
        if not outs or not wrt:
            return 0.0
        g = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
        return _timed(lambda: torch.autograd.grad(outs, wrt, g, allow_unused=True))

    try:
        with torch.enable_grad():
            fwd = _timed(lambda: m(*layer.args, **layer.kwargs))
            dws = []
            for p in params:
                for q in params:
                    q.requires_grad_(q is p)
                dws.append(grad_s(_float_outputs(m(*layer.args, **layer.kwargs)), [p]))
            for q in params:
                q.requires_grad_(False)
            args = _tree_map(lambda t: t.detach().clone().requires_grad_(t.is_floating_point()),
                             (layer.args, layer.kwargs))
            xs = [t for t in leaves(args) if t.requires_grad]
            dy = grad_s(_float_outputs(m(*args[0], **args[1])), xs) if xs else 0.0
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return fwd, dws, dy


def time_layers(layers: list[Layer], repeats: int) -> list[tuple[float, list[float], float] | None]:
    """Median isolated (forward, weight-grad per tensor, input-grad) seconds of each layer, times its
    call count; None for a layer that raised when re-run on its captured inputs."""
    gen = torch.Generator().manual_seed(0)
    samples: list[list[tuple[float, list[float], float]]] = [[] for _ in layers]
    failed: set[int] = set()
    for r in range(max(1, repeats) + 1):
        for i, ly in enumerate(layers):
            if i in failed:
                continue
            try:
                s = _layer_sample(ly, gen)
            except Exception as exc:  # noqa: BLE001 - any failure to re-run a layer means "estimate it"
                logger.info("layer %s cannot be timed in isolation (%s); using its FLOPs estimate",
                            ly.name, exc)
                failed.add(i)
                continue
            if r > 0:
                samples[i].append(s)
    out: list[tuple[float, list[float], float] | None] = []
    for i, ly in enumerate(layers):
        if i in failed:
            out.append(None)
            continue
        ss, c = samples[i], ly.calls
        out.append((c * statistics.median(s[0] for s in ss),
                    [c * statistics.median(s[1][j] for s in ss) for j in range(len(ly.params))],
                    c * statistics.median(s[2] for s in ss)))
    return out


def layer_flops(layer: Layer) -> tuple[float, list[float], float]:
    """FLOPs estimates (forward, weight-grad per tensor, input-grad) of one call of a layer:
    ``2 * MACs`` for a Linear/Conv forward, input gradient and weight gradient; the output's element
    count for other gradients and ``2 *`` that for other forwards."""
    m, out = layer.module, max(layer.out_numel, 1)
    if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
        macs = out * m.weight[0].numel()          # MACs per output element: in/groups x kernel
        return 2.0 * macs, [2.0 * macs if p is m.weight else float(out) for _, p in layer.params], 2.0 * macs
    return 2.0 * out, [float(out) for _ in layer.params], 2.0 * out


# ------------------------------------------------------------------------------------- whole model
def _run(model: nn.Module, batch: Any, loss_fn: LossFn, cut: Layer | None) -> tuple[float, float]:
    """(forward+loss s, backward s) of one step; with ``cut`` the graph starts at that layer's output."""
    leaf: list[torch.Tensor] = []

    def cut_hook(mod: nn.Module, args: Any, out: Any) -> Any:
        x = out.detach().requires_grad_()
        leaf.append(x)
        return x.clone()   # a non-leaf, so in-place ops downstream (ReLU(inplace=True)) stay legal

    handle = cut.module.register_forward_hook(cut_hook) if cut is not None else None
    try:
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        loss = batch_loss(model, batch, loss_fn)
        t1 = time.perf_counter()
        if cut is None:
            loss.backward()
        elif loss.requires_grad:
            torch.autograd.grad(loss, leaf, allow_unused=True)
        return t1 - t0, time.perf_counter() - t1
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class ModelRuns:
    """Medians of whole-model runs (seconds), all taken round-robin in the same rounds.

    Attributes:
        full: (forward+loss, backward) of full fine-tuning.
        cuts: per cut layer, (forward+loss, backward) of the frozen model cut at that layer's output.
        suffix_dw: per cut layer, the backward of training every tensor from that layer up (a static
            suffix) minus the same round's frozen cut backward at that layer: the weight-gradient seconds
            of the suffix, measured on the real model and batch (None where that suffix was not timed).
    """

    full: tuple[float, float]
    cuts: list[tuple[float, float]]
    suffix_dw: list[float | None] | None = None


def time_model(model: nn.Module, batch: Any, loss_fn: LossFn, params: list[nn.Parameter],
               cuts: list[Layer], repeats: int,
               suffixes: list[list[nn.Parameter] | None] | None = None) -> ModelRuns:
    """Median whole-model seconds of full fine-tuning, of the frozen model cut at each of ``cuts``
    (backward from the loss down to that layer's output only) and, with ``suffixes`` (one parameter list
    per cut: the tensors from that cut's layer up, or None to skip it), of training each suffix.

    Each suffix run follows its cut's run directly, and the per-round difference of their backwards is
    what is kept, so a load change on a shared machine between rounds or phases cancels out of it.
    """
    full: list[tuple[float, float]] = []
    cut_runs: list[list[tuple[float, float]]] = [[] for _ in cuts]
    dw_runs: list[list[float]] = [[] for _ in cuts]
    with torch.enable_grad():
        for r in range(max(1, repeats) + 1):
            for p in params:
                p.requires_grad_(True)
            s = _run(model, batch, loss_fn, None)
            if r > 0:
                full.append(s)
            for i, ly in enumerate(cuts):
                for p in params:
                    p.requires_grad_(False)
                s = _run(model, batch, loss_fn, ly)
                if r > 0:
                    cut_runs[i].append(s)
                if suffixes is None or suffixes[i] is None:
                    continue
                for p in suffixes[i]:
                    p.requires_grad_(True)
                t = _run(model, batch, loss_fn, None)
                if r > 0:
                    dw_runs[i].append(t[1] - s[1])
        for p in params:
            p.requires_grad_(True)

    def med(ss: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(s[0] for s in ss), statistics.median(s[1] for s in ss)

    return ModelRuns(med(full), [med(c) for c in cut_runs],
                     None if suffixes is None else [statistics.median(d) if d else None for d in dw_runs])


def time_updates(model: nn.Module, optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter],
                 batch: Any, loss_fn: LossFn, repeats: int) -> tuple[float, float, float]:
    """Fit ``optimizer.step()`` as ``a + b * numel`` seconds per tensor, from steps with every gradient
    and with the smaller half of the tensors only. Returns ``(a, b, all-tensors seconds)``."""
    if optimizer is None:
        return 0.0, 0.0, 0.0
    with torch.enable_grad():
        batch_loss(model, batch, loss_fn).backward()
    grads = [p.grad for p in params]
    small = set(sorted(range(len(params)), key=lambda i: params[i].numel())[: len(params) // 2])

    def step(subset: set[int] | None) -> float:
        for i, p in enumerate(params):
            p.grad = grads[i] if (subset is None or i in subset) else None
        return _timed(optimizer.step)

    all_s, sub_s = [], []
    for r in range(max(1, repeats) + 1):
        a, b = step(None), step(small) if small else 0.0
        if r > 0:
            all_s.append(a)
            sub_s.append(b)
    full_s, part_s = statistics.median(all_s), statistics.median(sub_s)
    n_all, e_all = len(params), sum(p.numel() for p in params)
    n_sub, e_sub = len(small), sum(params[i].numel() for i in small)
    det = n_all * e_sub - n_sub * e_all
    per_tensor = (full_s * e_sub - part_s * e_all) / det if det else -1.0
    per_elem = (n_all * part_s - n_sub * full_s) / det if det else -1.0
    if per_tensor < 0 or per_elem < 0:
        per_tensor, per_elem = 0.0, full_s / max(e_all, 1)
    return per_tensor, per_elem, full_s


def measure_speedup(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any, loss_fn: LossFn,
                    params: list[nn.Parameter], chosen: set[int], pairs: int) -> tuple[float, list[float]]:
    """Median over ``pairs`` back-to-back rounds of (full step s) / (step s training ``params[chosen]``).

    A step is what training runs: ``zero_grad``, forward, loss, backward and ``optimizer.step()``.
    Back-to-back pairs make the ratio robust to load drift on a shared machine. The caller restores
    the training state (the steps change parameters, buffers and optimizer state).

    Returns:
        ``(median ratio, the full steps' seconds)``; the latter is the real full fine-tuning step time
        that closed-loop control (:mod:`.feedback`) compares training steps with.
    """
    def step(sel: set[int] | None) -> float:
        for i, p in enumerate(params):
            p.requires_grad_(sel is None or i in sel)
            p.grad = None
        t0 = time.perf_counter()
        with torch.enable_grad():
            batch_loss(model, batch, loss_fn).backward()
        if optimizer is not None:
            optimizer.step()
        return time.perf_counter() - t0

    step(None), step(chosen)             # warm-up: allocator, optimizer state of every tensor
    ratios, fulls = [], []
    for _ in range(max(1, pairs)):
        full = step(None)
        fulls.append(full)
        ratios.append(full / max(step(chosen), 1e-12))
    return statistics.median(ratios), fulls
