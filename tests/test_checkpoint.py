"""Checkpoints are atomic, resume exactly, and bad files give clear errors."""

import errno
import os

import pytest
import torch
from _models import mlp
from torch import nn

import edgetrain
from edgetrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def _train(model, opt, steps, seed):
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (torch.randn(8, 16), torch.randint(0, 5, (8,))))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        step(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g))


def test_resume_equals_uninterrupted(tmp_path):
    a = mlp()
    b = mlp()
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.Adam(a.parameters(), 1e-2), torch.optim.Adam(b.parameters(), 1e-2)
    _train(a, oa, 4, seed=1)
    _train(b, ob, 2, seed=1)
    save_checkpoint(tmp_path / "ck.pt", b, ob, step=2)
    c = mlp()
    oc = torch.optim.Adam(c.parameters(), 1e-2)
    ck = load_checkpoint(tmp_path / "ck.pt", c, oc)
    assert ck.step == 2
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # replay the data stream up to the checkpoint
        torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    step = edgetrain.prepare(c, oc, nn.CrossEntropyLoss(), (torch.randn(8, 16), torch.randint(0, 5, (8,))))
    for _ in range(2):
        step(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
    for x, y in zip(a.state_dict().values(), c.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = mlp(), None
    path = save_checkpoint(tmp_path / "ck.pt", model, opt, step=1)
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="free disk space"):
        save_checkpoint(path, model, opt, step=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    model = mlp()
    path = save_checkpoint(tmp_path / "ck.pt", model, None, step=3)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path, model)
    save_checkpoint(path, mlp(d=8), None, step=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="different model"):
        load_checkpoint(path, model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", model)
