"""Typed option groups of prepare(), the deprecated keyword arguments, and the renamed plan function."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain import config
from edgetrain.config import PagingConfig, PlanConfig, resolve_legacy


def _mlp_step(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    return edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), **kw)


def test_configs_are_frozen_and_checked():
    cfg = PlanConfig(micro_batch_size=4)
    with pytest.raises(Exception):
        cfg.micro_batch_size = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="micro_batch_size"):
        PlanConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="safety_margin"):
        PlanConfig(safety_margin=0.7)
    with pytest.raises(ValueError, match="objective"):
        PagingConfig(objective="speed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time_budget"):
        PagingConfig(time_budget=0.5)
    # solver=None is the default (it raised AttributeError from deep in prepare: 'NoneType' has no 'startswith')
    assert PlanConfig(solver=None).solver == "dp"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="solver"):
        PlanConfig(solver=3)  # type: ignore[arg-type]


def test_legacy_keywords_map_to_the_groups(monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    with pytest.warns(DeprecationWarning, match=r"planning=edgetrain.PlanConfig\(micro_batch_size=...\)"):
        plan_cfg, paging = resolve_legacy(None, None, {"micro_batch_size": 2, "solver": "chen_sqrt"})
    assert plan_cfg == PlanConfig(micro_batch_size=2, solver="chen_sqrt") and paging is None
    with pytest.warns(DeprecationWarning):
        _, paging = resolve_legacy(None, True, {"page_dir": "/tmp/x", "objective": "energy"})
    assert paging == PagingConfig(directory="/tmp/x", objective="energy", page=True)
    # the old call planned with POET on a time budget alone, recomputing only
    _, paging = resolve_legacy(None, None, {"time_budget": 1.3})
    assert paging == PagingConfig(time_budget=1.3, page=False)
    _, paging = resolve_legacy(PlanConfig(solver="poet-milp"), None, {})
    assert paging == PagingConfig(page=False, solver="poet-milp")


def test_each_legacy_keyword_warns_once(monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            resolve_legacy(None, None, {"max_stages": 8, "use_cache": False})
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 2 and any("max_stages" in m for m in messages)


def test_legacy_keyword_beside_its_group_is_an_error():
    with pytest.raises(TypeError, match="micro_batch_size= beside planning="):
        resolve_legacy(PlanConfig(), None, {"micro_batch_size": 2})
    with pytest.raises(TypeError, match="unexpected keyword"):
        resolve_legacy(None, None, {"micro_batchsize": 2})


def test_options_builds_groups_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = config.options(solver="dp", micro_batch_size=4, paging=False)
    assert opts == {"planning": PlanConfig(micro_batch_size=4), "paging": None}


def test_prepare_old_and_new_calls_give_the_same_plan(monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    new = _mlp_step(planning=PlanConfig(micro_batch_size=2, solver="recompute_all", use_cache=False))
    with pytest.warns(DeprecationWarning):
        old = _mlp_step(micro_batch_size=2, solver="recompute_all", use_cache=False)
    assert new.plan.micro_batch_size == old.plan.micro_batch_size == 2
    assert new.plan.policies == old.plan.policies


def test_plan_is_the_module_and_calling_it_is_deprecated(monkeypatch):
    import edgetrain.plan as m

    assert m.Plan is edgetrain.Plan
    called = {}
    monkeypatch.setattr(edgetrain, "plan_for_device", lambda *a, **k: called.setdefault("args", (a, k)))
    with pytest.warns(DeprecationWarning, match="plan_for_device"):
        edgetrain.plan(1, device="rpi4")
    assert called["args"] == ((1,), {"device": "rpi4"})
