"""The Trainer trains exactly what a plain PyTorch loop over the same batches trains, and its options act."""

import copy
import csv

import pytest
import torch
from _models import mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import edgetrain
from edgetrain.errors import ConfigError
from edgetrain.trainer import Callback, shuffle_seed


def _data(n=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g))


def _plain_fit(model, opt, sched, ds, epochs, batch, micro, clip=None):
    """The loop a user writes: same shuffle per epoch, accumulation over the same micro-batches."""
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(ds, batch_size=batch, shuffle=True)
    for epoch in range(epochs):
        loader.sampler.generator = torch.Generator().manual_seed(shuffle_seed(0, epoch))
        loader.generator = torch.Generator()  # the workers' base seed: not drawn from the global RNG
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            n = len(y)
            for s in range(0, n, micro):
                xs, ys = x[s:s + micro], y[s:s + micro]
                loss = loss_fn(model(xs), ys)
                (loss if len(ys) == n else loss * (len(ys) / n)).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            opt.step()
            sched.step()


@pytest.mark.parametrize("micro", [None, 4])
def test_trainer_equals_plain_pytorch_loop_bit_for_bit(micro):
    torch.manual_seed(0)
    ref = mlp(dropout=0.2)
    ours = copy.deepcopy(ref)
    ds = _data()
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_o = torch.optim.Adam(ours.parameters(), lr=1e-2)
    sched_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=3, gamma=0.5)
    sched_o = torch.optim.lr_scheduler.StepLR(opt_o, step_size=3, gamma=0.5)
    torch.manual_seed(7)
    _plain_fit(ref, opt_r, sched_r, ds, epochs=2, batch=16, micro=micro or 16, clip=0.5)
    torch.manual_seed(7)
    trainer = edgetrain.Trainer(ours, opt_o, nn.CrossEntropyLoss(), DataLoader(ds, batch_size=16, shuffle=True),
                                scheduler=sched_o, scheduler_interval="step", grad_clip_norm=0.5,
                                prepare_options={"micro_batch_size": micro} if micro else None)
    assert trainer.step.plan.micro_batch_size == (micro or 16)
    history = trainer.fit(2)
    assert [h["step"] for h in history] == [3, 6]
    for (k, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt_o.param_groups[0]["lr"] == opt_r.param_groups[0]["lr"] == pytest.approx(0.0025)


class _Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_step_end(self, trainer, logs):
        self.events.append(("step", logs["step"]))

    def on_eval_end(self, trainer, metrics):
        self.events.append(("eval", round(metrics["val_accuracy"], 6)))

    def on_epoch_end(self, trainer, epoch, logs):
        self.events.append(("epoch", epoch))


def test_evaluation_metrics_callbacks_csv_and_early_stopping(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the validation loss never improves
    rec = _Recorder()
    val = [(torch.randn(10, 16), torch.randint(0, 5, (10,))) for _ in range(2)]
    acc = lambda out, y: (out.argmax(1) == y).float().mean()  # noqa: E731
    trainer = edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), list(DataLoader(_data(24), batch_size=8)), val,
                                metrics={"accuracy": acc}, callbacks=[rec], early_stopping_patience=2,
                                log_dir=str(tmp_path / "logs"), progress=False)
    history = trainer.fit(10)
    assert trainer.stopped_early and len(history) == 3  # best at epoch 0, then 2 evaluations without improvement
    with torch.no_grad():
        expect = sum(float(acc(model(x), y)) * 10 for x, y in val) / 20
    assert history[-1]["val_accuracy"] == pytest.approx(expect)
    assert rec.events[:5] == [("step", 1), ("step", 2), ("step", 3), ("eval", round(expect, 6)), ("epoch", 0)]
    with open(tmp_path / "logs" / "epochs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2] and "val_accuracy" in rows[0]
    with open(tmp_path / "logs" / "steps.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 10))


class _KeywordNet(nn.Module):
    """forward(tokens, mask=None): batches hand it a dict; its frozen embedding is kept in eval mode."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(50, 16), nn.Dropout(0.5))
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, tokens, mask=None):
        h = self.embed(tokens)
        m = torch.ones_like(tokens) if mask is None else mask
        return self.head((h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True))


def test_evaluation_calls_the_model_as_the_step_does_and_keeps_each_modules_mode():
    """Batches whose inputs are a dict are evaluated as they are trained (keyword arguments), and a part the
    user froze in eval mode is still in eval mode after an evaluation."""
    torch.manual_seed(0)
    model = _KeywordNet()
    model.embed.requires_grad_(False).eval()
    g = torch.Generator().manual_seed(3)

    def batch():
        tokens = torch.randint(0, 50, (8, 6), generator=g)
        mask = (torch.rand(8, 6, generator=g) > 0.3).long()
        mask[:, 0] = 1
        return {"tokens": tokens, "mask": mask}, torch.randint(0, 3, (8,), generator=g)

    train, val = [batch() for _ in range(3)], [batch() for _ in range(2)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    trainer = edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), train, val, progress=False)
    history = trainer.fit(2)
    assert not model.embed.training and not model.embed[1].training and model.head.training
    model.eval()
    with torch.no_grad():
        expect = sum(float(nn.functional.cross_entropy(model(**x), y)) * 8 for x, y in val) / 16
    assert history[-1]["val_loss"] == pytest.approx(expect)


def test_evaluation_runs_in_the_steps_micro_batches_with_the_whole_batchs_loss():
    """A validation batch larger than the step's micro-batch runs in slices of that size (a forward at a size
    training never ran built kernels and activations outside the budget: `edgetrain train data=mnist
    memory_budget=80MiB` evaluated to 81.5 MiB after training inside it); the loss is the whole batch's, a
    token-weighted mean included (the slices' ignored targets differ), and metrics are sample-weighted."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    g = torch.Generator().manual_seed(4)
    val = []
    for _ in range(2):
        y = torch.randint(0, 5, (12,), generator=g)
        y[:5] = -100  # the first slice of 4 counts no target at all, the second one
        val.append((torch.randn(12, 16, generator=g), y))
    acc = lambda out, y: (out.argmax(1) == y).float().mean()  # noqa: E731
    trainer = edgetrain.Trainer(model, opt, loss_fn, list(DataLoader(_data(24), batch_size=12)), val,
                                metrics={"accuracy": acc}, prepare_options={"micro_batch_size": 4}, progress=False)
    sizes = []
    handle = model.register_forward_hook(lambda m, a, o: sizes.append(a[0].shape[0]) if not m.training else None)
    metrics = trainer.evaluate()
    handle.remove()
    assert sizes == [4, 4, 4] * 2
    with torch.no_grad():
        counted = sum(int((y != -100).sum()) for _, y in val)
        loss = sum(float(loss_fn(model(x), y)) * int((y != -100).sum()) for x, y in val) / counted
        accuracy = sum(float(acc(model(x), y)) * 12 for x, y in val) / 24
    assert metrics["val_loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["val_accuracy"] == pytest.approx(accuracy)


def test_budget_change_goes_through_the_step_budget_source():
    torch.manual_seed(0)
    model = mlp(n_blocks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(8, 16), torch.randint(0, 5, (8,))) for _ in range(2)]
    trainer = edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), batches, memory_budget="2GiB", progress=False)
    assert trainer.step.budget_source is None
    table = trainer.step.budget_table()
    smallest = table.plans[0]
    trainer.memory_budget = int(table.budgets[0] * 1.5) + 64 * 2**20
    assert trainer.step.budget_source is not None
    trainer.fit(1)
    assert trainer.memory_budget == int(table.budgets[0] * 1.5) + 64 * 2**20
    assert trainer.step.plan.budget_bytes == trainer.memory_budget
    assert smallest.peak_bytes <= trainer.step.plan.peak_bytes


