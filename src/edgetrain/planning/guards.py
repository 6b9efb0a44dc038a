"""What a prepared step checks about the model and the loss it was prepared for.

* :func:`model_key` and :func:`describe_change`: a step runs the model as it was captured (traced code holds
  ``self.training`` and the module objects of the capture), so a model changed after ``prepare`` (eval
  mode, a replaced submodule or parameter) is refused by name, never trained as something else.
* :func:`check_optimizer`, :func:`check_materialized`, :func:`check_trainable`: an optimizer a step cannot drive
  (``LBFGS``), a lazy module not shaped yet, parameters unfrozen after a budgeted plan was made.
* :func:`check_autocast`, :func:`check_constants`: a step under another ``torch.autocast`` than prepare's, non-tensor
  inputs other than the first step's.
* :func:`example_copy`, :func:`raise_for_one_sample`: an example the forward writes into (prepare works on a
  copy), a micro-batch of one sample that BatchNorm cannot normalise (the fix, not torch's error).
* :func:`attribute_key`: the plain attributes traced code froze (a temperature, a tensor set from outside),
  so that a step re-traces the model once one changes rather than train with the old value.
* :func:`loss_norm_safely`: how the loss normalises (:mod:`edgetrain.planning.loss`), found in a forked child.
* :func:`one_sample_trains`: whether a micro-batch of one sample trains (BatchNorm after a global pooling
  refuses it), so that the planner may go down to one.
* :func:`draws_random`: whether the forward draws random numbers (dropout): micro-batches then draw their
  own, as gradient accumulation does, and a split step is not bit for bit one full-batch step.
"""

from __future__ import annotations

import inspect
import logging
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .._state import autocast_state, describe_autocast
from ..batch import clone_tensors
from ..capture.draws import EXACT_DRAWS_NOTE, BatchDraws
from ..capture.reads import loaded_globals
from ..errors import InputError
from ..units import format_bytes
from .loss import LossNorm, loss_normalisation

log = logging.getLogger("edgetrain.api")

__all__ = ["model_key", "describe_change", "attribute_key", "changed_attributes", "check_optimizer",
           "check_materialized", "check_trainable", "check_autocast", "check_constants", "loss_norm_safely",
           "draws_random", "mark_micro_batched", "example_copy", "raise_for_one_sample", "one_sample_trains",
           "RANDOM_MICRO_BATCH_NOTE"]

#: The plan note (and warning) for a split batch whose forward draws random numbers.
RANDOM_MICRO_BATCH_NOTE = ("the forward draws random numbers (dropout, noise): each micro-batch draws its own, "
                           "as gradient accumulation over the same micro-batches does, so the step is not bit for "
                           "bit one full-batch step")


def model_key(model: nn.Module) -> tuple[Any, ...]:
    """What a prepared step depends on beyond parameter values: which module objects sit where, their
    training flags (traced code holds ``self.training`` as a constant) and which parameter objects there are."""
    return (tuple((name, id(m), m.training) for name, m in model.named_modules()),
            tuple((name, id(p)) for name, p in model.named_parameters()))


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    old_mods = {name: (ident, training) for name, ident, training in old[0]}
    new_mods = {name: (ident, training) for name, ident, training in new[0]}
    for name, (ident, training) in new_mods.items():
        label = f"'{name}'" if name else "the model"
        if name not in old_mods:
            return f"submodule {label} was added"
        if old_mods[name][0] != ident:
            return f"submodule {label} was replaced by another module"
        if old_mods[name][1] != training:
            return f"{label} is now in {'training' if training else 'eval'} mode (it was prepared in " \
                   f"{'training' if old_mods[name][1] else 'eval'} mode)"
    for name in old_mods:
        if name not in new_mods:
            return f"submodule '{name}' was removed"
    old_p, new_p = dict(old[1]), dict(new[1])
    for name in set(old_p) | set(new_p):
        if old_p.get(name) != new_p.get(name):
            return f"parameter '{name}' was added, removed or replaced by another tensor"
    return "its modules or parameters changed"


_PLAIN = (bool, int, float, complex, str, type(None))
_DELETED = object()


