"""The framework-free cost model of a training chain: stages, their costs, and what a plan costs.

Nothing in this module touches torch. A :class:`CostChain` is plain data (ints and floats) that the
profiler fills in from measurements and every planner reads. :func:`simulate` is the single reference
definition of what a schedule costs in memory and time; planners must agree with it exactly (their
tests brute-force it).

Memory model (bytes, for one micro-batch of ``m`` samples, stages ``0..n-1`` in forward order).
``in_t`` is the input of stage ``t`` (``input_bytes`` for stage 0, else ``out_{t-1}``). Inside a residual
block a cut is crossed by the block's running tensor and by tensors made earlier that a later stage still
reads (the skip input): ``carried_t`` lists those as ``(producer stage p, bytes)``. Their gradients wait
while the stages between run backward, so ``ws'_t = ws_t + sum(carried_t)``. A recompute group ``i..j``
retains ``add_ij = out_j + sum(bytes for (p, bytes) in carried_j if p >= i)``: its output and the carried
tensors made inside it (one made before ``i`` is already resident). A schedule cuts the chain into
*groups*: a ``keep`` group is one stage whose saved tensors stay resident until its backward; a
``recompute`` group is a run of stages ``i..j`` executed as one checkpoint, which retains only ``add_ij``
and re-runs its forward during backward. Walking the groups forward with a resident prefix ``P``
(initially ``input_bytes``):

* keep stage ``i``: local peak ``P + saved_i + out_i + in_i + ws'_i`` (its saved tensors, its output's
  gradient and the input gradient being produced while it runs backward; its output itself is dead by
  then: the stages that read it have run backward); then ``P += saved_i + out_i``.
* recompute group ``i..j``: while stage ``t`` runs backward the group's re-run has re-materialised the
  saved tensors of stages ``i..t`` and the outputs of stages ``i..t-1`` (the re-run stops once stage
  ``t``'s saved tensors exist, so ``out_t`` is not made again), so the local peak is
  ``P + max_t (sum_{s=i..t} saved_s + sum_{s=i..t-1} out_s + out_t + in_t + ws'_t)`` (at ``t = j`` this
  covers the group's forward, ``add_ij + in_j + ws'_j``: a carried tensor the group makes is in the
  output of its maker); then ``P += add_ij``.
* nested recompute group ``i..j`` (a recompute group whose stages are each checkpointed again inside it,
  two-level checkpointing): the group's recomputation keeps only the stage outputs, then each stage is
  recomputed again while it runs backward: local peak ``P + max_t (sum_{s=i..t-1} out_s + saved_t + out_t
  + in_t + ws'_t)``; then ``P += add_ij``. Each of its stages runs forward three times.
* selective group ``i..j`` (policy ``selective:NAME`` on each of its stages, every one of which has the
  :class:`SelectiveOption` ``NAME``): a recompute group run under one selective checkpoint that keeps the
  outputs of some op classes (e.g. convolutions and matrix products) and re-runs the rest from them in
  backward. Besides ``add_ij`` it retains each stage's ``kept_s`` (cached op outputs inside the stage) and
  the outputs of the stages ``s < j`` that a kept op made (``keeps_output``); its backward is that of the
  recompute group plus the cached outputs no backward node saves (``extra_s``, live until the replay has
  consumed them): local peak as the recompute group's ``+ sum_{s=i..j} extra_s``; then
  ``P += add_ij + sum_s kept_s + sum_{s<j, keeps_output_s} out_s``. Its stages re-run only their other
  ops: each adds its option's ``recompute_s`` instead of ``fwd_s``. A stage that writes its input in place
  (``mutates_input``) never follows a stage of the same selective group, nor a selective group's last
  stage (that input may be a cached output, which must not change).
* after the last group, the loss needs ``P + out_{n-1}``.

The activation peak is the largest of these; the predicted step peak adds ``fixed_bytes`` (parameters,
gradients, optimizer state, the logical batch, runtime overhead measured by the profiler).

Time model: a micro-batch of ``m`` samples costs ``sum_t (fwd_t + bwd_t) + sum_{t recomputed} fwd_t + sum_{t
in a nested group} fwd_t + loss``; a step over a logical batch ``B`` split into micro-batches of at most ``m``
adds them up and adds ``step_fixed_s`` (the optimizer update). Every per-stage cost is affine in ``m``
(:class:`Linear`).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = [
    "Linear", "StageCost", "CostChain", "ScheduleCost", "simulate", "micro_batch_sizes", "candidate_micro_batch_sizes",
    "KEEP", "RECOMPUTE", "PAGE", "POLICIES", "singleton_groups",
    "SELECTIVE", "SelectiveOption", "selective_policy", "selective_name",
]

KEEP = "keep"
RECOMPUTE = "recompute"
PAGE = "page"
POLICIES = (KEEP, RECOMPUTE, PAGE)
#: Prefix of a per-op (selective) policy: ``"selective:" + option name`` (:class:`SelectiveOption`).
SELECTIVE = "selective"


def selective_policy(name: str) -> str:
    """The policy string of a stage run with its selective option ``name``."""
    return f"{SELECTIVE}:{name}"


def selective_name(policy: str) -> str | None:
    """The option name of a selective policy string, else ``None``."""
    if policy.startswith(SELECTIVE + ":"):
        return policy[len(SELECTIVE) + 1:]
    return None


@dataclass(frozen=True)
class Linear:
    """An affine cost ``fixed + per_sample * m`` of a micro-batch of ``m`` samples."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, m: int) -> float:
        """Value at micro-batch size ``m``."""
        return self.fixed + self.per_sample * m

    @staticmethod
    def fit(m1: int, v1: float, m2: int, v2: float) -> "Linear":
        """Line through two measurements, clamped so that neither part is negative.

        Args:
            m1, m2: two distinct micro-batch sizes.
            v1, v2: the values measured at them.

        Returns:
            The fitted cost; a negative slope or intercept (measurement noise) is clamped to zero
            while keeping the line above both points.
        """
        if m1 == m2:
            return Linear(0.0, max(v1, v2) / max(m1, 1))
        slope = (v2 - v1) / (m2 - m1)
        if slope < 0:
            return Linear(max(v1, v2), 0.0)
        fixed = v1 - slope * m1
        if fixed < 0:
            return Linear(0.0, max(v1 / m1, v2 / m2))
        return Linear(fixed, slope)

    def scaled(self, factor: float) -> "Linear":
        return Linear(self.fixed * factor, self.per_sample * factor)

    def __add__(self, other: "Linear") -> "Linear":
        return Linear(self.fixed + other.fixed, self.per_sample + other.per_sample)


