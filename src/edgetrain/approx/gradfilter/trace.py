"""Run a model once and record, per Conv2d, what gradient filtering changes: shapes, saves, FLOPs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import CaptureError
from ._impl import coarse_geometry, saved_numel

__all__ = [
    "LayerCost", "ModelTrace", "ConvCall", "trace_model", "layer_costs", "conv2d_backward_flops",
    "pooled_shape",
]


def pooled_shape(shape: tuple[int, ...] | torch.Size, radius: int) -> tuple[int, ...]:
    """Shape of the patch-averaged map of ``[N, C, H, W]``: ``[N, C, ceil(H/r), ceil(W/r)]``."""
    n, c, h, w = shape
    return (n, c, -(-h // radius), -(-w // radius))


def conv2d_backward_flops(x_shape: tuple[int, ...], w_shape: tuple[int, ...], y_shape: tuple[int, ...],
                          stride: tuple[int, int], padding: tuple[int, int],
                          dilation: tuple[int, int], radius: int | None, need_x: bool = True,
                          need_w: bool = True, need_b: bool = False) -> int:
    """Floating-point operations of one Conv2d backward (a multiply-add counts 2).

    Args:
        x_shape: input ``[N, C, H, W]``.
        w_shape: weight ``[O, C / groups, kH, kW]``.
        y_shape: output ``[N, O, H_o, W_o]``.
        stride: the conv's stride pair.
        padding: the conv's (top, left) padding pair.
        dilation: the conv's dilation pair.
        radius: None for exact backprop; else the filter's patch side.
        need_x: the input gradient is computed.
        need_w: the weight gradient is computed.
        need_b: the bias gradient is computed (``N * O * H_o * W_o`` additions either way).

    Returns:
        The count. Filtered: both gradients on the coarse grid, plus pooling ``dL/dy`` (one add per
        element) and scaling ``dx`` (one per pooled element). Each gradient takes the cheaper of two
        equal formulas: the coarse convolution with ``K'h K'w`` taps, or (when the kernel has fewer
        taps, e.g. a 1x1 stride-2 conv) one product per kernel tap on the ``A``-weighted input sums
        ``sum_m A[p, m] X[s I + m]``, whose gathering adds are counted too; the tiny count-matrix
        contractions that fold ``K'`` taps back to ``k`` are ignored.
    """
    n, o, ho, wo = y_shape
    per_position = 2 * n * o * w_shape[1]
    flops = n * o * ho * wo if need_b else 0
    if radius is None:
        return flops + (int(need_x) + int(need_w)) * per_position * w_shape[2] * w_shape[3] * ho * wo
    ah, aw = coarse_geometry(tuple(x_shape), tuple(w_shape), tuple(y_shape), stride, padding,
                             dilation, radius)
    n_out_c = ah.n_out_c * aw.n_out_c
    taps = w_shape[2] * w_shape[3]
    if taps < ah.k_c * aw.k_c:  # per kernel tap, on gathered sums (nonzeros of the first A table)
        nnz = (sum(sum(1 for a in row if a) for row in ah.tables[0])
               * sum(sum(1 for a in row if a) for row in aw.tables[0]))
        coarse = per_position * taps * n_out_c + 2 * n * x_shape[1] * nnz * n_out_c
    else:
        coarse = per_position * ah.k_c * aw.k_c * n_out_c
    flops += (int(need_x) + int(need_w)) * coarse
    if need_x or need_w:
        flops += n * o * ho * wo if radius > 1 else 0
    if need_x and radius > 1:
        flops += n * x_shape[1] * ah.n_in_c * aw.n_in_c
    return flops


@dataclass(frozen=True)
class LayerCost:
    """Estimated costs of one conv for one step on the example input, exact vs filtered.

    Attributes:
        name: qualified module name.
        input_shape: shape of the conv input (after any explicit padding op of the module).
        output_shape: shape of the conv output.
        needs_input_grad: whether backward computes the input gradient (False for the first trained
            conv when everything before it is frozen).
        saved_bytes_exact: bytes of the input storage exact backprop keeps for this conv.
        saved_bytes_filtered: bytes the filtered conv keeps of its input, pooled (``T X`` for 1x1 convs on
            small maps; 0 if its weight is frozen: then it needs only the weight).
        input_freed: whether filtering frees the input storage (False when another operation, e.g. the
            ReLU that produced it, saves the same storage, or an earlier filtered conv got the credit).
        backward_flops_exact: FLOPs of the exact conv backward (a multiply-add counts 2).
        backward_flops_filtered: FLOPs of the filtered conv backward, pooling included.
    """

    name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    needs_input_grad: bool
    saved_bytes_exact: int
    saved_bytes_filtered: int
    input_freed: bool
    backward_flops_exact: int
    backward_flops_filtered: int

    @property
    def freed_bytes(self) -> int:
        """Net change of saved-activation bytes when this conv is filtered (negative: more)."""
        return (self.saved_bytes_exact if self.input_freed else 0) - self.saved_bytes_filtered

    @property
    def flops_ratio(self) -> float:
        """Exact over filtered backward FLOPs."""
        return self.backward_flops_exact / max(self.backward_flops_filtered, 1)

    @property
    def saved_ratio(self) -> float:
        """Filtered over exact saved bytes of this conv's own input (0.25 at r=2 on even maps)."""
        return self.saved_bytes_filtered / max(self.saved_bytes_exact, 1)


