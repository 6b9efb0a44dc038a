"""Smoke tests of bench/bench_adapt.py's pure parts: the synthetic chains and the re-planning table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _common  # noqa: E402
import bench_adapt as ba  # noqa: E402

from edgetrain.graph import KEEP, simulate  # noqa: E402


def test_synthetic_chain_is_deterministic_and_sized_like_cnn_stages():
    a, b = ba.synthetic_chain(20, 3), ba.synthetic_chain(20, 3)
    assert a == b and a.n == 20
    keep = simulate(a, a.batch_size, [KEEP] * a.n)
    assert keep.activation_peak_bytes > 20 * a.batch_size * 50_000  # every stage saves >= 50 kB a sample


def test_replan_table_row_reports_lookup_under_10_ms():
    table = _common.Table("t", ["chain", "stages", "table budgets", "build s", "lookup us (median)", "under 10 ms"])
    ba.bench_table(ba.synthetic_chain(12, 0), "synthetic", table, quick=True)
    (row,) = table.rows
    assert row[0] == "synthetic" and row[1] == "12" and int(row[2]) >= 2
    assert float(row[4]) < 10_000 and row[5] == "yes"