def attribute_key(model: nn.Module, chain: Any = None) -> dict[str, Any]:
    """The plain attributes of the modules whose code a torch.fx trace runs through (every module not defined in
    ``torch.nn``, whose modules run as calls of their own): Python numbers, strings, tuples and lists of those
    (nested too), by value; functions, partials and classes, by identity; also inside a configuration object or
    dict the module holds (``self.cfg.scale``, a Hugging Face ``config``; :func:`_settings`); tensors that are
    neither parameters nor buffers, by identity (the graph holds the object, so writes into it are seen; an
    assigned new tensor is not). A trace bakes such values into its code. So are the module-level globals the
    modules' ``forward`` reads by name, and those ``chain``'s trace read anywhere in the model's code, helper
    functions included (``chain.globals_read``: :func:`edgetrain.capture.reads.globals_read`; None: no chain)."""
    key: dict[str, Any] = {}
    seen: set[int] = set()
    owner: dict[str, int] = {}  # "global NAME" -> the globals dict it came from (another module's is qualified)

    def read_global(label: str, g: dict[str, Any], name: str) -> None:
        where = f"global {name}"
        if owner.setdefault(where, id(g)) != id(g):
            where = label
        v = g.get(name, _DELETED)
        if v is _DELETED:
            key[where] = "<deleted>"
        elif not isinstance(v, types.ModuleType):
            _settings(v, where, key, seen, 2)

    for name, m in model.named_modules():
        if type(m).__module__.startswith("torch.nn."):
            continue
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training":
                continue
            where = f"{name}.{k}" if name else k
            _settings(v, where, key, seen, 2)
        forward = inspect.getattr_static(type(m), "forward", None)  # TorchScript's is no function
        names = loaded_globals(forward.__code__) if isinstance(forward, types.FunctionType) else ()
        for g in names:  # the module-level globals its forward reads (a curriculum dict)
            if g in forward.__globals__:
                read_global(f"global {forward.__globals__.get('__name__', '?')}.{g}", forward.__globals__, g)
    for label, g, name in getattr(chain, "globals_read", ()):
        read_global(label, g, name)
    return key


_MAX_SETTINGS = 256  # a dict or object with more entries (a vocabulary, a tokenizer) is not a configuration
_MAX_SEQUENCE = 1 << 16  # plain values in one (nested) list or tuple: past that it is data, not a setting


def _settings(v: Any, where: str, key: dict[str, Any], seen: set[int], depth: int) -> None:
    """Put the plain values of ``v`` in ``key``: ``v`` itself (a tensor, function, partial or class by identity), a
    tuple or list of plain values and tensors (nested too), or, ``depth`` levels down, the entries of a dict with
    string keys and the attributes of a configuration object (a dataclass, a ``SimpleNamespace``, a Hugging Face
    ``PretrainedConfig``), each object once."""
    if isinstance(v, _PLAIN):
        key[where] = v
    elif isinstance(v, torch.Tensor):
        key[where] = ("tensor", id(v))
    elif callable(v) and not isinstance(v, nn.Module):  # a function, partial or class the traced code called
        key[where] = ("callable", v)  # held, so that a replacement can never reuse its id
    elif isinstance(v, (tuple, list)):
        flat = _plain_sequence(v, [_MAX_SEQUENCE])
        if flat is not None:
            key[where] = flat
    elif depth > 0 and id(v) not in seen and not isinstance(v, nn.Module):
        entries = v if isinstance(v, dict) else getattr(v, "__dict__", None)
        if not isinstance(entries, dict) or len(entries) > _MAX_SETTINGS:
            return
        seen.add(id(v))
        for k, x in entries.items():
            if isinstance(k, str) and not k.startswith("_"):
                _settings(x, f"{where}[{k!r}]" if isinstance(v, dict) else f"{where}.{k}", key, seen, depth - 1)


