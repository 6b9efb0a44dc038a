"""`edgetrain plan` (issue 17): a cost file is planned with its own costs, --solver is honoured with --device,
and a profiled model is captured the way the paging planners need."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_poet import synth_chain  # noqa: E402

from edgetrain.cli.main import main  # noqa: E402
from edgetrain.devices import load_profile, scale_chain  # noqa: E402
from edgetrain.planners import solve_poet, solve_poet_dp  # noqa: E402
from edgetrain.planners.paging_model import simulate_paged  # noqa: E402


def _mcu_chain():
    """A chain whose times are a Cortex-M4F's (seconds per stage), as a cost file for it would hold."""
    dev = load_profile("nrf52840")
    chain = scale_chain(synth_chain(10, 3, batch=4), None, dev)   # times from FLOPs at the MCU's rate
    keep = simulate_paged(chain, dev, 4, ["keep"] * chain.n)
    return chain, dev, chain.fixed_bytes + int(keep.activation_peak_bytes * 0.5)


def _rows(out: str) -> dict[str, tuple[float, float]]:
    """label -> (step ms, energy J) from the DevicePlans summary."""
    got = {}
    for label, step, energy in re.findall(r"^\s*([\w-]+): peak .*? step\s+([\d.]+) ms\s+energy\s+([\d.]+) J", out,
                                          re.M):
        got[label] = (float(step), float(energy))
    return got


def test_cost_file_is_planned_with_its_own_costs(tmp_path, capsys):
    chain, dev, budget = _mcu_chain()
    path = tmp_path / "mcu.json"
    path.write_text(chain.to_json())
    assert main(["plan", str(path), "--budget", str(budget), "--device", "nrf52840"]) == 0
    rows = _rows(capsys.readouterr().out)
    exact = solve_poet_dp(chain, budget, device=dev)
    assert rows["joint"][1] == pytest.approx(exact.energy_j, rel=1e-3)
    assert rows["joint"][0] == pytest.approx(exact.step_time_s * 1e3, rel=1e-3)
    # asked to, it rescales: costs measured on an rpi4, planned for the MCU
    assert main(["plan", str(path), "--budget", str(budget), "--device", "nrf52840", "--measured-on", "rpi4"]) == 0
    rows = _rows(capsys.readouterr().out)
    scaled = solve_poet_dp(scale_chain(chain, load_profile("rpi4"), dev), budget, device=dev)
    assert rows["joint"][1] == pytest.approx(scaled.energy_j, rel=1e-3)
    assert scaled.energy_j > 10 * exact.energy_j


def test_device_plan_honours_the_solver(tmp_path, capsys):
    chain, dev, budget = _mcu_chain()
    path = tmp_path / "mcu.json"
    path.write_text(chain.to_json())
    assert main(["plan", str(path), "--budget", str(budget), "--device", "nrf52840", "--solver", "poet-milp"]) == 0
    out = capsys.readouterr().out
    assert "poet-milp" in out and "poet-dp" not in out
    milp = solve_poet(chain, budget, device=dev)
    assert _rows(out)["joint"][1] == pytest.approx(milp.energy_j, rel=1e-3)
    assert main(["plan", str(path), "--budget", str(budget), "--device", "nrf52840"]) == 0
    assert "poet-dp" in capsys.readouterr().out
    # a keep/recompute planner runs on the chain as it is for the device
    assert main(["plan", str(path), "--budget", str(budget), "--device", "nrf52840", "--solver", "chen_sqrt"]) == 0
    assert "chen" in capsys.readouterr().out


def test_plan_a_residual_model_for_a_device(capsys):
    # MobileNetV2 has residual blocks: the default capture cuts inside them (carried skip tensors), which the
    # paging model cannot cost; the CLI must capture it as the paging planners need (it used to fail asking
    # for carry_cuts=False, which no flag sets)
    rc = main(["plan", "--model", "mobilenet_v2", "--model-kwargs", '{"num_classes": 10, "width_mult": 0.25}',
               "--input-shape", "3,8,8", "--batch-size", "2", "--budget", "200MiB", "--device", "rpi4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "device rpi4" in out and "joint" in out
