"""Smoke tests of bench/elastic_curve.py's parts (issue 20): the static suffixes, interleaved timing, targets."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import elastic_curve as ec  # noqa: E402


def test_bn_cnn_is_the_issues_model_and_its_suffixes_nest():
    m = ec.BnCnn(5)
    convs = [b.conv for b in m.features]
    assert len(convs) == 8 and [c.out_channels for c in convs] == [48, 48, 96, 96, 144, 144, 192, 192]
    assert m(torch.randn(2, 1, ec.SIZE, ec.SIZE)).shape == (2, 5)
    task = ec.CurveTask("bncnn", "", m, None, torch.zeros(0), torch.zeros(0))
    suffixes = task.suffix_names(m)
    names = [n for n, _ in m.named_parameters()]
    sizes = [len(v) for v in suffixes.values()]
    assert sizes == sorted(sizes) and sizes[0] == 2 and len(set(sizes)) == len(sizes)
    for v in suffixes.values():                      # every suffix is a tail of the forward order
        assert v == names[len(names) - len(v):]


def test_hf_vit_suffixes_follow_the_layers():
    pytest.importorskip("transformers")
    m = ec.HfVit(5)
    assert m(torch.randn(2, 1, ec.SIZE, ec.SIZE)).shape == (2, 5)
    task = ec.CurveTask("vit", "", m, None, torch.zeros(0), torch.zeros(0))
    suffixes = task.suffix_names(m)
    assert list(suffixes)[:2] == ["head only", "final norm + head"]
    assert suffixes["head only"] == ["m.classifier.weight", "m.classifier.bias"]
    names = [n for n, _ in m.named_parameters()]
    layer2 = suffixes["from layer 2"]
    assert layer2 == names[len(names) - len(layer2):] and not any(n.startswith("m.vit.layers.0.") for n in layer2)
    assert any(n.startswith("m.vit.layers.1.") for n in layer2)


def test_interleaved_curve_times_every_configuration():
    m = ec.BnCnn(5, chs=(4, 4, 4, 4, 4, 4, 4, 4))
    names = [n for n, _ in m.named_parameters()]
    batch = (torch.randn(4, 1, ec.SIZE, ec.SIZE), torch.randint(0, 5, (4,)))
    speed = ec.interleaved_curve(m, batch, {"head": names[-2:], "all": names}, rounds=2)
    assert set(speed) == {"head", "all"} and all(v > 0 and math.isfinite(v) for v in speed.values())
    assert all(p.requires_grad for p in m.parameters())      # the caller's model is not touched


def test_curve_targets_flag_misses():
    ok = dict(requested=2.0, measured=1.9, acc=0.95, rival="from block 6", rival_acc=0.955, rival_speed=2.1)
    bad = dict(requested=2.0, measured=3.06, acc=0.967, rival="from block 6", rival_acc=0.985, rival_speed=3.1)
    lines = ec.curve_targets("bncnn", {"elastic 2x": ok}, 1)
    assert len(lines) == 2 and all("ok:" in ln and "MISSED" not in ln for ln in lines)
    lines = ec.curve_targets("bncnn", {"elastic 2x": bad}, 1)      # the issue's own figures
    assert all("MISSED" in ln for ln in lines)


def test_curve_targets_check_every_seeds_speed_and_the_mean_accuracy():
    v = dict(requested=1.5, measured=1.45, acc=0.540, rival="from layer 4", rival_acc=0.545, rival_speed=1.5,
             measured_each=[1.45, 1.75, 1.20], seeds=3, diffs=[0.01, -0.02, -0.005])
    speed, accuracy = ec.curve_targets("vit", {"elastic 1.5x": v}, 1)
    assert "1.20x vs requested" in speed and "MISSED" in speed       # the worst seed (20% off) misses
    assert "mean over 3 seeds" in accuracy and "+1.0 -2.0 -0.5" in accuracy and "MISSED" not in accuracy
    v["measured_each"] = [1.45, 1.55, 1.60]
    assert "MISSED" not in ec.curve_targets("vit", {"elastic 1.5x": v}, 1)[0]