@dataclass
class ConvCall:
    """One conv's first call: geometry as the filtered conv will see it, and what it needs."""

    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    need_x: bool
    need_w: bool
    need_b: bool
    input_key: int
    itemsize: int


@dataclass
class ModelTrace:
    """What one forward pass showed.

    Attributes:
        order: names of the modules that own parameters (and of every Conv2d), by first call.
        convs: per Conv2d name, its first call.
        savers: storage key -> names of the modules (innermost running) that saved it for backward.
        storage_bytes: storage key -> bytes, for every saved non-parameter storage.
        backward_flops: exact backward FLOPs of every Conv2d and Linear call (0 without saves).
    """

    order: list[str] = field(default_factory=list)
    convs: dict[str, ConvCall] = field(default_factory=dict)
    savers: dict[int, set[str]] = field(default_factory=dict)
    storage_bytes: dict[int, int] = field(default_factory=dict)
    backward_flops: int = 0

    @property
    def saved_bytes(self) -> int:
        """Saved-activation bytes of one step: unique storages, parameters excluded."""
        return sum(self.storage_bytes.values())


def _numeric_padding(module: nn.Conv2d, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(input shape, padding) as :func:`filtered_conv2d` will see them for this module."""
    if module.padding_mode != "zeros":  # the module pads explicitly, then convolves with padding 0
        ph, pw = module.padding
        return (shape[0], shape[1], shape[2] + 2 * ph, shape[3] + 2 * pw), (0, 0)
    if module.padding == "valid":
        return shape, (0, 0)
    if module.padding == "same":
        totals = [module.dilation[j] * (module.kernel_size[j] - 1) for j in (0, 1)]
        if any(t % 2 for t in totals):  # asymmetric: filtered_conv2d pads explicitly
            return (shape[0], shape[1], shape[2] + totals[0], shape[3] + totals[1]), (0, 0)
        return shape, (totals[0] // 2, totals[1] // 2)
    return shape, tuple(module.padding)  # type: ignore[return-value]


@contextlib.contextmanager
def _side_effects_undone(model: nn.Module, device: torch.device):
    """Restore buffers (BatchNorm running statistics) and the RNG after a probing forward."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def trace_model(model: nn.Module, example_input: torch.Tensor, record_saved: bool = False) -> ModelTrace:
    """Run ``model(example_input)`` once with hooks; restore every side effect.

    Args:
        model: any module taking one tensor.
        example_input: the batch to run.
        record_saved: run with autograd on and record the tensors saved for backward (and the
            requires-grad flags behind FLOPs); False runs under ``torch.no_grad`` for order and shapes.

    Returns:
        The trace.

    Raises:
        CaptureError: when the forward pass fails.
    """
    trace = ModelTrace()
    names = {m: n for n, m in model.named_modules()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    pending: dict[str, tuple] = {}

    def pre_hook(module: nn.Module, args: tuple) -> None:
        name = names[module]
        stack.append(name)
        owns = next(module.parameters(recurse=False), None) is not None
        if (owns or isinstance(module, nn.Conv2d)) and name not in trace.order:
            trace.order.append(name)
        if isinstance(module, (nn.Conv2d, nn.Linear)) and args and isinstance(args[0], torch.Tensor):
            pending[name] = (tuple(args[0].shape), args[0].requires_grad,
                             args[0].untyped_storage().data_ptr(), args[0].element_size())

    def post_hook(module: nn.Module, args: tuple, output: object) -> None:
        name = stack.pop()
        if name not in pending or not isinstance(output, torch.Tensor):
            return
        shape, need_x, key, itemsize = pending.pop(name)
        need_w = module.weight.requires_grad and torch.is_grad_enabled()
        need_b = module.bias is not None and module.bias.requires_grad and torch.is_grad_enabled()
        if isinstance(module, nn.Linear):
            rows = output.numel() // module.out_features
            trace.backward_flops += 2 * rows * module.in_features * module.out_features * (
                int(need_x) + int(need_w)) + (rows * module.out_features if need_b else 0)
            return
        in_shape, padding = _numeric_padding(module, shape)
        call = ConvCall(in_shape, tuple(output.shape), tuple(module.weight.shape), tuple(module.stride),
                        padding, tuple(module.dilation), need_x, need_w, need_b, key, itemsize)
        trace.backward_flops += conv2d_backward_flops(
            call.input_shape, call.weight_shape, call.output_shape, call.stride, call.padding,
            call.dilation, None, need_x, need_w, need_b)
        trace.convs.setdefault(name, call)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params:
            trace.savers.setdefault(key, set()).add(stack[-1] if stack else "")
            trace.storage_bytes[key] = t.untyped_storage().nbytes()
        return t

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre_hook),
                                                     m.register_forward_hook(post_hook))]
    grad = torch.enable_grad() if record_saved else torch.no_grad()
    saving = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record_saved
              else contextlib.nullcontext())
    try:
        with _side_effects_undone(model, example_input.device), grad, saving:
            model(example_input)
    except Exception as exc:
        raise CaptureError(f"running the model on the example input failed ({exc}); pass an input "
                           f"the model accepts") from exc
    finally:
        for h in handles:
            h.remove()
    return trace


