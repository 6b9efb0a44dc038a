"""A prepared step computes exactly what plain PyTorch computes on the same logical batch."""

import copy
import warnings

import pytest
import torch
from _models import convnet, mlp
from torch import nn

import edgetrain
from edgetrain.runtime.batchnorm import FullBatchStats


def plain_step(model, opt, loss_fn, x, y, seed):
    torch.manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_state_close(a: nn.Module, b: nn.Module, rtol: float, atol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if rtol == 0 and atol == 0:
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=atol, msg=k)


def twins(make, opt_cls=torch.optim.SGD, **opt_kw):
    ref = make()
    ours = copy.deepcopy(ref)
    return ref, opt_cls(ref.parameters(), **opt_kw), ours, opt_cls(ours.parameters(), **opt_kw)


@pytest.mark.parametrize("solver,micro", [("recompute_all", None), ("chen_sqrt", None), ("no_saving", 5),
                                          ("recompute_all", 7)])
def test_no_batchnorm_matches_full_batch(solver, micro):
    ref, opt_r, ours, opt_o = twins(lambda: mlp(dropout=0.0), torch.optim.Adam, lr=1e-2)
    x, y = torch.randn(24, 16), torch.randint(0, 5, (24,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), solver=solver, micro_batch_size=micro)
    assert step.plan.micro_batch_size == (micro or 24)
    for i in range(3):
        xb, yb = torch.randn(24, 16), torch.randint(0, 5, (24,))
        lr = plain_step(ref, opt_r, loss_fn, xb, yb, i)
        lo = step(xb, yb)
        assert lo == pytest.approx(lr, rel=1e-5)
    assert_state_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_dropout_replayed_under_recomputation():
    ref, opt_r, ours, opt_o = twins(lambda: mlp(dropout=0.3), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 16), torch.randint(0, 5, (16,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), solver="recompute_all")
    assert "recompute" in step.plan.policies
    for i in range(3):
        lr = plain_step(ref, opt_r, loss_fn, x, y, i)
        torch.manual_seed(i)
        lo = step(x, y)
        assert lo == lr
    assert_state_close(ours, ref, rtol=0)


def test_batchnorm_without_micro_batching_is_identical():
    ref, opt_r, ours, opt_o = twins(convnet, lr=0.05, momentum=0.9)
    x, y = torch.randn(12, 3, 16, 16), torch.randint(0, 5, (12,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), solver="recompute_all")
    assert step.plan.num_micro_batches == 1 and not step.plan.bn_micro_batched
    for i in range(3):
        lr = plain_step(ref, opt_r, loss_fn, x, y, i)
        torch.manual_seed(i)
        assert step(x, y) == lr
    assert_state_close(ours, ref, rtol=0)  # running statistics and num_batches_tracked included


def test_batchnorm_micro_batched_running_stats_are_full_batch():
    """One update per step from the statistics of the whole logical batch, not one per micro-batch.

    Layers after the first see inputs normalised per micro-batch, so the reference for them is the
    full-batch statistics of the inputs they actually saw; the first layer's input is the raw batch,
    so it must also equal a plain full-batch forward.
    """
    ref, _, ours, opt_o = twins(convnet, lr=0.0)
    ours.eval()
    ours[6].train(False)  # dropout off, BatchNorm layers below back to training
    for i in (1, 4, 8):
        ours[i].train()
    x, y = torch.randn(20, 3, 16, 16), torch.randint(0, 5, (20,))
    with pytest.warns(UserWarning, match="micro-batch"):
        step = edgetrain.prepare(ours, opt_o, nn.CrossEntropyLoss(), (x, y), solver="recompute_all",
                                 micro_batch_size=6)
    assert step.plan.bn_micro_batched and step.plan.num_micro_batches == 4
    seen = {i: [] for i in (1, 4, 8)}
    hooks = [ours[i].register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach().clone()))
             for i in seen]
    before = {i: (ours[i].running_mean.clone(), ours[i].running_var.clone(), int(ours[i].num_batches_tracked))
              for i in seen}
    step(x, y)
    for h in hooks:
        h.remove()
    for i, xs in seen.items():
        # per micro-batch: the forward, then (where the recomputed stage's replay reaches the layer; a lean
        # BatchNorm at a stage's end stops it earlier) the replay in backward, on the same input
        firsts = [t for j, t in enumerate(xs) if j == 0 or not torch.equal(t, xs[j - 1])]
        inp = torch.cat(firsts)
        assert inp.shape[0] == 20
        mean = inp.mean(dim=(0, 2, 3))
        var = inp.var(dim=(0, 2, 3), unbiased=True)
        bn = ours[i]
        mom = bn.momentum if bn.momentum is not None else 1.0 / (before[i][2] + 1)
        torch.testing.assert_close(bn.running_mean, (1 - mom) * before[i][0] + mom * mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, (1 - mom) * before[i][1] + mom * var, rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked) == before[i][2] + 1
    ref(x)  # the first layer sees the raw batch: identical to one plain full-batch forward
    torch.testing.assert_close(ours[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1].running_var, ref[1].running_var, rtol=1e-5, atol=1e-6)


