"""`Plan`: the frozen, JSON-serialisable result every planner returns and the runtime executes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

from .graph import RECOMPUTE, CostChain, micro_batch_sizes, simulate, singleton_groups
from .units import format_bytes

__all__ = ["Plan", "plan_from_schedule"]


@dataclass(frozen=True)
class Plan:
    """A schedule for one training step and what it is predicted to cost.

    Attributes:
        batch_size: logical batch size the plan trains per step.
        micro_batch_size: largest micro-batch; the batch is split as
            :func:`edgetrain.graph.micro_batch_sizes` says.
        policies: per stage, ``"keep"``, ``"recompute"``, ``"page"`` or ``"selective:NAME"`` (a per-op
            policy: the outputs of the op classes in ``NAME`` kept, the rest recomputed in backward).
        groups: per stage, a group id; consecutive recompute (or selective) stages with one id are one
            checkpoint.
        peak_bytes: predicted peak memory of the step (the quantity the budget bounds).
        step_time_s: predicted seconds of one step.
        solver: which planner made the plan.
        solve_time_s: seconds the planner took.
        budget_bytes: the memory budget planned for (None: unconstrained).
        stage_names: readable names of the stages.
        energy_j: predicted joules of one step, when the planner models energy.
        optimality_gap: proven relative gap to the optimum (0.0 exact; None when not known).
        bn_micro_batched: the model has BatchNorm in training mode and the batch is split, so every
            micro-batch normalises with its own statistics (running statistics stay full-batch exact).
        notes: human-readable remarks (why a choice was made, what is approximate).
        metadata: extra numbers (e.g. predicted activation peak, fixed bytes).
        nested_groups: ids of recompute groups run with two-level checkpointing: the group's
            recomputation keeps only its stages' outputs and each stage is recomputed again for its own
            backward (less memory, one more forward of those stages).
    """

    batch_size: int
    micro_batch_size: int
    policies: tuple[str, ...]
    groups: tuple[int, ...]
    peak_bytes: int
    step_time_s: float
    solver: str
    solve_time_s: float = 0.0
    budget_bytes: int | None = None
    stage_names: tuple[str, ...] = ()
    energy_j: float | None = None
    optimality_gap: float | None = None
    bn_micro_batched: bool = False
    notes: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    nested_groups: tuple[int, ...] = ()

    @property
    def num_micro_batches(self) -> int:
        return len(micro_batch_sizes(self.batch_size, self.micro_batch_size))

    @property
    def num_stages(self) -> int:
        return len(self.policies)

    def replace(self, **changes: Any) -> "Plan":
        """A new plan with ``changes``; the metadata dict is copied, never shared (a plan is never mutated)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["metadata"] = dict(self.metadata)
        d.update(changes)
        return Plan(**d)

    def to_json(self) -> str:
        """Serialise to a JSON string (round-trips through :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        for key in ("policies", "groups", "stage_names", "notes", "nested_groups"):
            d[key] = tuple(d.get(key, ()))
        return Plan(**d)

    def summary(self) -> str:
        """A readable table: one row per stage, then the predicted peak, time and energy."""
        names = self.stage_names or tuple(f"stage{i}" for i in range(self.num_stages))
        width = max([len("stage")] + [len(n) for n in names])
        lines = [f"edgetrain plan ({self.solver}, solved in {self.solve_time_s * 1e3:.1f} ms)",
                 f"  batch {self.batch_size} = {self.num_micro_batches} micro-batch(es) of <= "
                 f"{self.micro_batch_size}",
                 f"  {'#':>3}  {'stage':<{width}}  policy     group"]
        for i, (name, pol, grp) in enumerate(zip(names, self.policies, self.groups)):
            mark = " (two-level)" if pol == "recompute" and grp in self.nested_groups else ""
            lines.append(f"  {i:>3}  {name:<{width}}  {pol:<9}  {grp:>5}{mark}")
        budget = "unbounded" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        lines.append(f"  predicted peak {format_bytes(self.peak_bytes)} (budget {budget}), "
                     f"step {self.step_time_s * 1e3:.1f} ms" +
                     ("" if self.energy_j is None else f", {self.energy_j:.3f} J"))
        counts = {p: self.policies.count(p) for p in sorted(set(self.policies))}
        lines.append("  stages: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        if self.optimality_gap is not None:
            lines.append(f"  optimality gap {self.optimality_gap:.2%}")
        if self.bn_micro_batched:
            lines.append("  note: BatchNorm normalises each micro-batch with its own statistics "
                         "(running statistics are still full-batch exact)")
        if self.metadata.get("layout") == "channels_last":
            lines.append("  layout: images fed channels-last")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def plan_from_schedule(chain: CostChain, micro_batch_size: int, policies: Sequence[str],
                       groups: Sequence[int] | None = None, *, solver: str, solve_time_s: float = 0.0,
                       budget_bytes: int | None = None, optimality_gap: float | None = 0.0,
                       notes: Sequence[str] = (), nested_groups: Sequence[int] = ()) -> Plan:
    """Build a :class:`Plan` whose predictions come from :func:`edgetrain.graph.simulate`."""
    groups = tuple(singleton_groups(chain.n) if groups is None else groups)
    m = min(micro_batch_size, chain.batch_size)
    cost = simulate(chain, m, policies, groups, nested_groups)
    return Plan(batch_size=chain.batch_size, micro_batch_size=m, policies=tuple(policies), groups=groups,
                peak_bytes=cost.peak_bytes, step_time_s=cost.step_time_s, solver=solver,
                solve_time_s=solve_time_s, budget_bytes=budget_bytes,
                stage_names=tuple(s.name for s in chain.stages), optimality_gap=optimality_gap,
                notes=tuple(notes), nested_groups=tuple(nested_groups),
                metadata={"activation_peak_bytes": cost.activation_peak_bytes,
                          "fixed_bytes": chain.fixed_bytes,
                          "recompute_time_s": cost.recompute_time_s,
                          "recomputed_stages": sum(p == RECOMPUTE for p in policies)})
