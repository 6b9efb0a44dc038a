"""Silent wrong results and deep tracebacks on models users bring (issue 17's stop 36): random draws outside
torch (NumPy, Python), losses over the batch as a whole, sequence-first layouts."""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.errors import InputError

from _semantics import assert_trains_whole


class _NumpyDropout(nn.Module):
    """Dropout whose mask comes from NumPy's global generator (as Hugging Face's speech models draw their time
    masks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * torch.from_numpy(np.random.rand(*x.shape) > 0.5).to(x.dtype) * 2.0


class _PythonLayerDrop(nn.Module):
    """A layer skipped when Python's ``random.random()`` says so (LayerDrop as older model code wrote it)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5:
            return x
        return torch.relu(self.lin(x))


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("make", [_NumpyDropout, lambda: _PythonLayerDrop(32)], ids=["numpy", "python"])
@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_a_forward_drawing_from_numpy_or_python_random_is_replayed_and_its_streams_left_alone(make, solver):
    """Before: such a model was one stage that is never recomputed (recompute_all refused), and prepare's
    own forwards moved NumPy's and Python's generators on, so the first step drew other masks than plain
    PyTorch from the same seeds. Now its blocks are the stages (a traced graph would freeze the draws), a
    recomputation replays both generators, and two steps equal plain PyTorch's bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), make(), nn.Linear(32, 32), make(), nn.Linear(32, 3))
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    _seed_all(1)
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="1GiB",
                             planning=edgetrain.PlanConfig(solver=solver))
    assert len(step.chain) > 1 and step.chain.replayable
    if solver == "recompute_all":
        assert set(step.plan.policies) == {"recompute"}
    for _ in range(2):
        step(x, y)
    after = np.random.get_state()[1].copy(), random.getstate()
    _seed_all(1)
    mb = step.plan.micro_batch_size  # the reference accumulates the same micro-batches, drawing as they do
    for _ in range(2):
        opt_ref.zero_grad()
        for s in range(0, len(x), mb):
            (nn.CrossEntropyLoss()(ref(x[s:s + mb]), y[s:s + mb]) * (mb / len(x))).backward()
        opt_ref.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert np.array_equal(after[0], np.random.get_state()[1]) and after[1] == random.getstate()


def test_hugging_face_speech_model_with_time_masking_is_cut_into_blocks_and_recomputed_exactly():
    """Wav2Vec2 draws its SpecAugment time masks from ``np.random`` in training mode (on by default). Before,
    the whole model was one stage never recomputed, and ``verify`` failed even the plan that keeps
    everything: prepare had moved NumPy's generator and verify did not rewind it."""
    pytest.importorskip("transformers")
    from edgetrain.models.zoo import ZOO

    case = ZOO["hf-wav2vec2"]
    model = case.build()
    x, y = case.example(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for solver in ("no_saving", "recompute_all"):
            report = edgetrain.verify(model, opt, case.loss_fn, (x, y), tolerance=0.0,
                                      planning=edgetrain.PlanConfig(solver=solver))
            assert report.passed, str(report)
            assert report.stages > 1 and report.recomputed == (report.stages if solver == "recompute_all" else 0)


def test_an_in_batch_contrastive_loss_trains_whole_and_is_never_split():
    """CLIP's loss: image-text logits over the batch, targets ``arange(B)``. Evaluated on part of the batch (the
    loss check takes 6 of 8 samples, and splits those) it asks for classes past the part's size: before, prepare
    raised torch's ``IndexError: Target 5 is out of bounds`` whatever the plan. Now the batch is trained whole (recomputation exact) and
    micro-batching is refused with the error the part raised."""
    pytest.importorskip("transformers")
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, max_position_embeddings=16, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8), projection_dim=16)).train()
    g = torch.Generator().manual_seed(1)
    x = {"input_ids": torch.randint(2, 100, (8, 12), generator=g), "pixel_values": torch.randn(8, 3, 32, 32, generator=g)}
    y = torch.arange(8)

    def contrastive(out, y):
        return (F.cross_entropy(out.logits_per_image, y) + F.cross_entropy(out.logits_per_text, y)) / 2

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, opt, contrastive, (x, y), tolerance=0.0,
                                  planning=edgetrain.PlanConfig(solver="recompute_all"))
        assert report.passed and report.recomputed == report.stages > 1, str(report)
        with pytest.raises(InputError, match="fails on part of the batch .IndexError"):
            edgetrain.prepare(model, opt, contrastive, (x, y), planning=edgetrain.PlanConfig(micro_batch_size=4))
        with pytest.raises(edgetrain.BudgetError, match="Micro-batching is off for this model: the loss, or the model.s forward, fails") as e:
            edgetrain.prepare(model, opt, contrastive, (x, y), memory_budget="8MiB")
        assert "micro_batch_size" not in str(e.value)  # no advice micro-batching could not follow