def test_bad_options_are_config_errors():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 16), torch.randint(0, 5, (4,)))]
    with pytest.raises(ConfigError, match="valid: checkpoint_dir"):
        edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), data, checkpoint_evry=3)
    with pytest.raises(ConfigError, match="needs checkpoint_dir"):
        edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), data, resume=True)
    with pytest.raises(ConfigError, match="scheduler_interval"):
        edgetrain.TrainerConfig(scheduler_interval="batch")


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 16), torch.randint(0, 5, (8,))) for _ in range(3)]
    edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), data, data[:1], log_dir=str(tmp_path), tensorboard=True,
                      progress=False).fit(2)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert len(acc.Scalars("epoch/val_loss")) == 2


def test_clipping_moves_old_planning_keywords_with_their_deprecation_warning(monkeypatch):
    """With gradient clipping the Trainer sets fused_update=False itself, moving prepare's old keywords into a
    PlanConfig on the way: they warn as prepare does, and still take effect."""
    from edgetrain import config

    monkeypatch.setattr(config, "_WARNED", set())
    model = mlp()
    loader = DataLoader(_data(), batch_size=8)
    with pytest.warns(DeprecationWarning, match=r"prepare\(solver=\.\.\.\) is deprecated"):
        trainer = edgetrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                    loader, grad_clip_norm=1.0, prepare_options={"solver": "recompute_all"})
    assert trainer.step.plan.solver == "recompute_all"


