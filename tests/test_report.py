"""The plan report: a self-contained HTML page with PNGs, measured on a real step that leaves no trace."""

import base64
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.profile import memory
from edgetrain.report import measure_step
from edgetrain.report._curves import planned_timeline
from _models import convnet, mlp


def _room(extra_mib=200):
    """A budget ``extra_mib`` above what this (long-lived test) process already holds above its baseline."""
    return max(0, memory.rss_bytes() - memory.baseline_rss_bytes()) + extra_mib * 2**20


def _step(**kw):
    budget = _room()
    torch.manual_seed(0)
    model = mlp(d=64, n_blocks=6, dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    return edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=budget, **kw), (x, y)


def test_report_html_embeds_figures_writes_pngs_and_leaves_the_model_as_it_was(tmp_path):
    step, batch = _step()
    step(*batch)  # optimizer state exists: the report's step must restore it too
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in step.optimizer.state_dict()["state"][0].items()}
    rng = torch.get_rng_state()
    path = step.report(str(tmp_path / "r.html"), batch=batch, n_points=8)
    assert all(torch.equal(v, before[k]) for k, v in step.model.state_dict().items())
    assert all(torch.equal(v, opt_before[k]) for k, v in step.optimizer.state_dict()["state"][0].items())
    assert torch.equal(torch.get_rng_state(), rng) and step.steps_done == 1
    html = path.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 2 and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    for name in ("r-timeline.png", "r-budget-time.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert html.count('<tr class="keep">') + html.count('<tr class="recompute">') == len(step.plan.policies)
    for label in ("no saving + accumulation", "checkpoint every stage", "Chen sqrt(n)", "checkpoint_sequential",
                  "measured peak", "Energy per step", "Not shown"):
        assert label in html, label
    assert "http" not in html.replace("http-equiv", "")  # self-contained: nothing fetched


def test_measured_timeline_samples_a_real_step():
    step, batch = _step()
    m = measure_step(step, batch)
    # a step of a few ms can leave the 0.5 ms sampler only its first and last reading (GIL, a busy machine)
    assert len(m.times_s) >= 2 and m.peak_bytes > 0 and m.step_time_s > 0
    ts, ms = planned_timeline(step.costs, step.plan)
    assert ts == sorted(ts) and max(ms) <= step.plan.peak_bytes * 1.5 and min(ms) == step.costs.fixed_bytes


def test_paging_plan_gets_the_energy_figure(tmp_path):
    torch.manual_seed(0)
    model = convnet(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,))
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=_room(), paging=True,
                             objective="energy", page_dir=str(tmp_path))
    path = step.report(str(tmp_path / "p.html"), n_points=8)
    html = path.read_text()
    assert (tmp_path / "p-energy.png").exists() and "with paging and with recomputation only" in html
    assert "Not shown" not in html
    step.close()


def test_missing_matplotlib_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import edgetrain\n"
            "from edgetrain.report import write_report\n"
            "try:\n"
            f"    write_report(None, {str(tmp_path / 'x.html')!r})\n"  # fails before it reads the step
            "except edgetrain.ConfigError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR the plan report's figures need matplotlib: pip install 'edgetrain[report]'" in out.stdout, out.stderr
    assert not (tmp_path / "x.html").exists()


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.browser
def test_report_renders_in_headless_chromium(tmp_path):
    """Opt-in (-m browser): the report opened in headless Chromium; the screenshot goes to out/ for a look."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on this machine (apt-get install -y chromium)")
    torch.manual_seed(0)
    model = convnet(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(64, 3, 32, 32), torch.randint(0, 5, (64,)))
    probe = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), batch)
    fixed, plain = probe.costs.fixed_bytes, probe.plan.peak_bytes
    probe.close()
    # a budget between the smallest plan and plain's peak: some stages recomputed
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), batch, memory_budget=int(fixed + 0.6 * (plain - fixed)),
                             name="convnet")
    path = step.report(str(tmp_path / "report.html"), batch=batch)
    shot = tmp_path / "screenshot.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
                           "--window-size=1100,2600", f"--screenshot={shot}", path.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert shot.exists() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        colours = im.convert("RGB").resize((110, 260)).getcolors(maxcolors=100_000)
    assert colours is not None and len(colours) > 50  # figures and tables drawn, not a blank page
    from pathlib import Path

    out = Path(__file__).resolve().parents[1] / "out"
    out.mkdir(exist_ok=True)
    shutil.copy(shot, out / "report-screenshot.png")
