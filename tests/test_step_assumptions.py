"""What a step assumes about the model, the loss and the batch, checked at prepare or at each step: samples
mixed across the batch in training mode (mixup inside the model), buffers resized or reassigned in the
forward (quantisation-aware training), a loss reading hooked activations, torch.compile'd models, *args
forwards, closure optimizers, parameters unfrozen under a budget, bfloat16 autocast, tensors shared by all
samples."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.errors import InputError

from _semantics import Stack, assert_same_state, plain_step, prepared


class _Mixup(nn.Module):
    """Mixup inside the model, in training mode only: each sample is blended with another of the batch."""

    def __init__(self, mix: bool = True) -> None:
        super().__init__()
        self.mix = mix
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.mix:
            x = 0.7 * x + 0.3 * x[torch.randperm(x.shape[0])]
        return self.b(torch.relu(self.a(x)))


def test_a_model_mixing_samples_in_training_mode_is_never_micro_batched():
    """Eval-mode checks cannot see mixup; micro-batches of 4 mixed within themselves only (4.9e-3 off a
    full-batch step, no error)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match="mixes samples across the batch"):
        prepared(_Mixup(), x, y, micro_batch_size=4)
    model = _Mixup()
    m, step = prepared(model, x, y, solver="recompute_all")  # the batch trained whole, and exactly
    assert step.plan.micro_batch_size == 8
    assert any("mixes samples" in n for n in step.plan.notes)
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain_step(model, x, y), m)
    _, step = prepared(_Mixup(mix=False), x, y, micro_batch_size=4)  # the same model without mixing splits
    assert step.plan.micro_batch_size == 4


