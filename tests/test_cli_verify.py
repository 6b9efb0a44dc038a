"""`edgetrain verify` on the command line: a pass, and a user error as one line."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetrain.cli.main", "verify", *args], capture_output=True, text=True,
                          timeout=600)


def test_verify_command_passes_on_a_recomputed_model():
    proc = _run("--model", "resnet18", "--input-shape", "3,16,16", "--batch-size", "4", "--solver", "recompute_all")
    assert proc.returncode == 0, proc.stderr
    assert "edgetrain verify: PASS" in proc.stdout and "recomputed" in proc.stdout


def test_verify_command_bad_budget_is_one_line():
    proc = _run("--model", "resnet18", "--budget", "12XB")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "12XB" in proc.stderr
