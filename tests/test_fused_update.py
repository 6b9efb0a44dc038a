"""The optimizer update fused into the backward (runtime.fused): bit-exact for every supported optimizer, with
the state resident or paged per parameter, safe where a re-run stage reads a parameter after its gradient is
complete, refused clearly where it cannot be exact, and chosen by the planner where it fits a budget that
holding the gradients does not."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.capture import capture
from edgetrain.config import PlanConfig
from edgetrain.errors import InputError
from edgetrain.planning.analysis import FUSED_KEY
from edgetrain.runtime.fused import FusedUpdate, deferred, shared_parameters, unsupported
from edgetrain.runtime.optstate import OptimizerStatePager

transformers = pytest.importorskip("transformers")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
}


def _bert_mlm() -> nn.Module:
    """A masked language model whose output layer shares the word embeddings (one parameter, two uses)."""
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).train()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    return model


def _mlm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _tokens(n: int = 4):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 300, (n, 12), generator=g), torch.randint(0, 300, (n, 12), generator=g)


def _states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) if isinstance(sa[i][k], torch.Tensor) else sa[i][k] == sb[i][k]
        for i in sa for k in sa[i])


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_update_is_bit_exact_for_each_supported_optimizer(name, paged, tmp_path):
    model = _bert_mlm()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    pager = OptimizerStatePager(opt, tmp_path, min_bytes=1024) if paged else None
    assert unsupported(opt, pager) is None
    fused = FusedUpdate(opt, pager)
    x, y = _tokens()
    for _ in range(3):
        torch.manual_seed(7)
        ref_opt.zero_grad(set_to_none=True)
        _mlm_loss(ref(x), y).backward()
        ref_opt.step()
        torch.manual_seed(7)
        opt.zero_grad(set_to_none=True)
        if pager is not None:
            pager.page_out()
        with fused.armed():
            _mlm_loss(model(x), y).backward()
        assert all(p.grad is None for p in model.parameters())  # each freed right after its update
        assert fused.stepped == sum(1 for p in model.parameters() if p.requires_grad)
    if pager is not None:
        assert pager.paged_out and pager.stats.written_bytes > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert _states_equal(opt, ref_opt)  # state_dict() reads a paged state back first
    if pager is not None:
        pager.close()


def test_armed_refuses_gradients_left_from_before():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="zero_grad"), FusedUpdate(opt).armed():
        pass


def test_unsupported_names_what_rules_the_fused_update_out():
    ps = [nn.Parameter(torch.randn(3))]

    class MySGD(torch.optim.SGD):
        pass

    assert "MySGD is not one of" in unsupported(MySGD(ps, lr=0.1))
    assert "LBFGS" in unsupported(torch.optim.LBFGS(ps))
    assert "differentiable" in unsupported(torch.optim.SGD(ps, lr=0.1, differentiable=True))
    hooked = torch.optim.SGD(ps, lr=0.1)
    hooked.register_step_post_hook(lambda *a: None)
    assert "step hooks" in unsupported(hooked)
    paged = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    pager = OptimizerStatePager(paged)
    try:
        assert unsupported(paged, pager) is None  # the state pager's own hooks do not count
    finally:
        pager.close()


class DetachReader(nn.Module):
    """Reads ``b.weight`` without a gradient (an alias, saved for the input's gradient) a stage before ``b`` uses
    it: a re-run of that stage after ``b``'s backward must see the weight before this step's update."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        h = F.linear(torch.tanh(self.a(x)), self.b.weight.detach())
        return self.c(torch.tanh(self.b(h)))


def test_a_parameter_a_rerun_stage_reads_is_updated_after_the_backward():
    torch.manual_seed(0)
    model = DetachReader()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    chain = capture(model, x[:2])
    shared = shared_parameters(chain)
    assert list(shared) == [id(model.b.weight)] and len(shared[id(model.b.weight)]) == 2
    assert deferred(chain) == {id(model.b.weight)}

    def run(defer_shared: bool):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        step = edgetrain.prepare(m, opt, F.cross_entropy, (x, y), memory_budget="2GiB",
                                 planning=PlanConfig(solver="recompute_all", fused_update=True, use_cache=False))
        assert FUSED_KEY in step.plan.metadata and set(step.plan.policies) == {"recompute"}
        if not defer_shared:
            step.fused.defer = set()
        for _ in range(2):
            step(x, y)
        return m

    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    good = run(True)
    assert all(torch.equal(p, q) for p, q in zip(good.parameters(), ref.parameters()))
    bad = run(False)  # what deferring prevents: the re-run reads the updated weight
    assert not all(torch.equal(p, q) for p, q in zip(bad.parameters(), ref.parameters()))


def _bert_cls() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def _cls_loss(out, y):
    return F.cross_entropy(out.logits, y)


def _train_alike(step, ref, ref_opt, x, y, steps, grads_dropped=False):
    """``steps`` steps of ``step`` and of plain PyTorch on ``ref``: the same losses and parameters, bit for bit
    (``grads_dropped``: the fused update left no gradient on the step's model)."""
    for _ in range(steps):
        torch.manual_seed(3)
        loss = step(x, y)
        torch.manual_seed(3)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = _cls_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == ref_loss.item()
        if grads_dropped:
            assert all(p.grad is None for p in step.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(step.model.parameters(), ref.parameters()))


def test_prepare_with_the_fused_update_trains_as_plain_pytorch_and_reuses_its_plan():
    model = _bert_cls()
    ref = copy.deepcopy(model)
    again = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 300, (8, 12), generator=g), torch.randint(0, 3, (8,), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = edgetrain.prepare(model, opt, _cls_loss, (x, y), memory_budget="1GiB",
                             planning=PlanConfig(fused_update=True, use_cache=False))
    assert step.plan.metadata.get(FUSED_KEY) is True and step.fused is not None
    assert any("fused into the backward" in n for n in step.plan.notes)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train_alike(step, ref, ref_opt, x, y, 3, grads_dropped=True)
    assert _states_equal(opt, ref_opt)

    # a plan kept from that step (a federated client's next round) runs fused again, without planning
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    reused = edgetrain.prepare(again, opt2, _cls_loss, (x, y), memory_budget="1GiB", plan=step.plan, costs=step.costs,
                               planning=PlanConfig(fused_update=True, use_cache=False))
    assert reused.fused is not None
    with pytest.raises(InputError, match="fused"):
        edgetrain.prepare(copy.deepcopy(again), torch.optim.AdamW(again.parameters(), lr=1e-3), _cls_loss, (x, y),
                          memory_budget="1GiB", plan=step.plan, costs=step.costs,
                          planning=PlanConfig(fused_update=False, use_cache=False))


def test_a_step_that_must_act_on_gradients_is_not_fused():
    model = _bert_cls()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 300, (8, 12), generator=g), torch.randint(0, 3, (8,), generator=g)

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(InputError, match="MyAdam is not one of"):
        edgetrain.prepare(model, MyAdam(model.parameters()), _cls_loss, (x, y), memory_budget="1GiB",
                          planning=PlanConfig(fused_update=True, use_cache=False))
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _cls_loss, (x, y),
                             memory_budget="1GiB", planning=PlanConfig(fused_update=True, use_cache=False))
    step.before_optimizer_step = lambda: None  # e.g. clipping: needs every gradient before the update
    with pytest.raises(InputError, match="fused_update=False"):
        step(x, y)
    trainer = edgetrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cls_loss, [(x, y)],
                                memory_budget="1GiB", grad_clip_norm=1.0,
                                prepare_options={"planning": PlanConfig(fused_update=True, use_cache=False)})
    assert trainer.step.fused is None and FUSED_KEY not in trainer.step.plan.metadata


class FailingBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if FailingBackward.armed:
            raise RuntimeError("backward failed")
        return g


class EarlyFailure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(FailingBackward.apply(self.a(x))))


def test_a_backward_that_fails_after_some_updates_says_so():
    torch.manual_seed(0)
    model = EarlyFailure()
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, (x, y),
                             memory_budget="1GiB", planning=PlanConfig(fused_update=True, use_cache=False))
    assert step.fused is not None
    FailingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="backward failed") as info:
            step(x, y)
    finally:
        FailingBackward.armed = False
    assert step.fused.stepped == 2  # b's weight and bias, updated before the failure reached a
    assert any("restore it from the last checkpoint" in n for n in getattr(info.value, "__notes__", []))


_CHILD = """
import json, sys
import torch, torch.nn.functional as F, transformers
import edgetrain
from edgetrain.config import PlanConfig
budget, fused = sys.argv[1], {"auto": "auto", "1": True, "0": False}[sys.argv[2]]
cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 512], depths=[1, 1, 1, 2],
                                layer_type="basic", num_labels=10)
torch.manual_seed(0)
model = transformers.ResNetForImageClassification(cfg).train()
g = torch.Generator().manual_seed(4)
x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
loss = lambda out, t: F.cross_entropy(out.logits, t)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
try:
    step = edgetrain.prepare(model, opt, loss, (x, y), memory_budget=int(budget),
                             planning=PlanConfig(fused_update=fused, use_cache=False))
except edgetrain.BudgetError as e:
    print(json.dumps({"min_feasible": e.min_feasible_bytes}))
    sys.exit(0)
torch.manual_seed(0)
ref = transformers.ResNetForImageClassification(cfg).train()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
for _ in range(2):
    step(x, y)
    ref_opt.zero_grad(set_to_none=True)
    loss(ref(x), y).backward()
    ref_opt.step()
same = all(torch.equal(p, q) for p, q in zip(list(model.parameters()) + list(model.buffers()),
                                              list(ref.parameters()) + list(ref.buffers())))
print(json.dumps({"peak": step.plan.peak_bytes, "fused": step.fused is not None, "same": same,
                  "keep": step.plan.policies.count("keep"), "micro": step.plan.micro_batch_size}))
"""


