"""Defects that gave silent wrong results on models users bring (issue 15: buffers, changes, losses)."""

from __future__ import annotations

import copy
import logging
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.errors import InputError

# timm's BatchNormAct2d in miniature: a BatchNorm2d subclass whose own forward calls F.batch_norm on its
# buffers (the counter and the cumulative average included), then an activation
from edgetrain.models.zoo import CountingBatchNorm as BatchNormAct2d


class Counter(nn.Module):
    """Counts its calls in a buffer and reads the count: a replay must see the count of the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * (1 + 0.1 * self.calls)
        self.calls.add_(1)
        return y


def _cnn(momentum: float | None = 0.1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BatchNormAct2d(8, momentum=momentum),
                         nn.Conv2d(8, 8, 3, padding=1), BatchNormAct2d(8, momentum=momentum),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def _mlp(counter: bool = True) -> nn.Module:
    mid = [Counter()] if counter else []
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), *mid, nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(32, 4))


def _train_both(model, loss_fn, x, y, steps=3, **kw):
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, loss_fn, example=(x, y), **kw)
    for i in range(steps):
        torch.manual_seed(i)
        opt_ref.zero_grad()
        loss_fn(ref(x), y).backward()
        opt_ref.step()
        torch.manual_seed(i)
        step(x, y)
    return ref, model, step


def _max_state_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    worst = (0.0, "")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        d = (p.double() - q.double()).abs().max().item()
        worst = max(worst, (d, name))
    return worst


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_batchnorm_subclass_with_own_forward_is_exact(momentum, solver):
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    ref, model, _ = _train_both(_cnn(momentum), nn.CrossEntropyLoss(), x, y, solver=solver)
    diff, name = _max_state_diff(ref, model)
    assert diff < 1e-5, name
    assert int(model[1].num_batches_tracked) == 3


def test_batchnorm_subclass_running_stats_full_batch_exact_when_micro_batched():
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    model = _cnn()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no update: running statistics alone are compared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y), micro_batch_size=4)
    step(x, y)
    ref(x)
    # the first layer sees the same input either way (later ones see micro-batch-normalised inputs)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked", "3.num_batches_tracked"):
        a, b = ref.state_dict()[name].double(), model.state_dict()[name].double()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all", "chen_sqrt"])
def test_buffer_counter_in_forward_is_kept_and_replayed(solver):
    torch.manual_seed(0)
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    ref, model, step = _train_both(_mlp(), nn.CrossEntropyLoss(), x, y, solver=solver)
    assert step.chain.method == "fx" and len(step.chain) > 1
    assert float(model[2].calls) == 3.0
    diff, name = _max_state_diff(ref, model)
    assert diff == 0.0, name


def test_buffer_counter_refuses_micro_batching():
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="2.calls"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y), micro_batch_size=4)
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y))
    assert step.plan.micro_batch_size == 12
    assert any("never micro-batched" in n for n in step.plan.notes)


def _qat_mlp() -> nn.Module:
    """Quantization-aware training as PyTorch builds it: Linear layers whose weights pass a per-channel fake
    quantizer, activations a per-tensor one; each observes its input's min/max in every forward through
    ``fused_moving_avg_obs_fake_quant``, which writes the observer's buffers without advancing their version
    counters (and resizes the per-channel ones on the first batch)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        from torch.ao.nn import qat
        from torch.ao.quantization import FusedMovingAvgObsFakeQuantize, get_default_qat_qconfig
    qconfig = get_default_qat_qconfig("fbgemm")
    return nn.Sequential(qat.Linear(16, 32, qconfig=qconfig), nn.ReLU(), FusedMovingAvgObsFakeQuantize(),
                         qat.Linear(32, 32, qconfig=qconfig), nn.ReLU(), FusedMovingAvgObsFakeQuantize(),
                         nn.Linear(32, 4))


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_quantization_aware_training_observers_are_replayed(solver):
    """A recomputation put the observers back only where a version counter said they were written: QAT's
    fused observers say nothing, so each batch was observed twice (min_val 1.6% off after 3 steps)."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    ref, model, step = _train_both(_qat_mlp(), nn.CrossEntropyLoss(), x, y, solver=solver)
    assert len(step.chain) > 1 and (solver == "no_saving" or "recompute" in step.plan.policies)
    assert any("min_val" in n for n in step.chain.unmanaged_mutations)
    diff, name = _max_state_diff(ref, model)
    assert diff == 0.0, name
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="cannot train this model exactly"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), example=(x, y),
                          planning=edgetrain.PlanConfig(micro_batch_size=4))


@pytest.mark.parametrize("loss_fn,kind", [
    (nn.CrossEntropyLoss(reduction="sum"), "sum"),
    (nn.CrossEntropyLoss(), "weighted"),  # a target-weighted mean: exact once an ignore_index appears
    (lambda out, t: F.mse_loss(out, F.one_hot(t, 4).float()), "mean"),
    (nn.CrossEntropyLoss(ignore_index=-100), "weighted"),
    (nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0, 0.5]), ignore_index=-100), "weighted"),
])
def test_loss_reduction_is_exact_under_micro_batching(loss_fn, kind):
    torch.manual_seed(0)
    x, y = torch.randn(10, 16), torch.randint(0, 4, (10,))
    y[[1, 2, 7]] = -100 if kind == "weighted" else y[[1, 2, 7]]
    ref, model, step = _train_both(_mlp(counter=False).eval(), loss_fn, x, y, micro_batch_size=3)
    assert step.loss_norm.kind == kind
    assert step.plan.micro_batch_size == 3
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_loss_without_reduction_is_refused_before_training():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = _mlp(counter=False)
    with pytest.raises(InputError, match="scalar"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.CrossEntropyLoss(reduction="none"), example=(x, y))


def test_opaque_loss_is_never_micro_batched():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def max_loss(out, t):  # the worst sample: no slice weighting reproduces it
        return F.cross_entropy(out, t, reduction="none").max()

    model = _mlp(counter=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="neither a mean nor a sum"):
        edgetrain.prepare(model, opt, max_loss, example=(x, y), micro_batch_size=2)
    step = edgetrain.prepare(model, opt, max_loss, example=(x, y))
    assert step.plan.micro_batch_size == 8


def test_a_loss_that_draws_random_numbers_in_eval_mode_is_never_micro_batched_and_says_why():
    """Hugging Face's ViTMAE masks random patches in eval mode too: its loss on the same samples changes from
    call to call, so no split can be checked. It was refused with the opaque-normaliser reason (pass the
    labels as targets...), which does not apply; now with the reason that does. A step still trains whole."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(0)
    cfg = ViTMAEConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                       decoder_num_attention_heads=4, decoder_intermediate_size=64)
    model = ViTMAEForPreTraining(cfg)
    x = {"pixel_values": torch.randn(8, 3, 32, 32)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(InputError, match="draws random numbers") as e:
        edgetrain.prepare(model, opt, lambda out, t: out.loss, example=(x, torch.zeros(8)), micro_batch_size=4)
    assert "neither a mean nor a sum" not in str(e.value)
    step = edgetrain.prepare(model, opt, lambda out, t: out.loss, example=(x, torch.zeros(8)))
    assert step.loss_norm.kind == "random" and step.plan.micro_batch_size == 8
    assert step(x, torch.zeros(8)) > 0


@pytest.mark.parametrize("sorted_by", ["label", "padding"])
def test_loss_whose_normaliser_depends_on_targets_is_found_on_a_sorted_batch(sorted_by):
    """A lambda around a class-weighted (or padding-aware) mean, on an example batch whose first samples share
    a label (or have no padding): on those alone it looks like a plain mean over samples. Before, the probe
    read only the first three samples, called it a mean and split it into micro-batches: wrong gradients."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    if sorted_by == "label":
        y = torch.sort(y).values
        weights = torch.tensor([1.0, 2.0, 3.0, 0.5])
        nll = nn.NLLLoss(weight=weights)
    else:
        y[8:] = -100  # the last samples are padding
        nll = nn.NLLLoss(ignore_index=-100)

    def loss_fn(out, t):
        return nll(F.log_softmax(out, -1), t)

    model = _mlp(counter=False).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="neither a mean nor a sum"):
        edgetrain.prepare(model, opt, loss_fn, example=(x, y), micro_batch_size=4)
    step = edgetrain.prepare(model, opt, loss_fn, example=(x, y))
    assert step.loss_norm.kind == "opaque" and step.plan.micro_batch_size == 12


def test_changes_after_prepare_are_refused():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = _mlp(counter=False)
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                             example=(x, y))
    step(x, y)
    model.eval()
    with pytest.raises(InputError, match="eval mode"):
        step(x, y)
    model.train()
    step(x, y)  # back as prepared
    model[5] = nn.Linear(32, 4)
    with pytest.raises(InputError, match="'5' was replaced"):
        step(x, y)
    model[5].weight = nn.Parameter(torch.zeros(4, 32))
    with pytest.raises(InputError, match="replaced"):
        step(x, y)


def test_hugging_face_loss_computed_inside_the_model_from_padded_labels_is_not_split():
    """GPT-2 handed its labels (-100 on padding) computes a mean over the tokens that count; the example
    batch's first samples have no padding. Before, the probe called it a mean over samples and micro-batches
    changed the gradients by more than their own size."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=200, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(3, 200, (12, 16))
    labels = ids.clone()
    for i, n in enumerate([16] * 7 + [4, 5, 6, 7, 3]):
        labels[i, n:] = -100
    x, y = {"input_ids": ids, "labels": labels}, torch.zeros(12, dtype=torch.long)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match="labels as targets"):
            edgetrain.prepare(model, opt, lambda out, t: out.loss, example=(x, y), micro_batch_size=4)
        step = edgetrain.prepare(model, opt, lambda out, t: out.loss, example=(x, y))
    assert step.loss_norm.kind == "opaque" and step.plan.micro_batch_size == 12