@dataclass(frozen=True)
class SelectiveOption:
    """A per-op recompute policy for one stage: keep the outputs of some op classes, recompute the rest.

    Attributes:
        name: the option's name, ``"+"``-joined op classes whose outputs are kept (e.g. ``"conv+mm"``).
        kept_bytes: bytes of those outputs held from the stage's forward to its backward (storages of
            the stage input, its output and the parameters excluded: they are resident anyway).
        extra_bytes: the part of ``kept_bytes`` that no backward node saves (live only until the replay
            has consumed it, so it adds to the stage's backward peak).
        recompute_s: seconds the option adds to one micro-batch: the forward time of the ops it re-runs
            plus the selective checkpoint's per-op dispatch in forward and in the replay.
        keeps_output: a kept op makes the stage's output (so a selective group retains it when the stage
            is not the group's last).
    """

    name: str
    kept_bytes: Linear
    extra_bytes: Linear = Linear()
    recompute_s: Linear = Linear()
    keeps_output: bool = False


@dataclass(frozen=True)
class StageCost:
    """Measured costs of one stage of the chain.

    Attributes:
        name: readable stage name (the modules it covers).
        fwd_s: forward seconds.
        bwd_s: backward seconds (input gradient and weight gradients together).
        saved_bytes: bytes the stage saves for backward, excluding the storages of its input, its
            output and the parameters.
        out_bytes: bytes of the stage output (the one tensor that crosses to the next stage).
        workspace_bytes: transient bytes above saved + output + gradients while the stage runs forward
            or backward, measured as resident memory (so the allocator's slack is included).
        flops: forward floating-point operations (0 when unknown), used to scale costs to other devices.
        bwd_input_s: the input-gradient part of ``bwd_s`` where measured (else 0).
        carried: the other tensors crossing the cut after this stage, as ``(index of the stage that
            made them, bytes)`` (a residual block's skip input; empty at a single-tensor cut).
        selective: the per-op recompute options measured for this stage (empty: none applies).
        mutates_input: the stage writes one of its inputs in place (module doc: selective groups).
    """

    name: str
    fwd_s: Linear
    bwd_s: Linear
    saved_bytes: Linear
    out_bytes: Linear
    workspace_bytes: Linear = Linear()
    flops: Linear = Linear()
    bwd_input_s: Linear = Linear()
    carried: tuple[tuple[int, Linear], ...] = ()
    selective: tuple[SelectiveOption, ...] = ()
    mutates_input: bool = False

    def option(self, name: str) -> SelectiveOption:
        """The selective option called ``name``.

        Raises:
            ValueError: the stage has no such option.
        """
        for o in self.selective:
            if o.name == name:
                return o
        raise ValueError(f"stage {self.name!r} has no selective option {name!r} "
                         f"(it has {[o.name for o in self.selective]})")

    def carried_at(self, m: int) -> list[tuple[int, int]]:
        """``carried`` in whole bytes at micro-batch ``m``."""
        return [(p, math.ceil(b.at(m))) for p, b in self.carried]