def _child(budget: int, fused: str) -> dict:
    """prepare() and two steps of a small Hugging Face ResNet (most parameters in its last stage, as a
    ResNet's are) in a fresh process, so that each plan's peak is measured from the same start."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(budget), fused], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_planner_fuses_the_update_where_holding_the_gradients_needs_more_recomputation():
    """At a budget between the two ways' keep-everything peaks, "auto" fuses the update into the backward
    and keeps more than holding the gradients can; the steps are exact either way."""
    held = _child(2**32, "0")
    fused = _child(2**32, "1")
    assert held["same"] and fused["same"] and fused["fused"] and not held["fused"]
    assert fused["peak"] < held["peak"] - 8 * 2**20  # 28.6 MiB of gradients, as much momentum paged out
    budget = int((held["peak"] + fused["peak"]) / 2 / 0.97)  # the safety margin (3%) comes off the budget
    auto, plain = _child(budget, "auto"), _child(budget, "0")
    assert auto["fused"] and auto["same"] and auto["peak"] <= budget
    if "min_feasible" in plain:  # holding the gradients fits no plan at all there
        assert plain["min_feasible"] > budget
    else:
        assert plain["same"] and not plain["fused"] and (auto["keep"] > plain["keep"] or plain["micro"] < 16)


def test_verify_and_trained_parameters_see_a_fused_step():
    """verify() compares each gradient as it was completed; trained_parameters() names the parameters a fused
    step updated (a federated client masks its reply with them), frozen ones excluded."""
    model = _bert_cls()
    model.bert.embeddings.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 300, (8, 12), generator=g), torch.randint(0, 3, (8,), generator=g)
    opts = {"planning": PlanConfig(fused_update=True, use_cache=False)}
    report = edgetrain.verify(model, torch.optim.Adam(model.parameters(), 1e-3), _cls_loss, (x, y), "1GiB", **opts)
    assert report.passed, str(report)
    assert any("fuses the optimizer update" in n for n in report.notes)
    assert report.gradients.relative == 0.0
    step = edgetrain.prepare(model, torch.optim.Adam(model.parameters(), 1e-3), _cls_loss, (x, y), "1GiB", **opts)
    step(x, y)
    trained = {id(p) for p in step.trained_parameters()}
    assert trained == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any(id(p) in trained for p in model.bert.embeddings.parameters())


def test_the_state_pager_moves_one_parameters_state_and_stays_out_of_a_fused_step(tmp_path):
    a, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.Adam([a, b], lr=1e-2)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    want = {k: v.clone() for k, v in opt.state[a].items()}
    pager = OptimizerStatePager(opt, tmp_path, min_bytes=1024)
    try:
        pager.page_out()
        assert pager.page_in_params([a]) == 2 * 64 * 64 * 4  # exp_avg and exp_avg_sq
        assert all(torch.equal(opt.state[a][k], want[k]) for k in want)
        assert opt.state[b]["exp_avg"].is_meta  # b's stays out
        pager.page_out_params([a])
        assert opt.state[a]["exp_avg"].is_meta
        with pager.muted():
            opt.param_groups[0]["params"], kept = [], opt.param_groups[0]["params"]
            opt.step()  # no parameter to update: inside muted() the hook must not read everything back
            opt.param_groups[0]["params"] = kept
            assert opt.state[a]["exp_avg"].is_meta and opt.state[b]["exp_avg"].is_meta
        opt.step()  # outside, the step hook reads the state back first
        assert not pager.paged_out
    finally:
        pager.close()


def test_the_cli_reads_fused_update():
    from edgetrain.cli.train_config import load_train_config
    from edgetrain.errors import ConfigError

    for given, read in (("auto", "auto"), ("true", True), ("false", False)):
        assert load_train_config(None, {"fused_update": given}).fused_update == read
    with pytest.raises(ConfigError, match="fused_update must be auto, true or false"):
        load_train_config(None, {"fused_update": "sometimes"})


def test_the_smallest_budget_named_counts_the_fused_update_and_a_retry_there_fits():
    """A budget too small for any plan names the smallest of every way's minimum, the fused update's
    measured at the whole batch; prepare at the named budget then fits (exact steps)."""
    low = 64 * 2**20
    held = _child(low, "0")
    auto = _child(low, "auto")
    assert "min_feasible" in held and "min_feasible" in auto
    assert auto["min_feasible"] < held["min_feasible"]  # the fused update's minimum is the smaller
    again = _child(auto["min_feasible"], "auto")
    assert again.get("same") and again["fused"] and again["peak"] <= auto["min_feasible"]


@pytest.mark.parametrize("slow", [True, False])
def test_a_way_of_holding_the_state_whose_validated_plan_is_far_slower_has_the_others_run_too(monkeypatch, slow):
    """The ways of holding the optimizer state and the gradients are ordered by the cost model before any run.
    MobileNetV2 at 80 MiB (edgetrain train data=mnist) validated micro-batches of 2 with the state paged (1157 ms)
    in 2 runs of 4 and took them, where the update fused into the backward, tried next, fitted the whole batch
    (220 ms); with a rule of 1.5x, micro-batches of 8 (210 ms, 1.49x) where the fused update fits the whole batch at
    148 ms. Here the way tried first is made to validate a plan 1.4x slower than its model's: the fused way is
    then run too, and taken as the faster; a first way that validates at its model's speed stands alone."""
    from edgetrain.planning.analysis import Analysis
    from edgetrain.planning.planner import Planner

    validate = Planner.plan_validated

    def validated(self, *args, **kwargs):
        plan, costs = validate(self, *args, **kwargs)
        if slow and not self.whole_batch_only:  # the update after the backward (the fused way: whole batch only)
            plan = plan.replace(step_time_s=plan.step_time_s * 1.4)
        return plan, costs

    monkeypatch.setattr(Planner, "plan_validated", validated)
    monkeypatch.setattr(Analysis, "_state_modes", lambda self, planner_for: [(False, False), (False, True)])
    model = _bert_cls()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 300, (8, 12), generator=g), torch.randint(0, 3, (8,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = edgetrain.prepare(model, opt, _cls_loss, (x, y), memory_budget="1GiB",
                             planning=PlanConfig(fused_update="auto", page_optimizer_state=False, use_cache=False))
    assert (step.fused is not None) == slow
    _train_alike(step, ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), x, y, 2)
