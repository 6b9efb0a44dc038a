"""Elastic timing model (issue 20): weight-gradient costs come from static suffixes timed on the real model.

The measuring functions are replaced by a made-up machine with known per-layer costs, so these tests are
deterministic; what they check is how :func:`measure_timing` assembles the samples: the isolated per-layer
phase may run at any load (here 7x slower or faster than the whole-model runs, as on a shared machine),
and the model must still reproduce the whole-model measurements, with no "implausible" warning.
"""

import logging

import pytest
import torch
from torch import nn

import edgetrain.approx.elastic.timing as et
from edgetrain.approx.elastic.measure import ModelRuns


def bn_cnn(chs=(4, 4, 6, 6, 8, 8, 12, 12), classes=5) -> nn.Module:
    """The shape of issue 20's model (8 conv-BN-ReLU blocks, pooling after blocks 2, 4, 6), narrower."""
    layers, c = [], 1
    for i, o in enumerate(chs):
        layers += [nn.Conv2d(c, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]
        if i in (1, 3, 5):
            layers.append(nn.MaxPool2d(2))
        c = o
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


class Machine:
    """Known costs per layer: ``dw[l]`` per tensor of layer ``l``, ``dy[l]`` through it, ``fwd[l]``."""

    def __init__(self, layers, iso_load=1.0, distortion=None):
        self.names = [ly.name for ly in layers]
        self.ntensors = [len(ly.params) for ly in layers]
        m = len(layers)
        self.dw = [[1e-3 * (1 + (i % 3)) * (j + 1) for j in range(n)] for i, n in enumerate(self.ntensors)]
        self.dy = [2e-3 * (1 + (i % 2)) for i in range(m)]
        self.fwd = [1.5e-3 * (1 + (i % 4)) for i in range(m)]
        self.base_fwd, self.base_bwd = 4e-3, 1e-4
        self.iso_load = iso_load               # the isolated phase ran this much slower
        self.distortion = distortion or [1.0] * m   # per-layer error of the isolated numbers
        self.suffix_layers = []

    def dw_from(self, i):
        return sum(sum(w) for w in self.dw[i:])

    def cut(self, i):      # frozen model cut at layer i's output: graph and input gradients above it
        return (self.base_fwd + sum(self.fwd[i + 1:]), self.base_bwd + sum(self.dy[i + 1:]))

    def time_layers(self, layers, repeats):
        k = self.iso_load
        return [(k * d * self.fwd[i], [k * d * w for w in self.dw[i]], k * d * self.dy[i])
                for i, d in enumerate(self.distortion)]

    def time_model(self, model, batch, loss_fn, params, cuts, repeats, suffixes=None):
        idx = [self.names.index(ly.name) for ly in cuts]
        full = (self.base_fwd + sum(self.fwd), self.base_bwd + sum(self.dy[1:]) + self.dw_from(0))
        self.suffix_layers = [i for i, s in zip(idx, suffixes) if s is not None]
        for i, s in zip(idx, suffixes):     # each suffix is every tensor from its cut's layer up
            assert s is None or len(s) == sum(self.ntensors[i:])
        return ModelRuns(full, [self.cut(i) for i in idx],
                         [self.dw_from(i) if s is not None else None for i, s in zip(idx, suffixes)])

    def install(self, monkeypatch):
        monkeypatch.setattr(et, "time_layers", self.time_layers)
        monkeypatch.setattr(et, "time_model", self.time_model)
        monkeypatch.setattr(et, "time_updates", lambda *a, **k: (0.0, 0.0, 0.0))


def _measure(model, max_suffixes):
    batch = (torch.randn(8, 1, 12, 12), torch.randint(0, 5, (8,)))
    return et.measure_timing(model, batch, nn.CrossEntropyLoss(), None, repeats=1, cut_repeats=1,
                             max_cuts=24, max_suffixes=max_suffixes, use_cache=False)


@pytest.mark.parametrize("iso_load", [7.0, 1.0, 1 / 7])
def test_isolated_phase_load_does_not_change_the_model(monkeypatch, caplog, iso_load):
    model = bn_cnn()
    layers = et.capture_layers(model, (torch.randn(8, 1, 12, 12), torch.randint(0, 5, (8,))),
                               nn.CrossEntropyLoss())
    machine = Machine(layers, iso_load=iso_load)
    machine.install(monkeypatch)
    with caplog.at_level(logging.WARNING):
        t = _measure(model, max_suffixes=3)
    assert "implausible" not in caplog.text
    assert len(machine.suffix_layers) == 3
    truth = [w for ws in machine.dw for w in ws]
    # isolated times right up to the phase's load: every tensor's weight gradient is exact
    assert t.weight_grad_s == pytest.approx(truth, rel=1e-9)
    # and so is every static suffix's predicted step (without update costs)
    firsts = [t.layers.index(n) for n in machine.names]
    for i, k in enumerate(firsts):
        fwd, bwd = machine.cut(i)
        want = fwd + bwd + machine.dw_from(i)
        assert t.step_time_s(list(range(k, len(t.names)))) == pytest.approx(want, rel=1e-6)


def test_distorted_isolated_times_still_match_every_timed_suffix(monkeypatch):
    # isolated numbers that are wrong per layer (by up to 4x, differently for each) only misplace time
    # between two timed suffixes; at the timed suffixes themselves the model equals the measurement
    model = bn_cnn()
    layers = et.capture_layers(model, (torch.randn(8, 1, 12, 12), torch.randint(0, 5, (8,))),
                               nn.CrossEntropyLoss())
    distortion = [(0.25, 1.0, 4.0, 2.0)[i % 4] for i in range(len(layers))]
    machine = Machine(layers, iso_load=3.0, distortion=distortion)
    machine.install(monkeypatch)
    t = _measure(model, max_suffixes=4)
    truth = [w for ws in machine.dw for w in ws]
    assert t.weight_grad_s != pytest.approx(truth, rel=1e-3)      # the distortion does show between cuts
    assert sum(t.weight_grad_s) == pytest.approx(sum(truth), rel=1e-9)
    for i in machine.suffix_layers:
        k = t.layers.index(machine.names[i])
        assert sum(t.weight_grad_s[k:]) == pytest.approx(machine.dw_from(i), rel=1e-9)


def test_suffix_weight_grads_interpolates_and_extrapolates():
    iso = [1.0, 1.0, 2.0, 0.0, 4.0]
    # measured: from layer 1 up 6 s, from layer 3 up 2 s: segment [1, 3) holds 4 s split 1:2, layers 3-4
    # hold 2 s split 0:4, and layer 0 (deeper than every cut) scales like the deepest cut (6 / 7)
    got = et._suffix_weight_grads(iso, {1: 6.0, 3: 2.0})
    assert got == pytest.approx([6 / 7, 4 / 3, 8 / 3, 0.0, 2.0])
    # a noisy deeper suffix measured cheaper than a shallower one: deeper costs at least as much
    assert et._suffix_weight_grads([1.0, 1.0], {0: 1.0, 1: 3.0}) == pytest.approx([0.0, 3.0])