def test_random_draws_that_depend_on_the_samples_do_not_count_as_mixing():
    """nn.RReLU draws a slope per negative input, so another second half moves the first half's draws: the
    mixing check cannot conclude and lets the model split, as dropout's own streams do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.RReLU(), nn.Linear(32, 32), nn.RReLU(), nn.Linear(32, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    _, step = prepared(model, x, y, micro_batch_size=4)
    assert step.plan.micro_batch_size == 4


class _LazyStats(nn.Module):
    """Buffers that change shape in the first forward, in place and by reassignment (as quantisation observers
    and lazily sized statistics do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)
        self.register_buffer("peak", torch.tensor([]))
        self.register_buffer("seen", torch.tensor([]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            m = h.detach().amax(0)
            if self.peak.numel() == 0:
                self.peak.resize_(m.shape).copy_(m)
            else:
                self.peak.copy_(torch.maximum(self.peak, m))
            self.seen = torch.cat([self.seen, h.detach().mean().reshape(1)])[-4:]
        return self.b(h)


def test_buffers_resized_or_reassigned_in_the_forward_are_put_back_by_analysis():
    """Analysis restored buffers with copy_, which raised from deep in torch on a buffer the forward had resized
    (quantisation-aware training's observers: 'The size of tensor a (8) must match the size of tensor b (0)')."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    model = _LazyStats()
    m, step = prepared(model, x, y, solver="no_saving")
    assert m.peak.numel() == 0 and m.seen.numel() == 0  # analysis left them as they were
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain_step(model, x, y), m)


def test_quantisation_aware_training_trains_exactly_and_is_never_micro_batched():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
            self.c1, self.c2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.c2(torch.relu(self.c1(self.quant(x)))))
            return self.dequant(self.head(h.mean((2, 3))))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = Net().train()
        net.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
        model = torch.ao.quantization.prepare_qat(net)
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 12, 12), torch.randint(0, 3, (8,))
    for solver in ("no_saving", "recompute_all"):
        m, step = prepared(model, x, y, solver=solver)
        torch.manual_seed(5)
        step(x, y)
        assert_same_state(plain_step(model, x, y), m)
    with pytest.raises(InputError, match="cannot train this model exactly"):
        prepared(model, x, y, micro_batch_size=4)


def test_a_buffer_reassigned_in_the_forward_refuses_micro_batching():
    """Writes were seen by version counters only, so a buffer the forward replaces (``self.seen = ...``) was
    missed and micro-batches would have appended to it once each."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match="seen"):
        prepared(_LazyStats(), x, y, micro_batch_size=4)


def test_a_torch_compiled_model_trains_the_module_it_wraps():
    """prepare(torch.compile(model), ...) failed with advice about dict inputs that the user had not given
    (``OptimizedModule.forward`` takes ``*args``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    compiled = torch.compile(model)
    plain = plain_step(model, x, y)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="torch.compile'd Sequential"):
        step = edgetrain.prepare(compiled, opt, nn.CrossEntropyLoss(), example=(x, y),
                                 planning=edgetrain.PlanConfig(solver="recompute_all"))
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain, model)  # the wrapper's parameters are the module's


def test_a_forward_taking_star_args_is_refused_with_how_to_wrap_it():
    class StarArgs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 3)

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return self.lin(sum(xs))

    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(edgetrain.CaptureError, match=r"wrap it in a module whose forward names them"):
        edgetrain.prepare(StarArgs(), torch.optim.SGD(StarArgs().parameters(), lr=0.1), nn.CrossEntropyLoss(),
                          example=((x, x), y))


def test_an_optimizer_that_needs_a_closure_is_refused_before_any_work():
    model = nn.Linear(16, 3)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match="LBFGS.step needs a closure"):
        edgetrain.prepare(model, torch.optim.LBFGS(model.parameters()), nn.CrossEntropyLoss(), example=(x, y))


def test_a_loss_reading_a_hooked_activation_is_refused_and_one_reading_parameters_is_not():
    """A feature term read from a forward hook made prepare fail in profiling ('Trying to backward through the
    graph a second time'); weight decay written into the loss reads parameters only and trains exactly."""
    torch.manual_seed(0)
    model = Stack()
    feats: dict[str, torch.Tensor] = {}
    model.blocks[1].register_forward_hook(lambda mod, args, out: feats.__setitem__("mid", out))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))

    def feature_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y) + 0.1 * feats["mid"].pow(2).mean()

    with pytest.raises(InputError, match="reads the forward's activations other than through the model's output"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), feature_loss, example=(x, y))

    model = Stack()
    plain = copy.deepcopy(model)

    def decayed(net: nn.Module):
        return lambda out, y: nn.functional.cross_entropy(out, y) + 1e-3 * sum(p.pow(2).sum() for p in net.parameters())

    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    decayed(plain)(plain(x), y).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), decayed(model), example=(x, y),
                                 planning=edgetrain.PlanConfig(solver="recompute_all", micro_batch_size=4))
    step(x, y)
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_unfreezing_parameters_after_a_budgeted_prepare_is_refused():
    """A budgeted plan counts the gradients and saved activations of the parameters trained at prepare; ones
    unfrozen later trained outside the plan (their memory unbudgeted). Without a budget, or freezing more,
    steps go on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    model[0].requires_grad_(False)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budgeted = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y), memory_budget="1GiB")
        free = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y))
    budgeted(x, y)
    model[2].requires_grad_(False)
    budgeted(x, y)  # fewer trained: inside the plan
    model.requires_grad_(True)
    with pytest.raises(InputError, match=r"parameter\(s\) 0.weight, 0.bias now require gradients"):
        budgeted(x, y)
    free(x, y)
    assert model[0].weight.grad is not None


class _Bf16Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(h.float())


def test_a_forward_computing_in_bfloat16_under_autocast_is_micro_batched():
    """The gradient check of a split judged bfloat16 rounding (2.5e-3 relative) by float32 parameters' 1e-3 and
    refused micro-batching as if the loss had a term over the whole batch."""
    torch.manual_seed(0)
    model = _Bf16Body()
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, micro_batch_size=4)
    assert step.plan.micro_batch_size == 4
    step(x, y)
    for a, b in zip(plain.parameters(), m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)


def test_a_tensor_shared_by_all_samples_is_refused_with_the_free_fix():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)) * mask).mean(1)

    model = Masked()
    x, y, mask = torch.randn(8, 10, 16), torch.randint(0, 3, (8,)), torch.ones(1, 10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match=r"some have 1 row, the rest 8.*mask.expand\(8, \*mask.shape\[1:\]\)"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=({"x": x, "mask": mask}, y))
    report = edgetrain.verify(model, opt, nn.CrossEntropyLoss(), ({"x": x, "mask": mask.expand(8, 10, 1)}, y),
                              planning=edgetrain.PlanConfig(micro_batch_size=4))
    assert report.passed and report.micro_batch_size == 4


class _BatchBranch(nn.Module):
    """Halves its activations when the largest of the whole batch is large: a branch on a batch-wide .item()."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.abs().max().item() > 1.5:
            h = h * 0.5
        return self.b(torch.relu(h))