def _plain_sequence(v: tuple[Any, ...] | list[Any], room: list[int]) -> tuple[Any, ...] | None:
    """``v`` as a tuple of its plain values, tensors by identity and nested tuples / lists the same way (a list
    of lists of mixing weights); None where it holds anything else or more than ``room[0]`` entries in all."""
    out = []
    for x in v:
        room[0] -= 1
        if room[0] < 0:
            return None
        if isinstance(x, _PLAIN):
            out.append(x)
        elif isinstance(x, torch.Tensor):
            out.append(("tensor", id(x)))
        elif isinstance(x, (tuple, list)):
            inner = _plain_sequence(x, room)
            if inner is None:
                return None
            out.append(inner)
        else:
            return None
    return tuple(out)


def changed_attributes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The attributes of :func:`attribute_key` whose values differ, each as ``name (old -> new)``."""
    missing = object()

    def tensor(v: Any) -> bool:  # a tensor by identity, or a list holding one
        return isinstance(v, tuple) and (v[:1] == ("tensor",) or any(tensor(x) for x in v))

    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, missing), new.get(k, missing)
        if a == b:
            continue
        if tensor(a) or tensor(b):
            out.append(f"{k} (a new tensor)")
        elif _is_callable_key(a) or _is_callable_key(b):
            out.append(f"{k} ({_callable_name(a)} -> {_callable_name(b)})")
        else:
            out.append(f"{k} ({'unset' if a is missing else repr(a)} -> {'unset' if b is missing else repr(b)})")
    return out


def _is_callable_key(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and v[0] == "callable"


def _callable_name(v: Any) -> str:
    if not _is_callable_key(v):
        return "unset" if not isinstance(v, tuple) else repr(v)
    fn = v[1]
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None)
    return f"{type(fn).__name__} {name}" if name and type(fn).__name__ != "function" else (name or type(fn).__name__)


def check_optimizer(optimizer: Any) -> None:
    """Refuse an optimizer whose ``step`` needs a closure that re-evaluates the loss (``LBFGS``): an edgetrain
    step runs one forward and backward per optimizer step."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise InputError(f"{type(optimizer).__name__}.step needs a closure that re-evaluates the loss, and an "
                         "edgetrain step runs one forward and backward per optimizer step: use an optimizer "
                         "that steps on the gradients it is given (SGD, Adam, AdamW, ...)")


def check_materialized(model: nn.Module) -> None:
    """Refuse a model with parameters or buffers a lazy module (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) has not
    shaped yet: planning needs their sizes, and their first forward draws their initial values."""
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        shown = ", ".join(lazy[:4]) + (f" and {len(lazy) - 4} more" if len(lazy) > 4 else "")
        raise InputError(f"{shown} of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...) are not initialized yet, and "
                         "edgetrain plans from their sizes: run the model once on a batch first (with "
                         "torch.no_grad(): model(x)), then call edgetrain.prepare (an optimizer made before that "
                         "still holds them)")


def check_autocast(prepared: tuple[tuple[str, str], ...]) -> None:
    """Refuse a step whose ``torch.autocast`` regions differ from those ``prepare`` measured the plan under."""
    now = autocast_state()
    if now != prepared:
        raise InputError(f"the step runs under {describe_autocast(now)} but was prepared under "
                         f"{describe_autocast(prepared)}: autocast changes the activations' sizes and adds "
                         "half-precision copies of the weights, and the plan was measured without that. Call "
                         "edgetrain.prepare inside the same torch.autocast region as the steps.")


def check_constants(env: dict[str, Any], first: dict[str, Any] | None) -> dict[str, Any]:
    """The non-tensor inputs of ``env`` (a bound call), refused where they differ from the first step's
    (``first``; None at the first step): traced code holds them fixed."""
    constants = {k: v for k, v in env.items() if not isinstance(v, torch.Tensor)}
    if first is None or constants == first:
        return constants
    changed = sorted(k for k in set(constants) | set(first) if constants.get(k) != first.get(k))
    raise InputError(f"non-tensor input(s) {', '.join(changed)} differ from the first step's "
                     f"({', '.join(f'{k}={first.get(k)!r}' for k in changed)}): edgetrain traced the model with "
                     "them fixed. Prepare a step for each setting.")


