"""How a loss is normalised, so that micro-batch losses add up to the loss of the whole batch.

Micro-batching runs ``loss_fn`` on each slice of the batch and backpropagates the slices one by one; the
gradients equal the full batch's only if each slice's loss is weighted by what it contributes to the full
batch's loss. That depends on the loss's reduction, which :func:`loss_normalisation` finds out before any
training by evaluating the loss on a few samples of the example batch, whole and split at two points
(the samples are picked to differ in their labels and padding: a class-weighted or padding-aware mean,
in the loss or inside a model handed its labels, looks like a plain mean on samples that all share a
label or all lack padding):

* a **mean over samples** (``reduction="mean"``, the usual case): a slice weighs its share of samples;
* a **sum** (``reduction="sum"``): every slice weighs 1;
* a **weighted mean over targets** (``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with class weights or an
  ``ignore_index``: the mean is over the weights of the targets that count, e.g. the non-padding tokens):
  a slice weighs its targets' total weight over the batch's, read from the targets of every batch;
* anything else (a normaliser that depends on the batch in a way edgetrain cannot see) is **opaque**:
  the step is then never split, and a budget that needs micro-batching is refused with that reason;
* a loss (or model) that fails on part of the batch is **whole-batch only** (an in-batch contrastive loss
  whose targets index the batch: ``F.cross_entropy(img @ txt.T, torch.arange(B))`` evaluated on 6 of 8
  samples asks for class 7 of 6): refused like an opaque one, with the error it raised;
* a loss that changes from one evaluation of the same samples to the next, even in eval mode, is
  **random** (the forward draws random numbers whatever its mode: a masked autoencoder's random masking,
  injected noise): its split cannot be checked, so it is refused like an opaque one, with that reason;
* a model whose training-mode outputs for some samples change when other samples of the batch change
  **mixes samples** (mixup or CutMix inside the forward, attention across the batch, statistics over the
  batch outside BatchNorm): micro-batches would mix within themselves only, so it is refused like an
  opaque one. The eval-mode checks cannot see what only training mode does; this one runs the forward
  twice in training mode from the same random state (the same dropout masks), on the samples and on them
  with the second half replaced, and compares the first half's output rows. BatchNorm layers run on their
  running statistics for it: how edgetrain keeps their statistics under micro-batching is its own matter.
  A loss that does not split in eval mode is checked the same way there (the first samples' outputs, whole
  and on their own) before it is called opaque: BatchNorm without running statistics or a branch on a
  batch-wide ``.item()`` mixes samples, and the refusal says so rather than blaming the loss.

A loss whose values pass as one of the splittable forms is then checked where it matters: the gradients
of the samples whole against those of the two halves, each weighted as a micro-batch is. A term over the
batch as a whole that is small in value can be large in gradient (a mixture-of-experts load-balancing loss:
0.02 x Mixtral's router loss moved the loss by 4e-5 relative and the router's gradient by 32%); such a loss is
opaque.

A loss that is not a scalar (``reduction="none"``) is refused with the fix to make.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._state import preserved_model_state
from ..batch import tensors_in
from ..errors import InputError
from ..losses import counted_weight
from ..profile.memory import available_bytes
from .forward_reads import check_reads_only_outputs
from .mixing import mixes_in_eval, mixes_in_training, modes_kept, take

__all__ = ["LossNorm", "loss_normalisation"]

log = logging.getLogger(__name__)

MEAN, SUM, WEIGHTED, OPAQUE, RANDOM, WHOLE, MIXES = "mean", "sum", "weighted", "opaque", "random", "whole", "mixes"


@dataclass(frozen=True)
class LossNorm:
    """How the loss of a batch is made from the losses of its slices.

    Attributes:
        kind: ``"mean"``, ``"sum"``, ``"weighted"``, ``"opaque"``, ``"random"``, ``"whole"`` or ``"mixes"`` (see
            the module docstring).
        loss_fn: the loss (for ``"weighted"``: its class weights and ignored index are read from it).
        error: for ``"whole"``, what evaluating it on part of the batch raised; for ``"opaque"``, where the
            gradients differ; for ``"mixes"``, which output moved and by how much.
    """

    kind: str
    loss_fn: Any = None
    error: str = ""
    #: the forward's ops writing into arguments autograd saves, seen by the check (None: not seen), for capture
    writers: tuple[str, ...] | None = None
    #: the input tensors the forward writes into in place (``x.div_(255)``), by argument name
    written_inputs: tuple[str, ...] = ()
    #: the parameters the forward writes (an average of another network's weights), by name
    written_params: tuple[str, ...] = ()

    @property
    def splittable(self) -> bool:
        """Whether micro-batches can reproduce the full batch's gradients exactly."""
        return self.kind not in (OPAQUE, RANDOM, WHOLE, MIXES)

    @property
    def runs_on_parts(self) -> bool:
        """Whether the loss and the forward run on part of the batch at all (profiling runs parts)."""
        return self.kind != WHOLE

    @property
    def why_unsplittable(self) -> str:
        """Why micro-batches cannot reproduce the full batch's gradients (empty when they can)."""
        if self.kind == WHOLE:
            return (f"the loss, or the model's forward, fails on part of the batch ({self.error}), so it is not a "
                    "loss over samples that micro-batches could add up (an in-batch contrastive loss, whose "
                    "targets index the batch, is one); the batch is trained whole")
        if self.kind == RANDOM:
            return ("the loss of the same samples changes from one evaluation to the next, even in eval mode "
                    "(the forward draws random numbers whatever its mode: random masking, noise), so whether "
                    "micro-batches reproduce its gradients cannot be checked")
        if self.kind == MIXES:
            return (f"the model's outputs for some samples change when other samples of the batch change "
                    f"({self.error}): its forward mixes samples across the batch (mixup or CutMix inside the "
                    "model, attention across the batch, statistics over the batch such as BatchNorm without "
                    "running statistics, a branch on a batch-wide .item()), and micro-batches would each mix "
                    "only within themselves; the batch is trained whole")
        if self.kind == OPAQUE and self.error:
            return (f"split in two, the example's gradients do not add up to the whole's ({self.error}): the "
                    "loss, or the model's forward, has a term over the batch as a whole (a mixture-of-experts "
                    "load-balancing loss, an output centred on the batch's mean), so micro-batches could not "
                    "reproduce its gradients")
        if self.kind == OPAQUE:
            return ("the loss is neither a mean nor a sum over samples on the example batch (split in two, its "
                    "parts do not add up to the whole), so micro-batches could not reproduce its gradients (a "
                    "mean over the tokens that count, computed inside the model from labels with padding or by "
                    "a lambda, is one: pass the labels as targets and loss_fn=edgetrain.TokenCrossEntropyLoss() "
                    "(shift=True for a causal language model) to let edgetrain split it)")
        return ""

    def weight(self, targets: Any, size: int) -> float:
        """What a slice of ``size`` samples with ``targets`` contributes to the batch's normaliser."""
        if self.kind == WEIGHTED:
            own = getattr(self.loss_fn, "target_weight", None)  # a loss that shifts its targets counts them itself
            if callable(own):
                return float(own(targets))
            return counted_weight(targets, self.loss_fn.ignore_index, self.loss_fn.weight)
        return float(size)

    def scale(self, slice_weight: float, total_weight: float) -> float:
        """The factor a slice's loss is multiplied by before its backward."""
        if self.kind == SUM:
            return 1.0
        return slice_weight / total_weight if total_weight else 0.0

    def combine(self, losses: list[tuple[float, float]], total_weight: float) -> float:
        """The batch's loss from ``(slice loss, slice weight)`` pairs."""
        if self.kind == SUM:
            return sum(v for v, _ in losses)
        return sum(v * w for v, w in losses) / total_weight if total_weight else 0.0


