"""The option groups of :func:`edgetrain.prepare`, as frozen dataclasses.

The core call is ``prepare(model, optimizer, loss_fn, example=..., memory_budget=...)``; everything else is
a group with its own type, in the verb-plus-config style::

    step = edgetrain.prepare(model, opt, loss_fn, example=(x, y), memory_budget="200MiB",
                             planning=PlanConfig(micro_batch_size=8),
                             paging=PagingConfig(directory="/mnt/sd", device="rpi4", objective="energy"))

The opt-in approximations have their own types beside their code: ``speedup=`` takes a float or an
:class:`~edgetrain.approx.ElasticConfig`, ``grad_filter=`` a :class:`~edgetrain.approx.GradFilter`.

The keyword arguments ``prepare`` took before these groups existed (``micro_batch_size=``, ``solver=``,
``page_dir=``, ``time_budget=``, ...) still work for one release: :func:`resolve_legacy` folds them into
the groups and warns once per argument name with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .devices import DeviceProfile

__all__ = ["PlanConfig", "PagingConfig", "options", "resolve_legacy", "LEGACY_KWARGS"]

Objective = Literal["time", "energy"]


@dataclass(frozen=True)
class PlanConfig:
    """How ``prepare`` plans and runs the step.

    Attributes:
        micro_batch_size: fix the micro-batch size; None lets the planner choose.
        solver: planner name (``edgetrain.planners.PLANNERS``): ``"dp"`` (exact, default; None means it),
            ``"no_saving"``, ``"recompute_all"``, ``"chen_sqrt"``, ``"checkpoint_sequential"``; the POET planners
            (``"poet"``, ``"poet-milp"``) take a :class:`PagingConfig` (this field selects them too).
        max_stages: upper bound on the number of stages the model is cut into.
        exact_batchnorm: for models with BatchNorm in training mode, prefer plans without micro-batching
            (identical to plain PyTorch) and micro-batch only if no such plan fits.
        safety_margin: share of the budget held back for what validation cannot see of a real step
            (allocator noise, code and heap a process touches that its fork did not); at least 1 MiB when
            above 0.
        use_cache: reuse stage profiles measured earlier on this machine.
        tune_allocator: install edgetrain's CPU tensor pool (freed tensor memory is reused but never held
            beyond the peak of live tensors; with a budget its cap follows the budget); fix glibc's mmap
            threshold for the rest (process-wide, as ``import edgetrain`` does).
        page_optimizer_state: with a budget, write the optimizer's large state tensors (momentum, Adam's
            moments) to a page file during the forward and backward passes and read them back for the
            update (exact: the bytes come back unchanged), so the activations get their memory.
            ``"auto"``: when the planner predicts a faster step with it, the page file's writes and reads
            included, or only then a plan fits; True: always; False: never.
        state_dir: where that page file goes (None: ``<tmp>/edgetrain-pages``); put it on fast storage.
        fused_update: with a budget, let a step that trains the batch in one piece update each parameter inside
            the backward as soon as its gradient is complete, and free that gradient (exact: the optimizer's
            own update; with a paged state, each parameter's state is read back and written out around its
            update), so the gradients never take their full size beside the activations. Only for optimizers
            that update each parameter on its own (``torch.optim`` SGD, Adam, AdamW, Adamax, NAdam, RAdam,
            RMSprop, Adagrad, Adadelta) without step hooks; gradients do not exist after such a step.
            ``"auto"``: when the planner predicts a faster step with it, or only then a plan fits; True:
            whenever a plan fits that way (an error where the optimizer rules it out); False: never (code that
            reads or clips gradients before the update, e.g. ``Trainer``'s ``grad_clip_norm``, needs this).
        compile: opt-in: run the step's forward and backward as ``torch.compile`` (TorchInductor) code where
            the plan keeps every activation (the batch in one piece, or micro-batches of a model without
            BatchNorm), at the fastest compiler setting whose compiled trial steps, measured in a fork with the
            compiler and its code, fit the budget, and whose step agreed with the eager step in a check; the step
            runs eagerly otherwise, with a warning saying why. Results equal the eager step's up to floating-point
            rounding; prepare and the first step compile (seconds to minutes).
        layout: the memory layout a convolutional model's images are fed in (every 4-D floating-point tensor
            of a batch; the model's parameters are not touched). ``"keep"``: as given. ``"channels_last"``:
            converted to channels-last, oneDNN's fast CPU layout (MobileNetV2 steps about 1.6x faster at
            64x64), at the cost of lean BatchNorm's memory saving (its exact kernel covers NCHW only).
            ``"auto"``: profile both and take channels-last where the cost model's fastest step inside the
            budget is at least 5% faster (:mod:`edgetrain.planning.layout`; prepare profiles twice; the batch
            as given under ``torch.use_deterministic_algorithms(True)``, since a measured choice can differ
            between runs). Other kernels round differently: values equal the given layout's up to float
            rounding (about 1e-6 relative), not bit for bit. A step re-plans for a new budget in the layout
            it was prepared in.
    """

    micro_batch_size: int | None = None
    solver: str = "dp"
    max_stages: int = 48
    exact_batchnorm: bool = True
    safety_margin: float = 0.03
    use_cache: bool = True
    tune_allocator: bool = True
    page_optimizer_state: bool | Literal["auto"] = "auto"
    state_dir: str | None = None
    fused_update: bool | Literal["auto"] = "auto"
    compile: bool = False
    layout: Literal["keep", "channels_last", "auto"] = "keep"

    def __post_init__(self) -> None:
        if self.solver is None:  # "the default", as a flat option list or a config file passes it
            object.__setattr__(self, "solver", "dp")
        if not isinstance(self.solver, str):
            raise ValueError(f"solver must be a planner name such as 'dp', got {self.solver!r}")
        if self.page_optimizer_state not in (True, False, "auto"):
            raise ValueError(f"page_optimizer_state must be True, False or 'auto', got {self.page_optimizer_state!r}")
        if self.fused_update not in (True, False, "auto"):
            raise ValueError(f"fused_update must be True, False or 'auto', got {self.fused_update!r}")
        if self.layout not in ("keep", "channels_last", "auto"):
            raise ValueError(f"layout must be 'keep', 'channels_last' or 'auto', got {self.layout!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        m = self.micro_batch_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"micro_batch_size must be an integer >= 1 or None, got {m!r}")
        if not 0 <= self.safety_margin < 0.5:
            raise ValueError(f"safety_margin must be in [0, 0.5), got {self.safety_margin}")
        if isinstance(self.max_stages, bool) or not isinstance(self.max_stages, int) or self.max_stages < 1:
            raise ValueError(f"max_stages must be an integer >= 1, got {self.max_stages!r}")


@dataclass(frozen=True)
class PagingConfig:
    """POET-style planning: page saved tensors to storage as well as recompute, for a device profile.

    Passing one to ``prepare(paging=...)`` switches to the POET planners, which minimise time or energy
    under the memory budget and, optionally, a time budget.

    Attributes:
        directory: where the page file goes (CPU training; None: a temporary directory). Put it on the
            storage you want to page to.
        device: the device profile that costs transfers and energy: ``"host"`` (measured here), a bundled
            profile name (``edgetrain.devices.list_profiles()``) or a ``DeviceProfile``.
        objective: minimise ``"time"`` or ``"energy"``.
        time_budget: at most this multiple of the fastest step's time (e.g. 1.3); None: no bound.
        page: False plans recomputation only (device, objective and time budget still apply).
        solver: ``"poet"`` (exact dynamic programme, default) or ``"poet-milp"`` (HiGHS MILP).
    """

    directory: str | None = None
    device: "str | DeviceProfile" = "host"
    objective: Objective = "time"
    time_budget: float | None = None
    page: bool = True
    solver: Literal["poet", "poet-milp"] = "poet"

    def __post_init__(self) -> None:
        if self.objective not in ("time", "energy"):
            raise ValueError(f"objective must be 'time' or 'energy', got {self.objective!r}")
        if self.solver not in ("poet", "poet-milp"):
            raise ValueError(f"PagingConfig.solver must be 'poet' or 'poet-milp', got {self.solver!r}")
        if self.time_budget is not None and not self.time_budget >= 1.0:
            raise ValueError(f"time_budget is a multiple of the fastest step's time and must be >= 1, "
                             f"got {self.time_budget!r}")


_PLAN_FIELDS = {f.name for f in fields(PlanConfig)}
#: old ``prepare`` keyword -> (group, field) it now lives in
LEGACY_KWARGS: dict[str, tuple[str, str]] = {
    **{n: ("planning", n) for n in _PLAN_FIELDS},
    "paging": ("paging", "page"), "page_dir": ("paging", "directory"), "device": ("paging", "device"),
    "objective": ("paging", "objective"), "time_budget": ("paging", "time_budget"),
}
_WARNED: set[str] = set()


def _warn_once(name: str, group: str, field: str) -> None:
    if name in _WARNED:
        return
    _WARNED.add(name)
    cls = "PlanConfig" if group == "planning" else "PagingConfig"
    new = f"{group}=edgetrain.{cls}()" if name == "paging" else f"{group}=edgetrain.{cls}({field}=...)"
    warnings.warn(f"prepare({name}=...) is deprecated and will be removed in the next release: pass {new} "
                  "instead", DeprecationWarning, stacklevel=4)


def options(**flat: Any) -> dict[str, Any]:
    """``prepare``'s option groups from flat keywords (the old names), without a warning.

    For tools whose options arrive flat, such as a command line: ``prepare(..., **options(solver="dp",
    micro_batch_size=4))``.
    """
    planning, paging = resolve_legacy(None, flat.pop("paging", None), flat, warn=False)
    return {"planning": planning, "paging": paging}


def resolve_legacy(planning: PlanConfig | None, paging: "PagingConfig | bool | None",
                   legacy: dict[str, Any], *, warn: bool = True) -> tuple[PlanConfig, PagingConfig | None]:
    """Fold ``prepare``'s old keyword arguments into the option groups (warning once per name).

    Args:
        planning: the ``planning=`` group given, or None.
        paging: the ``paging=`` group given; a bool is the old switch (True: page).
        legacy: the other old keyword arguments.
        warn: warn (once per name) that they are deprecated.

    Returns:
        The planning group and the paging group (None: no POET planning).

    Raises:
        TypeError: an unknown keyword argument, or an old one given beside its group.
    """
    unknown = sorted(set(legacy) - set(LEGACY_KWARGS))
    if unknown:
        raise TypeError(f"prepare() got unexpected keyword argument(s) {', '.join(unknown)}")
    plan_kw: dict[str, Any] = {}
    page_kw: dict[str, Any] = {}
    if isinstance(paging, bool):
        legacy = {**legacy, "paging": paging}
        paging = None
    for name, value in legacy.items():
        group, field = LEGACY_KWARGS[name]
        if (group == "planning" and planning is not None) or (group == "paging" and paging is not None):
            raise TypeError(f"prepare() got {name}= beside {group}=: set {field} in the {group} config only")
        if warn:
            _warn_once(name, group, field)
        (plan_kw if group == "planning" else page_kw)[field] = value
    cfg = planning if planning is not None else PlanConfig(**plan_kw)
    solver = cfg.solver
    # The old call switched to the POET planners on paging=True, a time budget or a poet solver name.
    wants_poet = bool(page_kw.get("page")) or page_kw.get("time_budget") is not None or solver.startswith("poet")
    if paging is None and wants_poet:
        page_kw.setdefault("page", False)
        if solver.startswith("poet"):
            page_kw["solver"] = solver
        paging = PagingConfig(**page_kw)
    elif paging is not None and solver.startswith("poet"):
        paging = replace(paging, solver=solver)  # type: ignore[arg-type]
    return cfg, paging
