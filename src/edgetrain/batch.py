"""Batches as edgetrain sees them: a tensor, or a tuple/dict of tensors, batched on dim 0."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from .errors import InputError

__all__ = ["batch_size_of", "slice_batch", "batch_signature", "signature_misfit", "describe_signature",
           "larger_per_sample", "tensors_in", "clone_tensors", "call_model", "split_batch", "channels_last_images",
           "has_images", "is_channels_last", "channels_last_copy_bytes"]


def call_model(model: Any, inputs: Any) -> Any:
    """``model`` called on a batch's inputs as a step calls it: a dict as keyword arguments, a tuple or list
    as positional arguments, anything else as the one argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def split_batch(batch: Any, what: str = "a training batch") -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch: a pair; a mapping with keys ``inputs`` and ``targets``; or a mapping
    with ``labels`` (a Hugging Face collator's batch, a ``BatchEncoding`` included), whose other entries are
    the model's keyword arguments and whose labels are the targets (for the loss, never handed to the model).
    """
    if isinstance(batch, Mapping):
        if "inputs" in batch and "targets" in batch:
            return batch["inputs"], batch["targets"]
        if "labels" in batch:
            return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
        raise InputError(f"{what} given as a mapping needs its targets under 'labels' (the model gets the other "
                         f"entries as keyword arguments) or keys 'inputs' and 'targets'; got keys "
                         f"{', '.join(map(repr, batch.keys()))}")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise InputError(f"{what} must be a pair (inputs, targets), e.g. (x, y), or a mapping with 'labels', with "
                     "every tensor batched on dim 0; got " + type(batch).__name__
                     + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def _leaves(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _leaves(v)


def batch_size_of(*parts: Any) -> int:
    """The common dim-0 size of every tensor in ``parts``.

    Raises:
        InputError: there is no tensor, a tensor is 0-dimensional, or the sizes disagree.
    """
    leaves = [t for p in parts for t in _leaves(p)]
    sizes = {t.shape[0] if t.dim() > 0 else None for t in leaves}
    if not sizes:
        raise InputError("the batch holds no tensor; pass tensors batched on dim 0")
    if None in sizes:
        raise InputError("a batch tensor is 0-dimensional; every input and target must be batched on dim 0. Pass a "
                         "scalar setting (a temperature) as a Python number, which the step holds fixed, or keep "
                         "it on the model as a buffer or attribute")
    if len(sizes) > 1:
        _refuse_per_sample_list(parts, leaves)
        _refuse_batch_on_dim_1(leaves)
    if len(sizes) == 2 and 1 in sizes:
        batch = max(sizes)  # type: ignore[type-var]
        raise InputError(f"inputs and targets disagree on the batch size (dim 0): some have 1 row, the rest {batch}. "
                         "edgetrain takes dim 0 of every input and target as the batch and slices it into "
                         "micro-batches: expand a tensor shared by all samples (a mask, position ids) to the batch, "
                         f"e.g. mask.expand({batch}, *mask.shape[1:]), a view that costs no memory")
    if len(sizes) != 1:
        raise InputError(f"inputs and targets disagree on the batch size (dim 0): {sorted(sizes)}. edgetrain takes "
                         "dim 0 of every input and target as the batch dimension: pass batch-first tensors "
                         "(nn.LSTM, nn.GRU, nn.Transformer: batch_first=True; or transpose inside the model's "
                         "forward). A tensor that is not per sample (a graph's edge index beside its node "
                         "features, a table every sample reads) belongs on the model: register it as a buffer "
                         "(model.register_buffer) and have the forward read it there")
    return sizes.pop()


def _lists_in(x: Any) -> Iterator[list[Any] | tuple[Any, ...]]:
    if isinstance(x, Mapping):
        for v in x.values():
            yield from _lists_in(v)
    elif isinstance(x, (tuple, list)):
        yield x
        for v in x:
            yield from _lists_in(v)


def _refuse_per_sample_list(parts: tuple[Any, ...], leaves: list[torch.Tensor]) -> None:
    """Name the fix for a list holding one entry per sample (a detection model's boxes per image, as torchvision's
    detection models take them), whose tensors are not batched on dim 0."""
    for c in (c for p in parts for c in _lists_in(p)):
        inner = {id(t) for t in _leaves(c)}
        outside = {t.shape[0] for t in leaves if id(t) not in inner}
        if len(c) >= 2 and len(c) in outside and inner and any(
                t.dim() == 0 or t.shape[0] != len(c) for t in _leaves(c)):
            shapes = ", ".join(str(tuple(t.shape)) for t in list(_leaves(c))[:3])
            raise InputError(f"inputs and targets disagree on the batch size (dim 0): a {type(c).__name__} of "
                             f"{len(c)} entries, one per sample (tensors of shapes {shapes}, ...), is not batched on "
                             "dim 0, and edgetrain slices every tensor's dim 0 into micro-batches. Pad the entries "
                             "into tensors batched on dim 0 (boxes as (batch, most boxes, 5) with a count or mask "
                             "per sample) and have the loss read those")


def _refuse_batch_on_dim_1(leaves: list[torch.Tensor]) -> None:
    """Name the fix for a tensor whose dim 1 is the batch the others have on dim 0: an RNN's initial state
    ``(num_layers, batch, hidden)`` is laid out that way even with ``batch_first=True``, so neither expanding it
    nor ``batch_first`` helps."""
    counts: dict[int, int] = {}
    for t in leaves:
        counts[t.shape[0]] = counts.get(t.shape[0], 0) + 1
    batch = max(counts, key=lambda b: (counts[b], b))
    odd = [t for t in leaves if t.shape[0] != batch and t.dim() >= 2 and t.shape[1] == batch]
    if not odd:
        return
    shape = list(odd[0].shape)
    first = [shape[1], shape[0], *shape[2:]]
    raise InputError(f"inputs and targets disagree on the batch size (dim 0): a tensor of shape {tuple(shape)} has "
                     f"the batch of {batch} on dim 1, as an RNN's initial state (num_layers, batch, hidden) does "
                     "even with batch_first=True. edgetrain takes dim 0 of every input and target as the batch and "
                     f"slices it into micro-batches: pass it batch-first, shape {tuple(first)}, and call "
                     ".transpose(0, 1).contiguous() on it inside the model's forward before the RNN (or leave it "
                     "out to start from zeros)")


def slice_batch(x: Any, start: int, stop: int) -> Any:
    """``x[start:stop]`` on dim 0 of every tensor (views, no copies); other values pass through."""
    if isinstance(x, torch.Tensor):
        return x[start:stop]
    if isinstance(x, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(slice_batch(v, start, stop) for v in x)
    return x


def _image(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_floating_point()


def has_images(x: Any) -> bool:
    """Whether a batch (tensor, dict, tuple or list of them) holds a 4-D floating-point tensor."""
    return any(_image(t) for t in _leaves(x))


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor is stored N, H, W, C (and not also plain contiguous, as maps with a 1x1 plane are)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def channels_last_copy_bytes(x: Any) -> int:
    """Bytes :func:`channels_last_images` copies for ``x``: its images not stored channels-last already."""
    return sum(t.nbytes for t in _leaves(x) if _image(t) and not is_channels_last(t))


def channels_last_images(x: Any) -> Any:
    """``x`` with every 4-D floating-point tensor stored channels-last (a copy where it is not already;
    shapes and values unchanged); other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.contiguous(memory_format=torch.channels_last) if _image(x) else x
    if isinstance(x, Mapping):
        return {k: channels_last_images(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(channels_last_images(v) for v in x)
    return x


def clone_tensors(x: Any) -> Any:
    """``x`` with every tensor cloned (tensors, dicts, tuples and lists of them); other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, Mapping):
        return {k: clone_tensors(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(clone_tensors(v) for v in x)
    return x


def batch_signature(x: Any) -> tuple[Any, ...]:
    """Per-sample shapes and dtypes (dim 0 dropped): what must match between example and real batches."""
    return tuple((tuple(t.shape[1:]), str(t.dtype), t.device.type) for t in _leaves(x))


def describe_signature(sig: tuple[Any, ...]) -> str:
    return ", ".join(f"{'x'.join(map(str, shape)) or 'scalar'} {dtype.removeprefix('torch.')} on {device}"
                     for shape, dtype, device in sig)


def _same_tensors(sig: tuple[Any, ...], planned: tuple[Any, ...]) -> bool:
    return len(sig) == len(planned) and all(d == pd and v == pv and len(s) == len(ps)
                                            for (s, d, v), (ps, pd, pv) in zip(sig, planned))


def _first_larger(sig: tuple[Any, ...], planned: tuple[Any, ...]) -> int | None:
    """The index of the first tensor of ``sig`` larger than its planned one in some dimension, or None."""
    return next((i for i, ((s, _, _), (ps, _, _)) in enumerate(zip(sig, planned))
                 if any(a > b for a, b in zip(s, ps))), None)


def larger_per_sample(sig: tuple[Any, ...], planned: tuple[Any, ...]) -> bool:
    """Whether a batch of signature ``sig`` holds the tensors of ``planned``, one of them larger in a
    dimension (a longer sequence than the example's): a plan made on it would take it."""
    return _same_tensors(sig, planned) and _first_larger(sig, planned) is not None


def signature_misfit(sig: tuple[Any, ...], planned: tuple[Any, ...]) -> str | None:
    """Why a batch of per-sample signature ``sig`` (:func:`batch_signature`) cannot run a step planned for
    ``planned``, or None when it can: the same tensors in the same order, dtypes and devices, each no larger
    than planned in any dimension. A shorter sequence (a collator padding to each batch's longest) or a
    smaller image holds less than the planned batch, so the plan's budget still bounds it, and the plan's
    policies do not depend on shapes; a larger one could pass the budget."""
    if not _same_tensors(sig, planned):
        return (f"the batch's tensors (per sample: {describe_signature(sig)}) are not those of the example given to "
                f"prepare() ({describe_signature(planned)}). Prepare again with an example shaped like this batch.")
    i = _first_larger(sig, planned)
    if i is not None:
        return (f"the batch is larger per sample than the example the plan was made for (tensor {i}: "
                f"{'x'.join(map(str, sig[i][0]))} against {'x'.join(map(str, planned[i][0]))}), so the plan's "
                "memory does not bound "
                "it. Give prepare() (or the Trainer's example=) a batch as long as the longest you will train "
                "on, or pad or truncate every batch to the example's length; shorter batches run as they are.")
    return None


def tensors_in(x: Any) -> list[torch.Tensor]:
    """Every tensor in a nested value (tensor, dict, tuple, list, or a transformers ``ModelOutput``), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_in(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in tensors_in(v)]
    if hasattr(x, "to_tuple"):  # transformers' ModelOutput
        return tensors_in(x.to_tuple())
    return []