@pytest.mark.parametrize("make, shape", [
    (_BatchBranch, (8, 16)),
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(),
                           nn.Flatten(), nn.Linear(8 * 4 * 4, 3)), (8, 3, 6, 6)),
], ids=["item-branch", "batchnorm-without-running-stats"])
def test_a_forward_mixing_samples_in_eval_mode_is_refused_as_such(make, shape):
    """Such a loss does not split in eval mode either; the refusal used to blame the loss ("neither a mean nor a
    sum ... pass the labels as targets", or its gradients' split), which the user cannot fix, not the forward."""
    torch.manual_seed(0)
    x, y = torch.randn(*shape) * 0.05, torch.randint(0, 3, (8,))
    x[3] *= 200  # the branch is taken for every part of the batch holding this sample, and for no other part
    with pytest.raises(InputError, match=r"mixes samples across the batch") as err:
        prepared(make(), x, y, micro_batch_size=4)
    assert "in eval mode" in str(err.value) and "neither a mean nor a sum" not in str(err.value)


def test_a_loss_that_is_not_a_mean_still_names_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match="neither a mean nor a sum"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          lambda out, t: nn.functional.cross_entropy(out, t) * out.shape[0] ** 0.5, (x, y),
                          planning=edgetrain.PlanConfig(micro_batch_size=4))


def test_lazy_modules_are_refused_until_shaped_then_train_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match=r"0\.weight, 0\.bias, 3\.weight, 3\.bias of a lazy module .* run the model "
                                         r"once on a batch first"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y))
    with torch.no_grad():
        model(x)
    reference = plain_step(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y),  # the optimizer made before the forward
                                 planning=edgetrain.PlanConfig(solver="recompute_all"))
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(reference, model)


class _StatefulLSTM(nn.Module):
    """An LSTM handed its initial state: (num_layers, batch, hidden) as nn.LSTM takes it, or batch-first."""

    def __init__(self, state_batch_first: bool) -> None:
        super().__init__()
        self.state_batch_first = state_batch_first
        self.lstm, self.head = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        if self.state_batch_first:
            h0, c0 = h0.transpose(0, 1).contiguous(), c0.transpose(0, 1).contiguous()
        out, _ = self.lstm(x, (h0, c0))
        return self.head(out[:, -1])


def test_an_rnn_state_with_its_batch_on_dim_1_gets_the_fix_that_works():
    """The advice used to be batch_first=True (which leaves the state as it is) or expanding a one-layer state to
    the batch (wrong); the fix it names now trains, micro-batched, as plain PyTorch's full batch does."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, 8), torch.randint(0, 3, (8,))
    h0, c0 = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    model = _StatefulLSTM(state_batch_first=False)
    with pytest.raises(InputError, match=r"shape \(2, 8, 16\) has the batch of 8 on dim 1.*shape \(8, 2, 16\)"):
        prepared(model, (x, h0, c0), y, micro_batch_size=4)
    with pytest.raises(InputError, match=r"shape \(1, 8, 16\) has the batch of 8 on dim 1"):
        prepared(model, (x, h0[:1], c0[:1]), y)
    fixed = _StatefulLSTM(state_batch_first=True)
    fixed.load_state_dict(model.state_dict())
    inputs = (x, h0.transpose(0, 1).contiguous(), c0.transpose(0, 1).contiguous())
    m, step = prepared(fixed, inputs, y, micro_batch_size=4)
    step(inputs, y)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(reference(x, h0, c0), y).backward()
    opt.step()
    for (name, p), q in zip(reference.named_parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * scale))


def test_a_non_tensor_input_other_than_the_first_steps_is_refused():
    """Traced code holds non-tensor inputs fixed: another value would train with the first."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    m, step = prepared(_Scaled(), {"x": x, "scale": 0.5}, y, solver="recompute_all")
    step({"x": x, "scale": 0.5}, y)
    with pytest.raises(InputError, match=r"non-tensor input\(s\) scale differ from the first step's \(scale=0.5\)"):
        step({"x": x, "scale": 2.0}, y)