def _target_weighted(loss_fn: Any, targets: Any) -> bool:
    return (isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean"
            and isinstance(targets, torch.Tensor) and not targets.is_floating_point())


def _loss_value(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                idx: torch.Tensor, batch: int | None = None, then: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """The loss of samples ``idx``; with ``batch`` (the example's size), first a check that the output
    follows the samples along dim 0 (:func:`_check_batch_first`). With ``then``, what it returns for the loss,
    called before the buffers are put back: a backward must run first, since putting back a buffer the forward
    saved (BatchNorm's running statistics, in eval mode) is an in-place write autograd refuses."""
    with preserved_model_state(model):  # each evaluation sees the buffers as they are now
        out = model(**{k: take(v, idx) for k, v in env.items()})
        if batch is not None:
            _check_batch_first(model, out, len(idx), batch)
        loss = loss_fn(out, take(targets, idx))
        return loss if then is None else then(loss)


def _check_loss_runs_whole(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                           batch: int, flags: list[tuple[nn.Module, bool]]) -> None:
    """Refuse a loss that fails on the model's output for the whole example too (a loss taking a tensor handed a
    Hugging Face ``ModelOutput``), saying what the model returns; a loss failing on part of it only is left to
    the caller (kind ``"whole"``). The model runs in the modes it trains in (``flags``: an Inception-style
    model returns its auxiliary logits in training mode only), without gradients."""
    with preserved_model_state(model):
        try:
            with modes_kept(model):
                for m, t in flags:
                    m.training = t
                out = model(**env)
        except Exception:  # the profiling that follows runs it as it trains, and says so
            return
        try:
            loss_fn(out, targets)
            return
        except Exception as e:
            failure = e
    hint = ("; e.g. lambda out, y: nn.functional.cross_entropy(out.logits, y)" if isinstance(out, dict)
            and "logits" in out else "")
    raise InputError(f"loss_fn(output, targets) fails on the model's output for the example batch: "
                     f"{type(failure).__name__}: {failure}. The model returns {_describe(out)} and the targets are "
                     f"{_describe(targets)}: pass a loss_fn that takes them{hint}") from failure


def _describe(x: Any) -> str:
    """A tensor's shape and dtype, a dict's keys, a sequence's length: what a loss is handed, in words."""
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, dict):
        return f"{type(x).__name__} with {', '.join(repr(k) for k in list(x.keys())[:6])}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__