class _SeqFirstLSTM(nn.Module):
    """torch's default LSTM layout: ``[L, B, F]`` in, the last step's state classified."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][-1])


@pytest.mark.parametrize("length", [8, 12])
def test_a_sequence_first_model_is_refused_with_what_to_do(length):
    """edgetrain slices dim 0. A sequence-first LSTM whose sequence is as long as the batch passed the size
    check; before, prepare failed in profiling with torch's 'Expected input batch_size (8) to match target
    batch_size (1)', and micro-batches would have cut the sequence. A longer sequence was refused, saying
    only that the sizes disagree."""
    torch.manual_seed(0)
    model = _SeqFirstLSTM()
    x, y = torch.randn(length, 8, 16), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="batch_first=True"):
        edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget="1GiB")


def _mixtral_with_router_loss():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (8, 12), generator=g)
    y = torch.roll(ids, -1, 1)

    def lm_and_router(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + 0.02 * out.aux_loss

    return model, ids, y, lm_and_router


def test_a_load_balancing_loss_over_the_batch_is_never_micro_batched():
    """Mixtral's router loss is a statistic of the batch as a whole. At 0.02 x it moved the loss of a split
    batch by 4e-5 relative, inside the values' check, and micro-batches were taken as exact: before, a step of
    micro-batches of 4 had gradients 32% away from one full-batch step's. Now the check also compares the
    gradients of the split, and refuses."""
    pytest.importorskip("transformers")
    model, ids, y, lm_and_router = _mixtral_with_router_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match="gradients do not add up"):
            edgetrain.prepare(model, opt, lm_and_router, ({"input_ids": ids}, y),
                              planning=edgetrain.PlanConfig(micro_batch_size=4))
        report = edgetrain.verify(model, opt, lm_and_router, ({"input_ids": ids}, y), tolerance=0.0,
                                  planning=edgetrain.PlanConfig(solver="recompute_all"))
    assert report.passed and report.recomputed == report.stages > 1, str(report)


class _BatchNormWithRouter(nn.Module):
    """A BatchNorm CNN whose router's load (softmax averaged over the batch) is a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head, self.router = nn.Linear(8, 3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.router(h).softmax(-1).mean(0)


def test_the_gradient_check_of_a_split_runs_on_batchnorm_models():
    """The check put the buffers back before its backward, an in-place write to BatchNorm's running statistics
    that autograd refused, and the check was skipped on every BatchNorm model: a router's load-balancing term
    (1e-4 x, inside the values' check) was micro-batched with no error."""
    torch.manual_seed(0)
    model = _BatchNormWithRouter()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))

    def loss_fn(out, t):
        logits, load = out
        return F.cross_entropy(logits, t) + 1e-4 * 4 * (load ** 2).sum()

    with pytest.raises(InputError, match=r"gradients do not add up .* relative in router\."):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, (x, y),
                          planning=edgetrain.PlanConfig(micro_batch_size=4))


def test_a_loss_that_does_not_take_the_models_output_says_what_the_model_returns():
    """A Hugging Face model returns a ModelOutput; nn.CrossEntropyLoss handed it failed deep in profiling
    ("profiling failed: TypeError ..."), or, asked for micro-batches, was called a loss failing on part of the
    batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(config)
    x, y = {"input_ids": torch.randint(1, 100, (8, 12))}, torch.randint(0, 3, (8,))
    for planning in (edgetrain.PlanConfig(), edgetrain.PlanConfig(micro_batch_size=4)):
        with pytest.raises(InputError, match=r"loss_fn\(output, targets\) fails on the model's output .* returns "
                                             r"SequenceClassifierOutput with 'logits'.*out\.logits"):
            edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                              memory_budget="1GiB", planning=planning)


@pytest.mark.parametrize("loss_dtype", ["float32", "bfloat16"])
def test_the_split_checks_allow_half_precision_rounding(loss_dtype):
    """A bfloat16 MLP's split gradients differ from the whole's by its rounding (0.0024 relative): a
    per-sample loss, micro-batched as plain accumulation is. Computed in bfloat16 itself, the loss's values
    split by its rounding too, and the values' check (1e-4) refused it as neither a mean nor a sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 3)).to(torch.bfloat16)
    x, y = torch.randn(8, 16, dtype=torch.bfloat16), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtype = getattr(torch, loss_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, opt, lambda out, y: F.cross_entropy(out.to(dtype), y), (x, y),
                                  planning=edgetrain.PlanConfig(micro_batch_size=4))
    assert report.passed and report.micro_batch_size == 4, str(report)


def test_the_gradient_check_of_a_split_gives_way_to_scarce_memory(monkeypatch):
    """It holds about three times the trained parameters: where that is over half of what the system has
    available it is skipped, and the values' check stands alone (logged)."""
    pytest.importorskip("transformers")
    from edgetrain.capture import bind_inputs
    from edgetrain.planning import loss as loss_mod

    model, ids, y, lm_and_router = _mixtral_with_router_loss()
    env = bind_inputs(model, {"input_ids": ids})
    assert loss_mod.loss_normalisation(model, env, lm_and_router, y, 8).kind == "opaque"
    monkeypatch.setattr(loss_mod, "available_bytes", lambda: 2**20)
    assert loss_mod.loss_normalisation(model, env, lm_and_router, y, 8).kind == "mean"


class _Siamese(nn.Module):
    """Pairs of images stacked along the batch (``[a0, b0, a1, b1, ...]``), each sample classified by how its
    embedding differs from its pair's: the forward runs only on an even number of samples."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.body(x).reshape(x.shape[0] // 2, 2, -1)
        return self.head((e - e.mean(1, keepdim=True)).reshape(x.shape[0], -1))


@pytest.mark.parametrize("solver", [None, "recompute_all"])
def test_a_forward_that_runs_only_on_even_batches_trains_whole(solver):
    """Profiling ran the stages on micro-batches of one and two samples whatever the model: a forward that pairs the
    batch's samples up failed there, and prepare raised ``ProfileError: profiling failed: RuntimeError: shape
    '[0, 2, -1]' is invalid`` even without a budget. The loss check already knew the forward fails on part of the
    batch; profiling now runs the whole batch only, as every plan for such a model does."""
    torch.manual_seed(0)
    model = _Siamese()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 2, (8,))
    assert_trains_whole(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, solver, tolerance=0.0)