class SharedBatchNorm(nn.Module):
    """One BatchNorm layer applied after two convolutions: plain PyTorch updates its statistics twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bn, self.head = nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        h = torch.relu(self.bn(self.b(h)))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("solver,micro", [("no_saving", 4), ("recompute_all", 4), ("no_saving", 1),
                                          ("recompute_all", 3)])
def test_shared_batchnorm_micro_batched_gets_one_update_per_call(solver, micro):
    """A layer called twice per forward: each call's statistics are combined over the micro-batches on their
    own and applied in call order, as a full-batch forward would (before: the calls were merged into one
    update, and num_batches_tracked counted one). Micro-batches of one (12 of them, 24 calls) and of three
    (an odd count of rows) overflow the layer's scratch rows, which are then folded into totals and reused."""
    torch.manual_seed(0)
    model = SharedBatchNorm()
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 5, (12,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(UserWarning, match="micro-batch"):
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), solver=solver, micro_batch_size=micro)
    assert step.plan.bn_micro_batched and step.plan.micro_batch_size == micro
    seen = []  # per micro-batch: call 1's input, call 2's input (no replay: the reference runs plain)
    hook = ref.bn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        for i in range(0, 12, micro):
            ref.bn.momentum = 0.0  # the reference only collects the inputs each call sees
            ref(x[i:i + micro])
    hook.remove()
    bn = model.bn
    step(x, y)
    assert step._bn._scratch[id(bn)].shape[0] <= FullBatchStats.ROWS
    mean, var = ref.bn.running_mean.clone(), ref.bn.running_var.clone()
    for call in (0, 1):
        inp = torch.cat(seen[call::2])
        assert inp.shape[0] == 12
        mean = 0.9 * mean + 0.1 * inp.mean(dim=(0, 2, 3))
        var = 0.9 * var + 0.1 * inp.var(dim=(0, 2, 3), unbiased=True)
    assert int(bn.num_batches_tracked) == 2
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-6)


def test_micro_batch_statistics_are_one_tensor_per_layer_call_order_kept():
    """Each layer's per-micro-batch statistics live in one tensor of a row per call, allocated once (as 2 small
    tensors per row they took 3.9 MiB resident for MobileNetV2's 16 micro-batches of 2, 2.1 MiB of data); a
    layer called twice per forward grows it once, and the rows stay for the next step."""
    torch.manual_seed(0)
    model = SharedBatchNorm()
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 5, (12,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="micro-batch"):
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), solver="no_saving", micro_batch_size=4)
    step(x, y)
    rows = step._bn._scratch[id(model.bn)]
    assert isinstance(rows, torch.Tensor) and rows.shape == (6, 2, 8)  # 3 micro-batches, 2 calls each
    first = rows.data_ptr()
    step(x, y)
    assert step._bn._scratch[id(model.bn)].data_ptr() == first  # kept, not made again