def test_micro_batches_never_end_in_one_sample_where_they_can_avoid_it():
    from edgetrain.graph import micro_batch_sizes, run_micro_batch_sizes

    assert run_micro_batch_sizes(8, 4) == [4, 4]
    assert run_micro_batch_sizes(9, 4) == [4, 3, 2]
    assert run_micro_batch_sizes(5, 4) == [3, 2]
    assert run_micro_batch_sizes(7, 3) == [3, 2, 2]
    assert run_micro_batch_sizes(5, 2) == [2, 2, 1]  # no split into pieces of at most 2 avoids it
    assert run_micro_batch_sizes(3, 8) == [3]
    for n in range(1, 40):  # never larger than the cost model's micro-batches, as many of them
        for m in range(1, 12):
            run, model = run_micro_batch_sizes(n, m), micro_batch_sizes(n, m)
            assert sum(run) == n and max(run) <= max(model) and len(run) == len(model)


def test_a_batchnorm1d_model_trains_batches_that_leave_one_sample_over():
    """A tabular MLP with BatchNorm1d, micro-batches of 4: a batch of 9, or a short last batch of 5, ended in a
    micro-batch of one sample and failed in torch ("Expected more than 1 value per channel") where plain
    PyTorch's full batch trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(9, 16), torch.randint(0, 3, (9,))
    m, step = prepared(model, x, y, micro_batch_size=4)
    assert step.plan.bn_micro_batched
    step(x, y)
    step(x[:5], y[:5])
    with pytest.raises(InputError, match=r"this batch is one sample .*drop_last=True"):
        step(x[:1], y[:1])
    m, step = prepared(model, x, y, micro_batch_size=2)
    with pytest.raises(InputError, match=r"batch of 9 leaves a micro-batch of one sample .* micro_batch_size of 3 or "
                                         r"more"):
        step(x, y)


def test_a_zero_dimensional_input_is_refused_with_the_fix():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    with pytest.raises(InputError, match=r"0-dimensional.*as a Python number"):
        prepared(_Scaled(), {"x": x, "scale": torch.tensor(0.5)}, y)
    m, step = prepared(_Scaled(), {"x": x, "scale": 0.5}, y, micro_batch_size=4)
    step({"x": x, "scale": 0.5}, y)


class _TwoViews(nn.Module):
    """One input that is itself a list: two augmented views of each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(64, 3)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = views
        return self.head(torch.cat([self.enc(a), self.enc(b)], 1))


def test_a_list_meant_as_the_forwards_one_input_is_told_how_to_pass_it():
    """``example=([a, b], y)`` binds a and b as two positional inputs of ``forward(views)``; the error said only
    "too many positional arguments ... Pass a tensor, a tuple of positional inputs, or a dict". It now says how to
    pass a list as the one input, and that way trains exactly, micro-batches included."""
    torch.manual_seed(0)
    model = _TwoViews()
    a, b, y = torch.randn(8, 16), torch.randn(8, 16), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(edgetrain.CaptureError, match=r"wrap it in a tuple of one: example=\(\(views,\), targets\)"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=([a, b], y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, opt, nn.CrossEntropyLoss(), (([a, b],), y), tolerance=0.0,
                                  planning=edgetrain.PlanConfig(micro_batch_size=4, solver="recompute_all"))
    assert report.passed and report.micro_batch_size == 4, str(report)


@pytest.mark.parametrize("as_dicts", [False, True])
def test_targets_given_one_entry_per_sample_are_told_to_be_padded(as_dicts):
    """A detection model's boxes come one tensor per image (a list of dicts, as torchvision's detection models take
    them): the sizes disagreed and the message blamed an RNN's initial state on the images' channel dim."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    boxes = [torch.randn(k, 5) for k in (2, 1, 3, 3, 1, 2)]
    targets = [{"boxes": b, "labels": torch.zeros(len(b), dtype=torch.long)} for b in boxes] if as_dicts else boxes
    with pytest.raises(InputError, match=r"list of 6 entries, one per sample .* Pad the entries"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, t: out.sum(),
                          (torch.randn(6, 3, 8, 8), targets))