def layer_costs(trace: ModelTrace, chosen: list[str], radius: int) -> tuple[LayerCost, ...]:
    """Per-layer costs of filtering ``chosen`` (in forward order) at ``radius``, from one trace.

    Raises:
        ValueError: when a chosen conv was not called in the traced forward pass.
    """
    chosen_set = set(chosen)
    credited: set[int] = set()
    costs = []
    for name in chosen:
        call = trace.convs.get(name)
        if call is None:
            raise ValueError(f"conv {name!r} is not called when the model runs on the example input; "
                             f"filter convs the forward pass uses")
        numel = 1
        for d in call.input_shape:
            numel *= d
        exact_bytes = trace.storage_bytes.get(call.input_key, numel * call.itemsize)
        pooled = saved_numel(tuple(call.input_shape), tuple(call.weight_shape), tuple(call.output_shape),
                             call.stride, call.padding, call.dilation,
                             call.input_shape[1] // call.weight_shape[1], radius)
        # freed only if every module saving the storage is a chosen conv (and once per storage)
        savers = trace.savers.get(call.input_key, {name})
        freed = savers <= chosen_set and call.input_key not in credited
        credited.add(call.input_key)
        flops = [conv2d_backward_flops(call.input_shape, call.weight_shape, call.output_shape,
                                       call.stride, call.padding, call.dilation, r, call.need_x,
                                       call.need_w, call.need_b) for r in (None, radius)]
        costs.append(LayerCost(name, call.input_shape, call.output_shape, call.need_x, exact_bytes,
                               pooled * call.itemsize if call.need_w else 0, freed, flops[0], flops[1]))
    return tuple(costs)
