"""Gradient filtering (Yang et al., CVPR'23) for a model's Conv2d layers: config, apply/undo, costs, auto.

``apply_grad_filter(model, GradFilter(radius=2, last_n=4))`` swaps the class of the chosen ``nn.Conv2d``
modules for :class:`FilteredConv2d` in place: the same ``Parameter`` objects, buffers and
``state_dict`` keys, an exact forward, and a backward on ``r x r`` patch-averaged maps that saves only
the patch means of the layer input (see :mod:`edgetrain.approx.gradfilter._impl` for the formulas).

Forward order. With an example input, layers are ordered by their first call in a forward pass (hooks,
``torch.no_grad``, running statistics and RNG restored afterwards); without one, by module
registration order (``model.named_modules()``), which matches the call order of the models in
:mod:`edgetrain.models`. "Earlier" layers, frozen when ``freeze_earlier``, are the leaf modules that
own parameters and come before the first filtered conv in that order; parameters a container owns
directly (e.g. a class token on the model itself) are left alone.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ...units import format_bytes
from ._impl import filtered_conv2d
from .trace import LayerCost, ModelTrace, layer_costs, trace_model

__all__ = [
    "GradFilter", "GradFilterReport", "LayerCost", "FilteredConv2d", "apply_grad_filter",
    "remove_grad_filter", "estimate_costs", "auto_grad_filter", "filtered_conv2d",
]

logger = logging.getLogger(__name__)

torch.fx.wrap("filtered_conv2d")  # symbolic tracing records it as one call instead of tracing into it

@dataclass(frozen=True)
class GradFilter:
    """Which convolutions to filter, and how.

    Attributes:
        radius: patch side ``r`` (>= 1; 1 is exact backprop). The backward works on maps ``r^2`` smaller.
        last_n: filter the last ``n`` trainable ``nn.Conv2d`` layers in forward order (None: all of them).
            Ignored when ``layers`` is given.
        layers: qualified module names (as in ``model.named_modules()``) to filter instead.
        freeze_earlier: set ``requires_grad=False`` on the parameters of every module before the first
            filtered conv (the paper's setting: backprop then stops at the filtered layers).

    Raises:
        ValueError: on a radius below 1, ``last_n`` below 1 or an empty or non-string ``layers``.
    """

    radius: int = 2
    last_n: int | None = 4
    layers: tuple[str, ...] | None = None
    freeze_earlier: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.radius, bool) or not isinstance(self.radius, int) or self.radius < 1:
            raise ValueError(f"GradFilter.radius must be an integer >= 1 (patch side in pixels; 2 or 4 "
                             f"are usual); got {self.radius!r}")
        if self.last_n is not None and (isinstance(self.last_n, bool) or not isinstance(self.last_n, int)
                                        or self.last_n < 1):
            raise ValueError(f"GradFilter.last_n must be None (all convs) or an integer >= 1; "
                             f"got {self.last_n!r}")
        if self.layers is not None:
            names = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
            if not names or not all(isinstance(n, str) for n in names):
                raise ValueError(f"GradFilter.layers must be None or a non-empty sequence of module "
                                 f"names; got {self.layers!r}")
            object.__setattr__(self, "layers", names)


@dataclass(frozen=True)
class GradFilterReport:
    """What :func:`apply_grad_filter` did.

    Attributes:
        layers: the filtered convs, in forward order.
        radius: the patch side used.
        frozen: names of the parameters it set to ``requires_grad=False``.
        costs: per filtered layer, estimated for the example input (empty without one).
    """

    layers: tuple[str, ...]
    radius: int
    frozen: tuple[str, ...]
    costs: tuple[LayerCost, ...] = ()

    def summary(self) -> str:
        """A plain-text table of the per-layer costs (or the layer list without costs)."""
        lines = [f"gradient filter r={self.radius} on {len(self.layers)} conv(s); "
                 f"{len(self.frozen)} parameter(s) frozen"]
        if not self.costs:
            return "\n".join(lines + [f"  {name}" for name in self.layers])
        lines.append(f"  {'layer':<32} {'saved exact':>12} {'filtered':>10} {'freed':>10} "
                     f"{'bwd GFLOP exact':>15} {'filtered':>9} {'ratio':>6}")
        for c in self.costs:
            lines.append(f"  {c.name:<32} {format_bytes(c.saved_bytes_exact):>12} "
                         f"{format_bytes(c.saved_bytes_filtered):>10} {format_bytes(c.freed_bytes):>10} "
                         f"{c.backward_flops_exact / 1e9:>15.3f} {c.backward_flops_filtered / 1e9:>9.3f} "
                         f"{c.flops_ratio:>5.1f}x")
        return "\n".join(lines)


class _FilteredConvMixin:
    """Replaces ``nn.Conv2d._conv_forward`` (what ``Conv2d.forward`` calls) by the filtered conv."""

    grad_filter_radius: int = 2

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":  # same explicit padding as nn.Conv2d
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return filtered_conv2d(input, weight, bias, self.stride, padding, self.dilation, self.groups,
                               self.grad_filter_radius)


class FilteredConv2d(_FilteredConvMixin, nn.Conv2d):
    """An ``nn.Conv2d`` whose backward is gradient-filtered; installed by :func:`apply_grad_filter`."""

    _edgetrain_base = nn.Conv2d


_SUBCLASSES: dict[type, type] = {nn.Conv2d: FilteredConv2d}


def _filtered_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        if cls.forward is not nn.Conv2d.forward or cls._conv_forward is not nn.Conv2d._conv_forward:
            raise ValueError(f"cannot filter a {cls.__name__}: it overrides forward/_conv_forward; "
                             f"filter plain nn.Conv2d modules or call filtered_conv2d yourself")
        _SUBCLASSES[cls] = type(f"GradFiltered{cls.__name__}", (_FilteredConvMixin, cls),
                                {"_edgetrain_base": cls, "__module__": __name__})
    return _SUBCLASSES[cls]


@dataclass
class _Applied:
    convs: list[nn.Module]
    frozen: list[nn.Parameter]


_APPLIED: "weakref.WeakKeyDictionary[nn.Module, _Applied]" = weakref.WeakKeyDictionary()


def _conv_order(model: nn.Module, trace: ModelTrace | None) -> list[str]:
    if trace is not None:
        return [name for name in trace.order if isinstance(model.get_submodule(name), nn.Conv2d)]
    return [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def _select(model: nn.Module, config: GradFilter, trace: ModelTrace | None) -> list[str]:
    """The conv names ``config`` picks, in forward order."""
    modules = dict(model.named_modules())
    order = _conv_order(model, trace)
    if config.layers is not None:
        for name in config.layers:
            if name not in modules:
                raise ValueError(f"GradFilter.layers names {name!r}, which is not a module of this "
                                 f"model; see [n for n, _ in model.named_modules()]")
            if not isinstance(modules[name], nn.Conv2d):
                raise ValueError(f"GradFilter.layers names {name!r}, a {type(modules[name]).__name__}; "
                                 f"only nn.Conv2d layers can be filtered")
        wanted = set(config.layers)
        missing = wanted - set(order)
        return [n for n in order if n in wanted] + [n for n in config.layers if n in missing]
    trainable = [n for n in order if modules[n].weight.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable nn.Conv2d (weight.requires_grad); unfreeze the "
                         "layers to fine-tune or name them with GradFilter(layers=...)")
    return trainable if config.last_n is None else trainable[-config.last_n:]


def _earlier_parameters(model: nn.Module, first: str, trace: ModelTrace | None,
                        ) -> list[tuple[str, nn.Parameter]]:
    """Parameters of the modules ordered before ``first`` (by call, or by registration)."""
    if trace is not None:
        order = trace.order
    else:
        order = [n for n, m in model.named_modules() if next(m.parameters(False), None) is not None]
    if first not in order:
        return []
    out = []
    for name in order[:order.index(first)]:
        module = model.get_submodule(name)
        if next(module.children(), None) is not None:
            continue  # a container's own parameters (e.g. a class token) have no place in the order
        for pname, p in module.named_parameters(recurse=False):
            out.append((f"{name}.{pname}" if name else pname, p))
    return out


def estimate_costs(model: nn.Module, example_input: torch.Tensor, config: GradFilter,
                   ) -> tuple[LayerCost, ...]:
    """Saved-activation bytes and backward FLOPs, exact vs filtered, of each layer ``config`` picks.

    Runs the model on ``example_input`` (running statistics and RNG state are restored) with the
    parameters ``config`` would freeze temporarily frozen, and records what autograd saves. A conv's
    input that another operation also saves (a ReLU's output, say) has ``input_freed=False``:
    filtering cannot free it, and its ``freed_bytes`` is negative (the pooled copy is extra). BatchNorm
    and activation tensors are not changed by filtering and are not in these per-layer numbers.
    FLOPs count the gradient multiply-adds of the formulas (coarse convolutions with ``K'^2`` taps)
    plus one add per pooled or unpooled element.

    Args:
        model: the model, not yet filtered.
        example_input: one input batch; costs scale with its size.
        config: which layers and radius.

    Returns:
        One :class:`LayerCost` per filtered layer, in forward order.

    Raises:
        ValueError: as :func:`apply_grad_filter` for bad names.
        CaptureError: when the model does not run on ``example_input``.
    """
    return _estimate(model, example_input, config)[0]


def _estimate(model: nn.Module, example_input: torch.Tensor, config: GradFilter,
              ) -> tuple[tuple[LayerCost, ...], ModelTrace]:
    order_trace = trace_model(model, example_input)
    chosen = _select(model, config, order_trace)
    frozen = _earlier_parameters(model, chosen[0], order_trace) if config.freeze_earlier else []
    flags = [(p, p.requires_grad) for _, p in frozen]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        trace = trace_model(model, example_input, record_saved=True)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return layer_costs(trace, chosen, config.radius), order_trace


def apply_grad_filter(model: nn.Module, config: GradFilter | None = None,
                      example_input: torch.Tensor | None = None) -> GradFilterReport:
    """Filter the chosen convolutions of ``model`` in place (and freeze earlier layers if asked).

    Parameters, buffers and ``state_dict`` keys are unchanged: each chosen ``nn.Conv2d`` keeps its
    ``Parameter`` objects and only its class becomes :class:`FilteredConv2d`. A model that is already
    filtered is first restored (:func:`remove_grad_filter`).

    Args:
        model: the model to change.
        config: which layers and radius (``GradFilter()`` when None).
        example_input: one input batch; when given, the forward order comes from running it and the
            report carries :func:`estimate_costs` for it.

    Returns:
        What was filtered and frozen, with costs when ``example_input`` is given.

    Raises:
        ValueError: on unknown or non-Conv2d names in ``config.layers``, no trainable conv, or a
            Conv2d subclass with its own forward.
    """
    config = GradFilter() if config is None else config
    if model in _APPLIED:
        remove_grad_filter(model)
    costs: tuple[LayerCost, ...] = ()
    trace = None
    if example_input is not None:
        costs, trace = _estimate(model, example_input, config)
    chosen = _select(model, config, trace)
    convs = [model.get_submodule(name) for name in chosen]
    classes = [_filtered_class(type(m)) for m in convs]  # raises before anything changes
    frozen: list[tuple[str, nn.Parameter]] = []
    if config.freeze_earlier:
        frozen = [(n, p) for n, p in _earlier_parameters(model, chosen[0], trace) if p.requires_grad]
        for _, p in frozen:
            p.requires_grad_(False)
    for module, cls in zip(convs, classes):
        module.__class__ = cls
        module.grad_filter_radius = config.radius
    _APPLIED[model] = _Applied(convs, [p for _, p in frozen])
    logger.info("gradient filter r=%d on %s; froze %d parameters", config.radius, ", ".join(chosen),
                len(frozen))
    return GradFilterReport(tuple(chosen), config.radius, tuple(n for n, _ in frozen), costs)


def remove_grad_filter(model: nn.Module) -> tuple[str, ...]:
    """Undo :func:`apply_grad_filter`: restore the conv classes and unfreeze what it froze.

    Filtered convs found without a record (e.g. in a deep copy) are restored too, but the parameters
    frozen on the original are not known there and stay frozen.

    Args:
        model: a model (filtered or not).

    Returns:
        Names of the convs restored (empty when nothing was filtered).
    """
    record = _APPLIED.pop(model, None)
    restored = []
    for name, module in model.named_modules():
        if isinstance(module, _FilteredConvMixin):
            module.__class__ = type(module)._edgetrain_base
            module.__dict__.pop("grad_filter_radius", None)
            restored.append(name)
    if record is not None:
        for p in record.frozen:
            p.requires_grad_(True)
    return tuple(restored)


def auto_grad_filter(model: nn.Module, example_input: torch.Tensor,
                     target_speedup: float | None = None,
                     target_saved_bytes: int | str | None = None, timing: str = "measured") -> GradFilter:
    """Choose the convs and radius that meet a target (see :func:`plan_grad_filter` for the rule).

    Args:
        model: the model (not filtered).
        example_input: one input batch of the size you train with.
        target_speedup: wanted backward speed-up (> 1), or None.
        target_saved_bytes: wanted upper bound on saved-activation bytes (int or "300MiB"), or None.
        timing: ``"measured"`` (time the backward on this machine, the default) or ``"flops"``.

    Returns:
        The chosen :class:`GradFilter` (``freeze_earlier=False``).

    Raises:
        ValueError: when neither target is given, ``target_speedup`` is not above 1 or ``timing`` is
            unknown.
        BudgetError: when no choice meets a target (the message gives the best reachable values).
    """
    from .auto import plan_grad_filter  # it builds on this module

    return plan_grad_filter(model, example_input, target_speedup, target_saved_bytes, timing).config