def test_inputs_as_dict_and_tuple():
    class TwoIn(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, left, right):
            return self.head(torch.relu(self.a(left) + self.b(right)))

    ref, opt_r, ours, opt_o = twins(TwoIn, lr=0.1)
    lt, rt, y = torch.randn(10, 4), torch.randn(10, 4), torch.randint(0, 3, (10,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, opt_o, loss_fn, ({"left": lt, "right": rt}, y), micro_batch_size=3)
    step({"left": lt, "right": rt}, y)
    opt_r.zero_grad()
    loss_fn(ref(lt, rt), y).backward()
    opt_r.step()
    assert_state_close(ours, ref, rtol=1e-5, atol=1e-7)
    step2 = edgetrain.prepare(ours, opt_o, loss_fn, ((lt, rt), y))
    step2((lt, rt), y)


def test_wrong_batches_get_clear_errors():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y))
    with pytest.raises(edgetrain.InputError, match="does not match"):
        step(torch.randn(8, 15), y)
    with pytest.raises(edgetrain.InputError, match="larger than"):
        step(torch.randn(9, 16), torch.randint(0, 5, (9,)))
    with pytest.raises(edgetrain.InputError, match="disagree"):
        step(torch.randn(8, 16), torch.randint(0, 5, (7,)))
    with pytest.raises(edgetrain.InputError, match="pair"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), x)
    before = [p.detach().clone() for p in model.parameters()]
    assert step(x[:5], y[:5]) > 0  # a smaller last batch is fine
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_budget_error_names_smallest_feasible_budget():
    model = mlp(d=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    with pytest.raises(edgetrain.BudgetError) as e:
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=1000)
    assert isinstance(e.value, ValueError)
    assert e.value.min_feasible_bytes and e.value.min_feasible_bytes > 1000
    assert edgetrain.format_bytes(e.value.min_feasible_bytes) in str(e.value)


@pytest.mark.parametrize("make", [lambda: mlp(dropout=0.3), convnet], ids=["mlp-dropout", "convnet-batchnorm"])
def test_two_level_recompute_groups_are_bit_exact(make):
    ref, opt_r, ours, opt_o = twins(make, lr=0.05, momentum=0.9)
    is_cnn = isinstance(ref[0], nn.Conv2d)
    x = torch.randn(12, 3, 16, 16) if is_cnn else torch.randn(12, 16)
    y = torch.randint(0, 5, (12,))
    loss_fn = nn.CrossEntropyLoss()
    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), solver="recompute_all")
    n = step.plan.num_stages
    assert n >= 3
    # Every stage but the last in one recompute group, run two-level; the last stage kept.
    step.set_plan(step.plan.replace(policies=("recompute",) * (n - 1) + ("keep",),
                                    groups=(0,) * (n - 1) + (1,), nested_groups=(0,)))
    assert "two-level" in step.plan.summary()
    for i in range(3):
        lr = plain_step(ref, opt_r, loss_fn, x, y, i)
        torch.manual_seed(i)
        assert step(x, y) == lr
    assert_state_close(ours, ref, rtol=0)  # BatchNorm running statistics updated once per real forward