def _check_batch_first(model: nn.Module, out: Any, taken: int, batch: int) -> None:
    """Refuse a model whose batch is not dim 0 of its inputs: given ``taken`` of the example's ``batch`` samples
    along dim 0, none of its outputs has ``taken`` rows and one still has ``batch`` (a sequence-first LSTM or
    Transformer handed ``[L, B, F]``: slicing dim 0 cut the sequence, and every micro-batch would be wrong)."""
    rows = {t.shape[0] for t in tensors_in(out) if t.dim() > 0}
    if taken < batch and rows and taken not in rows and batch in rows:
        raise InputError(f"{type(model).__name__} given {taken} of the {batch} samples along dim 0 of its inputs "
                         f"returned outputs of {batch} rows: its batch is not dim 0 of its inputs. edgetrain takes "
                         "dim 0 of every input and target as the batch dimension: pass batch-first tensors "
                         "(nn.LSTM, nn.GRU, nn.Transformer: batch_first=True; or transpose inside the model's "
                         "forward)")


def _int_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if not x.is_floating_point() and not x.is_complex() and x.dim() > 0 else []
    if isinstance(x, dict):
        return [t for v in x.values() for t in _int_tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _int_tensors(v)]
    return []


def _diverse_samples(env: dict[str, Any], targets: Any, batch: int, n: int) -> torch.Tensor:
    """``n`` sample indices: first one per distinct kind of sample, then spread over the batch.

    A sample's kind is its integer targets (labels: a class-weighted mean) and, for every integer tensor
    among the inputs and targets, how many of its entries are negative or zero (padding, an ignored label
    such as Hugging Face's -100, a zero attention mask: a mean over the tokens that count, computed
    inside a model handed its labels). Samples of one kind alone would hide such a normaliser.
    """
    keys: list[list[bytes]] = [[] for _ in range(batch)]
    if isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dim() > 0:
        rows = targets.reshape(batch, -1).cpu()
        for i in range(batch):
            keys[i].append(rows[i].numpy().tobytes())
    for t in _int_tensors(env) + _int_tensors(targets):
        rows = t.reshape(batch, -1).cpu()
        counts = torch.stack([(rows < 0).sum(1), (rows == 0).sum(1)], 1)
        for i in range(batch):
            keys[i].append(counts[i].numpy().tobytes())
    first: dict[bytes, int] = {}
    for i in range(batch):
        first.setdefault(b"|".join(keys[i]), i)
    picked = list(first.values())[:n]
    spread = [round(k * (batch - 1) / max(n - 1, 1)) for k in range(n)]  # the rest evenly over the batch
    picked += [i for i in dict.fromkeys(spread + list(range(batch))) if i not in picked][:n - len(picked)]
    return torch.tensor(sorted(picked))


