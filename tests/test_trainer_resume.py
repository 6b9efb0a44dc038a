"""Crash-safe resume: runs killed with SIGKILL (at random points, and in the middle of writing a checkpoint)
and resumed end bit-identical to an uninterrupted run; bad checkpoint files fall back to the previous one."""

import logging
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _models import mlp
from torch import nn

import edgetrain
from edgetrain.checkpoint import CheckpointError
from edgetrain.trainer import Callback

CHILD = Path(__file__).with_name("_resume_child.py")


def _run(ck_dir, out, *extra):
    return subprocess.Popen([sys.executable, str(CHILD), str(ck_dir), str(out), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_after(proc, steps, delay_s):
    """SIGKILL ``proc`` ``delay_s`` after it reports optimizer step ``steps``; returns the last step seen."""
    last = 0
    for line in proc.stdout:
        if line.startswith("step "):
            last = int(line.split()[1])
            if last >= steps:
                time.sleep(delay_s)
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    return last


def test_sigkill_at_random_points_and_mid_checkpoint_resumes_bit_exactly(tmp_path):
    ref = _run(tmp_path / "ref", tmp_path / "ref.pt")
    out, err = ref.communicate(timeout=120)
    assert ref.returncode == 0, err[-2000:]

    ck_dir, final = tmp_path / "ck", tmp_path / "final.pt"
    # 1: dies while writing its 2nd checkpoint (after step 6): half the bytes in a temp file
    p = _run(ck_dir, final, 2)
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    assert [f.name for f in ck_dir.iterdir() if f.name.startswith(".")], "no half-written temp file was left"
    rng = random.Random(18)
    kills = []
    # 2, 3: killed at random times mid-epoch (21 steps: 7 per epoch, a checkpoint every 3 steps)
    for _ in range(2):
        steps, delay = rng.randint(2, 6), rng.uniform(0.0, 0.03)
        p = _run(ck_dir, final)
        kills.append((_kill_after(p, steps, delay), round(delay, 3)))
        assert p.returncode == -signal.SIGKILL, p.stderr.read()[-2000:]
    p = _run(ck_dir, final)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(final)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, kills)
    assert len(list(ck_dir.glob("step-*.pt"))) == 2  # keep_checkpoints=2


class _Stop(Callback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, trainer, logs):
        if logs["step"] == self.at:
            raise KeyboardInterrupt


def _trainer(ck_dir, model=None, **kw):
    torch.manual_seed(0)
    model = model or mlp(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 16, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(5)]
    return edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), data, checkpoint_dir=str(ck_dir),
                             checkpoint_every_steps=2, keep_checkpoints=3, progress=False, **kw)


def test_interrupted_in_process_and_resumed_equals_uninterrupted(tmp_path):
    ref = _trainer(tmp_path / "ref")
    ref.fit(2)
    t = _trainer(tmp_path / "ck", callbacks=[_Stop(7)])
    with pytest.raises(KeyboardInterrupt):
        t.fit(2)
    r = _trainer(tmp_path / "ck", resume=True)
    assert (r.state.epoch, r.state.batch_in_epoch, r.state.global_step) == (1, 1, 6)
    r.fit(2)
    for (k, a), b in zip(ref.model.state_dict().items(), r.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert [h["step"] for h in r.history] == [5, 10]


def test_corrupt_truncated_and_foreign_checkpoints_fall_back_to_the_previous(tmp_path, caplog):
    t = _trainer(tmp_path)
    t.fit(1)  # checkpoints after steps 2, 4 and 5 (epoch end)
    files = sorted(tmp_path.glob("step-*.pt"))
    assert [f.name for f in files] == ["step-000000002.pt", "step-000000004.pt", "step-000000005.pt"]
    files[2].write_bytes(files[2].read_bytes()[:300])  # truncated
    files[1].write_bytes(b"\x00garbage" * 100)  # corrupt
    with caplog.at_level(logging.ERROR):
        r = _trainer(tmp_path, resume=True)
    assert r.state.global_step == 2
    msgs = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(msgs) == 2 and all("unreadable" in m and "falling back" in m for m in msgs), msgs
    torch.save({"weight": torch.zeros(3)}, files[2])  # foreign: a plain state dict
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        r = _trainer(tmp_path, resume=True)
    assert r.state.global_step == 2
    assert any("not an edgetrain Trainer checkpoint" in rec.getMessage() for rec in caplog.records)


def test_checkpoint_of_another_model_is_refused_and_model_left_unchanged(tmp_path):
    _trainer(tmp_path).fit(1)
    other = mlp(d=8)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="none of the 3 checkpoints.*different model"):
        _trainer(tmp_path, model=other, resume=True)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_resume_without_checkpoints_starts_afresh(tmp_path):
    r = _trainer(tmp_path / "empty", resume=True)
    assert r.state.global_step == 0