@dataclass(frozen=True)
class CostChain:
    """A chain of stages with the costs the planners need.

    Attributes:
        stages: the stages in forward order.
        batch_size: the logical batch size ``B`` a step trains on.
        input_bytes: bytes of the stage-0 input per micro-batch (a view of the batch for slices, but
            counted: a gathered micro-batch may be a copy).
        fixed_bytes: bytes independent of the schedule and micro-batch size (parameters, gradients,
            optimizer state, the logical batch, measured runtime overhead).
        loss_s: seconds of loss forward + backward per micro-batch.
        step_fixed_s: seconds per logical step independent of micro-batching (optimizer update).
        name: model name for reports.
    """

    stages: tuple[StageCost, ...]
    batch_size: int
    input_bytes: Linear
    fixed_bytes: int
    loss_s: Linear = Linear()
    step_fixed_s: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a CostChain needs at least one stage")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def n(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CostChain":
        def lin(x: Any) -> Linear:
            return x if isinstance(x, Linear) else Linear(**x)

        def option(o: dict[str, Any] | SelectiveOption) -> SelectiveOption:
            if isinstance(o, SelectiveOption):
                return o
            return SelectiveOption(name=o["name"], keeps_output=bool(o.get("keeps_output", False)),
                                   **{k: lin(v) for k, v in o.items() if k not in ("name", "keeps_output")})

        def stage(s: dict[str, Any]) -> StageCost:
            carried = tuple((int(p), lin(b)) for p, b in s.get("carried", ()))
            sel = tuple(option(o) for o in s.get("selective", ()))
            return StageCost(name=s["name"], carried=carried, selective=sel,
                             mutates_input=bool(s.get("mutates_input", False)),
                             **{k: lin(v) for k, v in s.items()
                                if k not in ("name", "carried", "selective", "mutates_input")})

        stages = tuple(stage(s) for s in d["stages"])
        return CostChain(stages=stages, batch_size=int(d["batch_size"]), input_bytes=lin(d["input_bytes"]),
                         fixed_bytes=int(d["fixed_bytes"]), loss_s=lin(d.get("loss_s", {})),
                         step_fixed_s=float(d.get("step_fixed_s", 0.0)), name=d.get("name", ""))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_json(text: str) -> "CostChain":
        return CostChain.from_dict(json.loads(text))

    def with_batch_size(self, batch_size: int) -> "CostChain":
        return CostChain(self.stages, batch_size, self.input_bytes, self.fixed_bytes, self.loss_s,
                         self.step_fixed_s, self.name)


@dataclass(frozen=True)
class ScheduleCost:
    """What :func:`simulate` predicts for one schedule."""

    peak_bytes: int
    activation_peak_bytes: int
    step_time_s: float
    micro_batch_time_s: float
    recompute_time_s: float = 0.0
    per_stage_peak_bytes: tuple[int, ...] = field(default=())