def _convnet():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def test_an_epochs_short_last_batch_is_run_ahead_and_planned_for():
    """A short last batch runs new tensor shapes, whose kernels stay resident; the plan, validated at the
    example's size, did not hold them (`edgetrain train` on 40 samples in batches of 32 went to 81-82 MiB in
    an 80 MiB budget after the batch of 8). The Trainer runs that size once before training and plans the
    budget again from what the process then holds; training stays exact."""
    g = torch.Generator().manual_seed(2)
    ds = TensorDataset(torch.randn(20, 3, 16, 16, generator=g), torch.randint(0, 4, (20,), generator=g))
    torch.manual_seed(0)
    ref = _convnet()
    ours = copy.deepcopy(ref)
    opt_r, opt_o = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(ours.parameters(), lr=0.05)
    trainer = edgetrain.Trainer(ours, opt_o, nn.CrossEntropyLoss(), DataLoader(ds, batch_size=8, shuffle=True),
                                memory_budget="1GiB", progress=False)
    step = trainer.step
    assert 4 in step.budget.seen_micro  # 20 = 8 + 8 + 4: the 4 ran ahead
    assert step.budget.table is None  # and 1 GiB has room for what it left: the plan stands
    torch.manual_seed(7)
    trainer.fit(2)
    torch.manual_seed(7)
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    for epoch in range(2):
        loader.sampler.generator = torch.Generator().manual_seed(shuffle_seed(0, epoch))
        loader.generator = torch.Generator()
        for x, y in loader:
            opt_r.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ref(x), y).backward()
            opt_r.step()
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
    model = _convnet()
    without = edgetrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                                DataLoader(ds, batch_size=4), memory_budget="1GiB", progress=False)
    assert without.step.budget.seen_micro == {4}  # no short batch: nothing run ahead


def test_a_short_last_batch_without_room_plans_again_or_names_the_budget(monkeypatch):
    """Where what the short batch's first run left does not fit beside the plan, the budget is planned again
    as a budget change is, which refuses before training with the budget that would fit."""
    from edgetrain.adaptation.controller import BudgetController

    g = torch.Generator().manual_seed(2)
    ds = TensorDataset(torch.randn(20, 3, 16, 16, generator=g), torch.randint(0, 4, (20,), generator=g))
    model = _convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), next(iter(DataLoader(ds, batch_size=8))),
                             memory_budget="1GiB")
    readings = iter([0, 2**30])  # the run ahead "leaves" 1 GiB resident
    monkeypatch.setattr(BudgetController, "held", staticmethod(lambda: next(readings, 2**30)))
    with pytest.raises(edgetrain.BudgetError, match="short last batch.*Raise it to at least") as e:
        step.expect_batch_size(4)
    assert e.value.min_feasible_bytes > 2**30