def loss_normalisation(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                       batch: int, rtol: float = 1e-4, samples: int = 6) -> LossNorm:
    """Find how ``loss_fn`` normalises, on (at most) ``samples`` samples of the example batch that differ
    (:func:`_diverse_samples`), whole and split after the first and in the middle; then, for a loss that
    splits, whether the model mixes samples in training mode (:func:`_unless_samples_mix`).

    The model runs in eval mode (dropout off, BatchNorm on its running statistics: every sample on its
    own) without gradients, and its buffers, gradients, training flags and the RNG are restored after.

    Raises:
        InputError: the loss is not a scalar tensor.
    """
    n = min(batch, samples)
    idx = _diverse_samples(env, targets, batch, n)
    writers, written, params = check_reads_only_outputs(model, env, loss_fn, targets, idx[:2])
    if params:  # refused by the caller, before any forward of its own writes them
        return LossNorm(OPAQUE, written_params=params)
    norm = _normalisation(model, env, loss_fn, targets, batch, idx, rtol)
    norm = _unless_samples_mix(norm, model, env, idx) if norm.splittable else norm
    return replace(norm, writers=writers, written_inputs=written)


def _normalisation(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                   batch: int, idx: torch.Tensor, rtol: float) -> LossNorm:
    n = len(idx)
    cuts = sorted({1, n // 2} - {0, n})
    flags = [(m, m.training) for m in model.modules()]
    with torch.no_grad():
        model.eval()
        try:
            try:
                with _LowestPrecision() as precision:  # a bfloat16 model's losses are rounded to its precision
                    whole = _loss_value(model, env, loss_fn, targets, idx, batch)
                    _check_scalar(whole)
                    if n < 2:
                        return LossNorm(MEAN)
                    parts = [(c, float(_loss_value(model, env, loss_fn, targets, idx[:c], batch)),
                              float(_loss_value(model, env, loss_fn, targets, idx[c:], batch))) for c in cuts]
            except InputError:
                raise
            except Exception as e:
                _check_loss_runs_whole(model, env, loss_fn, targets, batch, flags)
                log.info("loss on part of the batch raised %s: %s", type(e).__name__, e)
                return LossNorm(WHOLE, error=f"{type(e).__name__}: {e}")
            with preserved_model_state(model):  # the same samples, other random draws: equal unless it draws
                torch.manual_seed((torch.initial_seed() + 1) % 2**63)
                again = float(_loss_value(model, env, loss_fn, targets, idx))
        finally:
            for m, t in flags:
                m.training = t
    if _target_weighted(loss_fn, targets):
        return _unless_gradients_differ(LossNorm(WEIGHTED, loss_fn), model, env, loss_fn, targets, idx, batch)
    whole_v = float(whole)
    rtol = max(rtol, 16 * precision.eps)  # as the gradient check allows half-precision rounding

    def close(v: float, a_v: float, b_v: float) -> bool:
        return abs(whole_v - v) <= rtol * max(abs(whole_v), abs(a_v), abs(b_v), 1e-12) + 1e-7

    if all(close((a_v * c + b_v * (n - c)) / n, a_v, b_v) for c, a_v, b_v in parts):
        return _unless_gradients_differ(LossNorm(MEAN), model, env, loss_fn, targets, idx, batch)
    if all(close(a_v + b_v, a_v, b_v) for c, a_v, b_v in parts):
        return _unless_gradients_differ(LossNorm(SUM), model, env, loss_fn, targets, idx, batch)
    if not close(again, again, again):
        log.info("loss over %d samples is %.6g, then %.6g on the same samples: the forward draws random numbers",
                 n, whole_v, again)
        return LossNorm(RANDOM)
    log.info("loss over %d samples is %.6g; split after %s samples: %s; neither their mean nor their sum", n,
             whole_v, ", ".join(str(c) for c, _, _ in parts),
             "; ".join(f"{a_v:.6g} and {b_v:.6g}" for _, a_v, b_v in parts))
    return _unless_mixing_in_eval(model, env, idx, [c for c, _, _ in parts])


def _unless_samples_mix(norm: LossNorm, model: nn.Module, env: dict[str, Any], idx: torch.Tensor) -> LossNorm:
    """``norm``, or one of kind ``"mixes"`` when the forward mixes samples in training mode
    (:func:`~edgetrain.planning.mixing.mixes_in_training`)."""
    moved = mixes_in_training(model, env, idx)
    return LossNorm(MIXES, error=moved) if moved else norm


def _unless_mixing_in_eval(model: nn.Module, env: dict[str, Any], idx: torch.Tensor, cuts: list[int],
                           opaque: LossNorm = LossNorm(OPAQUE)) -> LossNorm:
    """For a loss that did not split at ``cuts`` (in value or in gradient): kind ``"mixes"`` when the forward
    mixes samples in eval mode (:func:`~edgetrain.planning.mixing.mixes_in_eval`), since the loss is not to blame
    then; otherwise ``opaque``."""
    moved = mixes_in_eval(model, env, idx, cuts)
    return LossNorm(MIXES, error=moved) if moved else opaque


class _LowestPrecision(TorchDispatchMode):
    """Records the largest epsilon among the floating-point results of the ops run under it: a forward that
    computes in bfloat16 under ``torch.autocast`` rounds its gradients at that precision, whatever the
    parameters' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            if t.is_floating_point():
                self.eps = max(self.eps, torch.finfo(t.dtype).eps)
        return out


def _unless_gradients_differ(norm: LossNorm, model: nn.Module, env: dict[str, Any],
                             loss_fn: Callable[..., torch.Tensor], targets: Any, idx: torch.Tensor, batch: int,
                             gtol: float = 1e-3) -> LossNorm:
    """``norm``, or an opaque one when the gradients of samples ``idx`` differ from those of its two halves
    weighted as ``norm`` weighs micro-batches: per parameter tensor, by more than ``gtol`` of the larger of
    the two's largest entry (float32 sums in another order differ by about 1e-6; a half-precision parameter,
    or a forward computing in half precision (autocast), gets 16 of that dtype's epsilon, if more; entries
    below 1e-6 of the largest gradient anywhere count as zero). Runs in eval mode, like the values' check;
    skipped (the values' check stands alone) where it would need more than half the memory the system has
    available."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = len(idx)
    if n < 2 or not params:
        return norm
    # the whole's gradients, the split's float32 sums and one half's gradients at a time
    need = sum(2 * p.numel() * p.element_size() + 4 * p.numel() for p in params)
    free = available_bytes()
    if free is not None and need > free // 2:
        log.info("gradient check of the loss's split skipped: it needs %.0f MiB, %.0f MiB are available",
                 need / 2**20, free / 2**20)
        return norm
    flags = [(m, m.training) for m in model.modules()]

    def of(loss: torch.Tensor) -> list[torch.Tensor | None]:
        if not loss.requires_grad:
            return [None] * len(params)
        got = torch.autograd.grad(loss, params, allow_unused=True)
        return [g.to_dense() if g is not None and g.is_sparse else g for g in got]  # nn.Embedding(sparse=True)

    def grads(sel: torch.Tensor) -> list[torch.Tensor | None]:
        return _loss_value(model, env, loss_fn, targets, sel, batch, then=of)

    try:
        model.eval()
        with torch.enable_grad():
            with _LowestPrecision() as precision:  # autocast, or half-precision layers inside the model
                whole = grads(idx)
            total = norm.weight(take(targets, idx), n)
            split = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
            for sel in (idx[:n // 2], idx[n // 2:]):
                scale = norm.scale(norm.weight(take(targets, sel), len(sel)), total)
                for acc, g in zip(split, grads(sel)):
                    if g is not None:
                        acc.add_(g, alpha=scale)
    except Exception as e:  # the values' check ran these forwards already; a backward that fails says nothing
        log.info("gradient check of the loss's split skipped: %s: %s", type(e).__name__, e)
        return norm
    finally:
        for m, t in flags:
            m.training = t
    floor = 1e-6 * max((float(g.abs().max()) for g in whole if g is not None and g.numel()), default=0.0)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for (name, p), g, s in zip(named, whole, split):
        g = torch.zeros_like(s) if g is None else g.to(s.dtype)
        scale = max(float(g.abs().max()) if g.numel() else 0.0, float(s.abs().max()) if s.numel() else 0.0)
        if scale <= floor:
            continue
        rel = float((g - s).abs().max()) / scale
        if rel > max(gtol, 16 * precision.eps, 16 * torch.finfo(p.dtype).eps if p.is_floating_point() else 0.0):
            log.info("loss passes as %s on values, but split in two its gradients differ from the whole's by %.2g "
                     "relative in %s", norm.kind, rel, name)
            return _unless_mixing_in_eval(model, env, idx, [n // 2],
                                          LossNorm(OPAQUE, error=f"{rel:.2g} relative in {name}"))
    return norm


def _check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn must return a scalar tensor, got {shape}. Use reduction='mean' (or 'sum'), "
                         "or reduce it yourself, e.g. loss_fn=lambda out, y: F.cross_entropy(out, y, "
                         "reduction='none').mean()")