def candidate_micro_batch_sizes(batch_size: int, allowed: Sequence[int] | None = None) -> list[int]:
    """Micro-batch sizes a planner searches for a logical batch of ``batch_size``, largest first.

    Args:
        batch_size: the logical batch ``B``.
        allowed: sizes the user allows (clamped to ``B``); ``None`` means, for every number of
            micro-batches ``k`` in ``1..B``, the balanced size ``ceil(B / k)`` (an unbalanced split with the
            same ``k`` has the same predicted time and a larger peak, so it never wins).

    Raises:
        ValueError: ``allowed`` is empty or holds something other than positive integers.
    """
    if allowed is None:
        return sorted({-(-batch_size // k) for k in range(1, batch_size + 1)}, reverse=True)
    sizes = list(allowed)
    if not sizes:
        raise ValueError("micro_batch_sizes is empty: pass at least one size, or None to search all")
    for m in sizes:
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"micro-batch sizes must be positive integers, got {m!r}")
    return sorted({min(int(m), batch_size) for m in sizes}, reverse=True)


def micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Sizes of the micro-batches a logical batch is split into, as the cost model counts them (all ``m`` but
    a smaller last one)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    m = min(micro_batch_size, batch_size)
    full, rest = divmod(batch_size, m)
    return [m] * full + ([rest] if rest else [])


def run_micro_batch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Sizes of the micro-batches a step runs: :func:`micro_batch_sizes`, except that a last micro-batch of one
    sample becomes ``m - 1`` and 2 where ``m`` >= 3 (BatchNorm in training mode cannot normalise one sample of a
    ``(N, C)`` input). No micro-batch is larger than the cost model's, and the split costs the same time."""
    sizes = micro_batch_sizes(batch_size, micro_batch_size)
    if len(sizes) > 1 and sizes[-1] == 1 and sizes[-2] >= 3:
        return sizes[:-2] + [sizes[-2] - 1, 2]
    return sizes


def singleton_groups(n: int) -> tuple[int, ...]:
    """Group ids that put every stage in its own group."""
    return tuple(range(n))


def _group_spans(groups: Sequence[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    start = 0
    for t in range(1, len(groups) + 1):
        if t == len(groups) or groups[t] != groups[start]:
            spans.append((start, t - 1))
            start = t
    return spans


def _check_schedule(chain: CostChain, policies: Sequence[str], groups: Sequence[int]) -> list[tuple[int, int]]:
    if len(policies) != chain.n or len(groups) != chain.n:
        raise ValueError(f"schedule has {len(policies)} policies / {len(groups)} groups for {chain.n} stages")
    for t, p in enumerate(policies):
        name = selective_name(p)
        if name is not None:
            chain.stages[t].option(name)  # raises for an option the stage does not have
        elif p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; expected one of {POLICIES} or {SELECTIVE}:NAME")
    if any(b < a for a, b in zip(groups, groups[1:])):
        raise ValueError("group ids must be non-decreasing along the chain")
    spans = _group_spans(groups)
    for i, j in spans:
        kinds = {policies[t] for t in range(i, j + 1)}
        if len(kinds) != 1:
            raise ValueError(f"stages {i}..{j} share a group but have different policies {sorted(kinds)}")
        if j > i and policies[i] != RECOMPUTE and selective_name(policies[i]) is None:
            raise ValueError(f"only recompute groups may span several stages (stages {i}..{j} are {policies[i]!r})")
        if selective_name(policies[i]) is not None:
            for t in range(i + 1, min(j + 2, chain.n)):
                if chain.stages[t].mutates_input:
                    raise ValueError(f"stage {t} writes its input in place, so it cannot follow stage {t - 1} "
                                     f"of the selective group {i}..{j}")
    return spans


def activation_profile(chain: CostChain, m: int, policies: Sequence[str],
                       groups: Sequence[int], nested_groups: Sequence[int] = ()) -> tuple[int, list[int]]:
    """Activation peak (bytes) of one micro-batch of ``m`` samples and the local peak of every group.

    ``page`` stages are costed here like ``keep`` (the paging planner owns their richer model);
    ``nested_groups`` are the ids of recompute groups run with two-level checkpointing.
    """
    spans = _check_schedule(chain, policies, groups)
    nested = set(nested_groups)
    st = chain.stages
    out = [math.ceil(s.out_bytes.at(m)) for s in st]
    saved = [math.ceil(s.saved_bytes.at(m)) for s in st]
    carried = [s.carried_at(m) for s in st]
    ws = [math.ceil(s.workspace_bytes.at(m)) + sum(b for _, b in c) for s, c in zip(st, carried)]
    inp = [math.ceil(chain.input_bytes.at(m))] + out[:-1]
    prefix = inp[0]
    peak = 0
    locals_: list[int] = []
    for i, j in spans:
        name = selective_name(policies[i])
        if policies[i] != RECOMPUTE and name is None:
            local = saved[i] + out[i] + inp[i] + ws[i]
            peak = max(peak, prefix + local)
            prefix += saved[i] + out[i]
        else:
            run = 0
            worst = 0
            two_level = groups[i] in nested and name is None
            for t in range(i, j + 1):
                if two_level:
                    worst = max(worst, run + saved[t] + out[t] + inp[t] + ws[t])
                else:
                    run += saved[t]
                    worst = max(worst, run + out[t] + inp[t] + ws[t])
                run += out[t]
            retained = out[j] + sum(b for p, b in carried[j] if p >= i)
            local = worst
            if name is not None:  # selective group: the cached op outputs too
                opts = [st[t].option(name) for t in range(i, j + 1)]
                local += sum(math.ceil(o.extra_bytes.at(m)) for o in opts)
                retained += sum(math.ceil(o.kept_bytes.at(m)) for o in opts)
                retained += sum(out[t] for t, o in zip(range(i, j), opts) if o.keeps_output)
            peak = max(peak, prefix + local)
            prefix += retained
        locals_.append(local)
    peak = max(peak, prefix + out[-1])
    return peak, locals_


def micro_batch_time(chain: CostChain, m: int, policies: Sequence[str],
                     nested_stages: Sequence[int] = ()) -> tuple[float, float]:
    """Seconds of one micro-batch of ``m`` samples, and the part of it spent recomputing."""
    base = sum(s.fwd_s.at(m) + s.bwd_s.at(m) for s in chain.stages) + chain.loss_s.at(m)
    rec = sum(s.fwd_s.at(m) for s, p in zip(chain.stages, policies) if p == RECOMPUTE)
    rec += sum(chain.stages[t].fwd_s.at(m) for t in nested_stages)
    for s, p in zip(chain.stages, policies):
        name = selective_name(p)
        if name is not None:
            rec += s.option(name).recompute_s.at(m)
    return base + rec, rec


def simulate(chain: CostChain, micro_batch_size: int, policies: Sequence[str],
             groups: Sequence[int] | None = None, nested_groups: Sequence[int] = ()) -> ScheduleCost:
    """Predicted peak bytes and step seconds of a schedule (the reference semantics; see module doc).

    Args:
        chain: the profiled chain.
        micro_batch_size: the largest micro-batch; the logical batch is split as
            :func:`micro_batch_sizes` says.
        policies: one of ``keep``/``recompute``/``page``/``selective:NAME`` per stage.
        groups: group id per stage (non-decreasing); consecutive stages with equal ids form one
            recompute segment. ``None`` puts every stage in its own group.
        nested_groups: ids of recompute groups run with two-level checkpointing (module doc).

    Returns:
        The predicted :class:`ScheduleCost`.
    """
    if groups is None:
        groups = singleton_groups(chain.n)
    sizes = micro_batch_sizes(chain.batch_size, micro_batch_size)
    act, locals_ = activation_profile(chain, sizes[0], policies, groups, nested_groups)
    nested_set = set(nested_groups)
    nested_stages = [t for t, g in enumerate(groups) if g in nested_set and policies[t] == RECOMPUTE]
    total = chain.step_fixed_s
    rec_total = 0.0
    for mb in sizes:
        t, r = micro_batch_time(chain, mb, policies, nested_stages)
        total += t
        rec_total += r
    t0, _ = micro_batch_time(chain, sizes[0], policies, nested_stages)
    return ScheduleCost(peak_bytes=int(chain.fixed_bytes + act), activation_peak_bytes=int(act),
                        step_time_s=total, micro_batch_time_s=t0, recompute_time_s=rec_total,
                        per_stage_peak_bytes=tuple(locals_))