class _PrivateDropout(nn.Module):
    """Dropout drawn from a generator of its own (checkpointing's RNG replay covers only torch's default
    generators)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.gen = generator if generator is not None else torch.Generator().manual_seed(123)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * (torch.rand(x.shape, generator=self.gen) > 0.5).to(x.dtype) * 2.0


_HIDDEN = torch.Generator()


class _HiddenDropout(nn.Module):
    """The same, drawing from a module-level generator edgetrain cannot find."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=_HIDDEN) > 0.5).to(x.dtype) * 2.0 if self.training else x


def _drop_net(drop: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), drop, nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_a_module_drawing_from_its_own_generator_is_replayed(solver):
    """Before: a recomputed stage drew a new mask from the advanced generator (wrong gradients), and
    prepare's own forwards moved the generator on."""
    torch.manual_seed(0)
    model = _drop_net(_PrivateDropout())
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="1GiB",
                             planning=edgetrain.PlanConfig(solver=solver))
    assert len(step.chain) > 1
    for _ in range(2):
        opt_ref.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        opt_ref.step()
        step(x, y)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(ref[2].gen.get_state(), model[2].gen.get_state())


def test_a_forward_that_does_not_reproduce_itself_is_never_recomputed(capfd):
    torch.manual_seed(0)
    model = _drop_net(_HiddenDropout())
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="does not reproduce"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="1GiB",
                          planning=edgetrain.PlanConfig(solver="recompute_all"))
    # the warning goes to stderr once per prepare, not once per capture (prepare's forked children capture too)
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("edgetrain").addHandler(handler)
    try:
        capfd.readouterr()
        step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="1GiB")
        assert capfd.readouterr().err.count("does not reproduce its output") == 1
    finally:
        logging.getLogger("edgetrain").removeHandler(handler)
    assert not step.chain.replayable and "recompute" not in step.plan.policies
    step(x, y)

