"""A process running several intra-op threads (the default on any multi-core device) gets the same promise as
a single-threaded one: the smallest budget a refusal names trains, in a fresh process, within itself.

prepare's analysis runs in a forked child with one thread (GNU OpenMP cannot start threads in a fork); the
process with more threads used to redo the analysis in itself, and the profiling and validation runs left
8-16 MiB of kernels and heap behind, so that a retry at the named budget was refused again.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

_SCRIPT = r"""
import sys, warnings, torch, edgetrain
from edgetrain.models.zoo import ZOO
warnings.simplefilter("ignore")
torch.set_num_threads(2)
case = ZOO[sys.argv[1]]
model = case.build()
x, y = case.example(16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
try:
    step = edgetrain.prepare(model, opt, case.loss_fn, (x, y), sys.argv[2])
except edgetrain.BudgetError as e:
    print("REFUSED", e.min_feasible_bytes)
    sys.exit()
with edgetrain.measure_peak() as peak:
    for _ in range(2):
        step(x, y)
print("TRAINED", peak.above_baseline_bytes, step.plan.notes)
"""


def _run(model: str, budget: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, model, budget], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "TRAINED"))]
    assert lines, out.stderr[-2000:]
    return lines[-1].split(" ", 2)


def test_the_named_budget_trains_in_a_process_with_two_threads():
    kind, named = _run("bert", "1MiB")[:2]
    assert kind == "REFUSED"
    kind, peak, notes = _run("bert", named)
    assert kind == "TRAINED", f"refused again at the {int(named) / 2**20:.1f} MiB named: {peak}"
    assert int(peak) <= int(named)
    assert "1 intra-op thread" in notes  # the plan says its times are the single-threaded child's


def test_a_refusal_never_names_a_budget_at_or_under_the_one_refused():
    from edgetrain.errors import BudgetError
    from edgetrain.planning.smallest import above_budget

    mib = 2**20
    low, high, higher = (BudgetError(f"named {n}", budget_bytes=160 * mib, min_feasible_bytes=n * mib)
                         for n in (154, 170, 200))
    assert above_budget([higher, high], 160 * mib) is high
    assert above_budget([low, higher, high], 160 * mib) is high  # a way's later runs measured above its 154
    err = above_budget([low], 160 * mib)
    assert err.min_feasible_bytes == 168 * mib and "168.0 MiB" in str(err)
    assert above_budget([low], None) is low