def example_copy(model: nn.Module, inputs: Any, written: tuple[str, ...]) -> Any:
    """A copy of the example ``inputs`` for prepare's runs of a model whose forward writes into ``written`` in
    place (``x.div_(255)``): each run would write into the caller's tensors again. Warns."""
    warnings.warn(f"{type(model).__name__}'s forward writes into its input(s) {', '.join(written)} in place: prepare "
                  "runs it on a copy of the example (your tensors are left as they are), and a stage that writes "
                  "into its inputs is never recomputed (a replay would start from the written values). Each step "
                  "writes into the batch it is given, as plain PyTorch does.", stacklevel=3)
    return clone_tensors(inputs)


def raise_for_one_sample(error: BaseException, batch: int, micro_batch_size: int) -> None:
    """Turn BatchNorm's failure on a one-sample micro-batch (``error``, from torch) into the fix to make."""
    if not (isinstance(error, ValueError) and "Expected more than 1 value per channel" in str(error)):
        return
    split = (f"this batch of {batch} leaves a micro-batch of one sample (micro-batches of {micro_batch_size}); "
             "prepare with micro_batch_size of 3 or more, or" if batch > 1
             else "this batch is one sample (plain PyTorch fails on it too);")
    raise InputError(f"{split} BatchNorm in training mode cannot normalise one sample of a (N, C) input: drop the "
                     "short last batch (DataLoader(drop_last=True))") from error


def check_trainable(model: nn.Module, trainable: set[int], budget_bytes: int) -> None:
    """Refuse parameters that require gradients now but did not when the step was planned (``trainable``: their
    ids then): a budgeted plan counts the gradients and saved activations of the parameters trained then."""
    unfrozen = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in trainable]
    if unfrozen:
        shown = ", ".join(unfrozen[:4]) + (f" and {len(unfrozen) - 4} more" if len(unfrozen) > 4 else "")
        raise InputError(f"parameter(s) {shown} now require gradients but were frozen when the step was planned for "
                         f"{format_bytes(budget_bytes)}: their gradients and the activations their backward saves "
                         "are not in the plan, so the budget could not be kept. Call edgetrain.prepare again after "
                         "unfreezing (freezing more is fine).")


def loss_norm_safely(model: nn.Module, env: dict[str, Any], loss_fn: Callable[..., torch.Tensor], targets: Any,
                      batch: int) -> LossNorm:
    """:func:`loss_normalisation` in a forked child where possible: its forwards at 1-3 samples load kernels
    for shapes no step uses, which would stay resident here."""
    from ..forking import answer_in_fork

    def kind_and_error() -> tuple[str, str, tuple[str, ...] | None, tuple[str, ...], tuple[str, ...]]:
        norm = loss_normalisation(model, env, loss_fn, targets, batch)
        return norm.kind, norm.error, norm.writers, norm.written_inputs, norm.written_params

    answer = answer_in_fork(kind_and_error)
    norm = LossNorm(answer[0], loss_fn, *answer[1:]) if answer is not None else \
        loss_normalisation(model, env, loss_fn, targets, batch)  # raises here what the child raised
    if norm.written_params:
        shown = ", ".join(norm.written_params[:3]) + (", ..." if len(norm.written_params) > 3 else "")
        raise InputError(f"{type(model).__name__}'s forward writes parameter(s) {shown} (an average of another "
                         "network's weights kept inside the forward, as MoCo's key encoder and BYOL's or DINO's "
                         "teacher are): edgetrain runs a forward more than once per step (recomputation, "
                         "micro-batches) and while planning, and each run would update them again. Update them "
                         "after each step instead (step(x, y), then the average under torch.no_grad()), or train "
                         "this model with plain PyTorch")
    return norm