@pytest.mark.parametrize("solver", ["recompute_all", "chen_sqrt"])
def test_channels_last_model_matches_plain(solver):
    """A model and batches in channels-last layout (oneDNN's fast CPU layout) train exactly as plainly."""
    cl = torch.channels_last
    ref, opt_r, ours, opt_o = twins(lambda: convnet().to(memory_format=cl), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(20, 3, 16, 16).contiguous(memory_format=cl), torch.randint(0, 5, (20,))
    step = edgetrain.prepare(ours, opt_o, loss_fn, (x, y), solver=solver)
    for i in range(3):
        xb, yb = torch.randn(20, 3, 16, 16).contiguous(memory_format=cl), torch.randint(0, 5, (20,))
        lr = plain_step(ref, opt_r, loss_fn, xb, yb, i)
        torch.manual_seed(i)
        assert step(xb, yb) == pytest.approx(lr, rel=1e-6)
    assert_state_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert all(p.is_contiguous(memory_format=cl) for p in ours.parameters() if p.dim() == 4)


def test_micro_batched_dropout_says_it_is_gradient_accumulation_not_one_full_batch_step():
    """Each micro-batch draws its own dropout masks (as plain accumulation over the same micro-batches does),
    so the step is not one full-batch step: the plan and a warning say so; without dropout, nothing is said."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    split = edgetrain.PlanConfig(micro_batch_size=4)
    for dropout in (0.0, 0.3):
        model = mlp(d_in=16, dropout=dropout)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), planning=split)
        said = [str(w.message) for w in caught if "random numbers" in str(w.message)]
        noted = [n for n in step.plan.notes if "random numbers" in n]
        assert (len(said), len(noted)) == ((1, 1) if dropout else (0, 0)), (dropout, said, step.plan.notes)
        assert "random numbers" in step.plan.summary() or not dropout
        assert step.draws_random == bool(dropout)
    model = mlp(d_in=16, dropout=0.3)
    whole = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y))
    assert whole.plan.num_micro_batches == 1 and not whole.plan.notes


class PropertyMomentumBN(nn.BatchNorm2d):
    """A BatchNorm whose momentum is a property over another attribute: the step must set it through the
    property (a value put in the instance's __dict__ would be shadowed, and the statistics silently wrong)."""

    @property
    def momentum(self) -> float:
        return self._mom

    @momentum.setter
    def momentum(self, value: float) -> None:
        self.__dict__["_mom"] = value


def test_batchnorm_momentum_set_through_a_property_when_micro_batched():
    def build(bn):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), bn(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 5))

    plain_bn = build(nn.BatchNorm2d)
    prop_bn = build(PropertyMomentumBN)
    prop_bn[1].momentum = 0.1
    prop_bn.load_state_dict(plain_bn.state_dict())
    x, y = torch.randn(20, 3, 8, 8), torch.randint(0, 5, (20,))
    for model in (plain_bn, prop_bn):  # 20 micro-batches of one: the scratch rows are folded twice
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with pytest.warns(UserWarning, match="micro-batch"):
            step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y),
                                     planning=edgetrain.PlanConfig(micro_batch_size=1))
        step(x, y)
    assert prop_bn[1].momentum == 0.1 and "momentum" not in prop_bn[1].__dict__
    torch.testing.assert_close(prop_bn[1].running_mean, plain_bn[1].running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(prop_bn[1].running_var, plain_bn[1].running_var, rtol=1e-6, atol=1e-7)
    ref = build(nn.BatchNorm2d)  # and both are one full-batch forward's update
    ref.train()(x)
    torch.testing.assert_close(plain_bn[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain_bn[1].running_var, ref[1].running_var, rtol=1e-5, atol=1e-6)


class _ReadsRunningVar(nn.Module):
    """Folds a BatchNorm's running variance into the convolution's weight in training mode, as quantization-aware
    ConvBn does, then runs the BatchNorm (which updates it). Its Python branch on a buffer keeps torch.fx out:
    the model runs as blocks of its module tree, as the quantization-aware one does."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        if int(self.bn.num_batches_tracked) < 0:
            raise RuntimeError("never")
        y = torch.nn.functional.conv2d(x, self.conv.weight * scale.reshape(-1, 1, 1, 1), padding=1)
        return torch.relu(self.bn(y / scale.reshape(1, -1, 1, 1)))


def _qat_convnet() -> nn.Module:
    import torch.ao.quantization as tq

    model = nn.Sequential(tq.QuantStub(), *[nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                           for c in (3, 8, 8)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
                          tq.DeQuantStub()).train()
    for block in model[1:4]:
        tq.fuse_modules_qat(block, ["0", "1", "2"], inplace=True)
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(model)


@pytest.mark.parametrize("make", ["qat", "reads_running_var"])
def test_a_recomputation_reads_running_statistics_as_the_forward_did(make):
    """A recomputed stage ran with the running statistics its first forward had already updated, and undid its own
    update only after: exact for BatchNorm, whose training-mode output ignores them, but a layer that reads them in
    training mode (torch.ao's quantization-aware ConvBnReLU2d) recomputed other activations: gradients 1.6 relative
    from plain PyTorch's, loss and buffers equal, silently in training."""
    torch.manual_seed(0)
    model = _qat_convnet() if make == "qat" else nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), *[_ReadsRunningVar(8) for _ in range(3)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 5))
    x, y = torch.randn(8, 3, 12, 12), torch.randint(0, 5, (8,))
    model(x)  # running statistics (and quantization observers) away from their initial values
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, opt, torch.nn.functional.cross_entropy, (x, y), tolerance=1e-6,
                                  planning=edgetrain.PlanConfig(solver="recompute_all"))
    assert report.passed and report.recomputed == report.stages > 1, str(report)