def draws_random(model: nn.Module, env: dict[str, Any], call_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether a forward of ``model`` as it is now (training mode) draws from the CPU or CUDA generator.

    Runs the model once, without gradients, on the first two samples of ``env``, in a forked child where
    possible: a forward at a shape no step uses loads kernels and grows heaps that would stay resident here
    (an LSTM classifier: 1.4 MiB, 9% of plain PyTorch's own peak, carried by every step after ``prepare``).
    Here, its buffers and the generators are put back. A forward that fails on the slice counts as drawing
    (the caller then says so).
    """
    from ..forking import answer_in_fork

    answer = answer_in_fork(lambda: _draws_random(model, env, call_kwargs))
    return _draws_random(model, env, call_kwargs) if answer is None else bool(answer)


def _draws_random(model: nn.Module, env: dict[str, Any], call_kwargs: dict[str, Any] | None) -> bool:
    from .._state import host_rng_moved, host_rng_state, preserved_model_state, rng_moved, rng_state
    from ..batch import slice_batch

    part = {k: slice_batch(v, 0, 2) for k, v in env.items()}
    with preserved_model_state(model, grads=False), torch.no_grad():
        before, host_before = rng_state(), host_rng_state()
        try:
            model(**{**part, **(call_kwargs or {})})
        except Exception:
            return True
        return host_rng_moved(host_before, host_rng_state()) or rng_moved(before, rng_state())


def one_sample_trains(model: nn.Module, env: dict[str, Any]) -> bool:
    """Whether a training-mode forward of ``model`` runs on one sample of ``env`` (BatchNorm in training refuses
    a single value per channel, as after a global pooling; over spatial maps one sample has many).

    Runs without gradients in a forked copy of the process where possible (a forward at a shape no step uses
    loads kernels that would stay resident here); here, buffers and generators are put back.
    """
    from ..forking import answer_in_fork

    answer = answer_in_fork(lambda: _one_sample_trains(model, env))
    return _one_sample_trains(model, env) if answer is None else bool(answer)


def _one_sample_trains(model: nn.Module, env: dict[str, Any]) -> bool:
    from .._state import preserved_model_state
    from ..batch import slice_batch

    part = {k: slice_batch(v, 0, 1) for k, v in env.items()}
    with preserved_model_state(model, grads=False), torch.no_grad():
        try:
            model(**part)
        except Exception as e:  # noqa: BLE001 - any failure means: never plan a micro-batch of one
            log.info("a training-mode forward on one sample raised %s: %s; micro-batches of at least 2",
                     type(e).__name__, e)
            return False
    return True


def mark_micro_batched(plan: Any, has_batchnorm: bool, random: bool, warn: bool = False, draws: Any = None) -> Any:
    """``plan`` with what a split batch changes said in it: ``bn_micro_batched`` for a model with BatchNorm in
    training mode, the :data:`RANDOM_MICRO_BATCH_NOTE` for one whose forward draws random numbers (unless
    ``draws`` is the :class:`~edgetrain.capture.draws.BatchDraws` of the whole batch's masks: the plan says that
    instead); with ``warn``, each also as a warning, which gives ``draws`` where it is a string (why the whole
    batch's masks are not drawn). A plan that does not split the batch comes back as it is."""
    if plan.micro_batch_size >= plan.batch_size:
        return plan
    if has_batchnorm and not plan.bn_micro_batched:
        plan = plan.replace(bn_micro_batched=True)
        if warn:
            warnings.warn(f"{plan.num_micro_batches} micro-batches: BatchNorm normalises each micro-batch of "
                          f"{plan.micro_batch_size} with its own statistics, so gradients differ slightly from one "
                          "full-batch step (running statistics stay exact). Raise the budget to avoid it.",
                          stacklevel=3)
    if random and isinstance(draws, BatchDraws):
        return plan if EXACT_DRAWS_NOTE in plan.notes else plan.replace(notes=plan.notes + (EXACT_DRAWS_NOTE,))
    if random and RANDOM_MICRO_BATCH_NOTE not in plan.notes:
        plan = plan.replace(notes=plan.notes + (RANDOM_MICRO_BATCH_NOTE,))
        if warn:
            why = f" (the whole batch's masks are not drawn: {draws})" if isinstance(draws, str) else ""
            warnings.warn(f"{plan.num_micro_batches} micro-batches: {RANDOM_MICRO_BATCH_NOTE}{why}. Raise the budget "
                          "to avoid it.", stacklevel=3)
    return plan
