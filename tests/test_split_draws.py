"""A step that splits its batch draws the whole batch's dropout masks (edgetrain.capture.draws): the masks, losses,
gradients and generator state of one full-batch step of plain PyTorch, on a Hugging Face model built from its
config. Where it cannot (another random op, attention's own dropout inside a module run whole, a tensor not
batched on its first dimension, no room in the budget), the step draws per micro-batch and says why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.planning.guards import RANDOM_MICRO_BATCH_NOTE
from edgetrain.spec.models import _LogitsOnly
from edgetrain.capture.draws import (EXACT_DRAWS_NOTE, BatchDraws, Sites, batch_draws, drawing,
                                     dropout_site)

transformers = pytest.importorskip("transformers")


def _bert(attention_dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, hidden_dropout_prob=0.2,
                                  attention_probs_dropout_prob=attention_dropout, max_position_embeddings=64,
                                  attn_implementation="eager")
    return _LogitsOnly(transformers.BertForSequenceClassification(cfg).train())


def _prepared(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **planning: object) -> tuple[object, list[str]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = edgetrain.prepare(model, opt, F.cross_entropy, (x, y), memory_budget="2GiB",
                                 planning=edgetrain.PlanConfig(micro_batch_size=4, **planning))
    return step, [str(w.message) for w in caught]


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_a_split_step_of_a_hugging_face_bert_draws_what_one_full_batch_step_draws(solver):
    """Four micro-batches of four, kept or every stage recomputed: three steps equal plain PyTorch's full-batch
    steps (rounding of the smaller matmuls aside) and leave the generator where plain PyTorch leaves it. Before,
    each micro-batch drew its own masks: parameters 4e-3 apart after one step."""
    ours = _bert()
    ref = copy.deepcopy(ours)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randint(0, 200, (16, 32)), torch.randint(0, 2, (16,))
    step, said = _prepared(ours, x, y, solver=solver)
    assert step.plan.num_micro_batches == 4 and EXACT_DRAWS_NOTE in step.plan.notes
    assert RANDOM_MICRO_BATCH_NOTE not in step.plan.notes and not [s for s in said if "random numbers" in s]
    if solver == "recompute_all":
        assert set(step.plan.policies) == {"recompute"}
    for i in range(3):
        xb, yb = torch.randint(0, 200, (16, 32)), torch.randint(0, 2, (16,))
        torch.manual_seed(100 + i)
        opt_ref.zero_grad()
        loss = F.cross_entropy(ref(xb), yb)
        loss.backward()
        opt_ref.step()
        after = torch.get_rng_state()
        torch.manual_seed(100 + i)
        assert step(xb, yb) == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-7)
        assert torch.equal(torch.get_rng_state(), after)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    # the masks' bits and the largest draw must fit beside the plan's peak, or the step draws per micro-batch
    tight = batch_draws(step.chain, step.draw_example, 16, step.plan.peak_bytes, step.plan.peak_bytes)
    assert isinstance(tight, str) and "do not fit" in tight


def test_attention_dropout_inside_a_module_run_whole_is_drawn_per_micro_batch_and_said():
    """BERT's attention-probability dropout runs inside its self-attention module, which the graph calls whole:
    not a site, so the check finds the split forward unlike the whole one, and the plan and a warning say that
    each micro-batch draws its own masks."""
    x, y = torch.randint(0, 200, (16, 32)), torch.randint(0, 2, (16,))
    step, said = _prepared(_bert(attention_dropout=0.1), x, y)
    assert RANDOM_MICRO_BATCH_NOTE in step.plan.notes and EXACT_DRAWS_NOTE not in step.plan.notes
    assert "differ" in step.chain.draw_sites
    assert [s for s in said if "random numbers" in s and step.chain.draw_sites in s], said  # the warning says why


class _Noisy(nn.Module):
    """Dropout beside Gaussian noise (another draw of the generator), or dropout on a sequence-first tensor."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.kind == "noise":
            noise = 0.1 * torch.randn_like(h) if self.training else 0.0
            return self.out(self.drop(h + noise))
        seq = h.view(h.shape[0], 4, 8).transpose(0, 1).contiguous()  # [4, batch, 8]
        return self.out(self.drop(seq).transpose(0, 1).reshape(h.shape[0], 32))


@pytest.mark.parametrize("kind,why", [("noise", ("other than", "differ")), ("seq", ("first dimension",))])
def test_draws_the_check_cannot_match_stay_per_micro_batch(kind, why):
    """Noise drawn beside the dropout (the generator's state after, or the outputs, differ: which depends on how
    the normal kernel draws), and a dropout over a sequence-first tensor."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    step, said = _prepared(_Noisy(kind), x, y)
    assert RANDOM_MICRO_BATCH_NOTE in step.plan.notes and [s for s in said if "random numbers" in s]
    assert any(w in step.chain.draw_sites for w in why), step.chain.draw_sites
    step(x, y)  # trains, drawing per micro-batch


@pytest.mark.parametrize("kernel", [True, False], ids=["lean-kernel", "torch-bernoulli"])
@pytest.mark.parametrize("rows,shape", [(1, (6, 13)), (3, (18, 5)), (0, (1, 13)), (1, (6, 40000))])
def test_sliced_masks_equal_torch_dropout_across_byte_boundaries(rows, shape, kernel, monkeypatch):
    """Micro-batches of two samples out of six take their rows of one whole-batch mask: outputs, gradients and
    the generator state equal one ``torch.dropout`` over the whole tensor bit for bit (rows of 13 and 15
    elements start mid-byte; a tensor that does not grow with the batch is drawn once and shared; 240,000
    elements cross the kernel's 4,096-element chunks and the generator's refills), drawn and applied by lean
    dropout's kernel where it runs
    here, and by torch's Bernoulli and NumPy's bit unpacking (the path of a CPU where it does not)."""
    from edgetrain.capture import draws as module

    if not kernel:
        monkeypatch.setattr(module, "draw_bits", lambda count, p: None)
        monkeypatch.setattr(module, "times_bits", lambda x, bits, p: None)
    n, p = 6, 0.3
    x = torch.randn(shape)
    g = torch.randn(shape if rows else (n * shape[0], *shape[1:]))
    torch.manual_seed(3)
    xr = x.clone().requires_grad_()
    yr = torch.dropout(xr, p, True)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    per_sample = shape[0] // n if rows else 0
    draws = BatchDraws(Sites({7: per_sample}, {7: shape[1] if rows else shape[0] * shape[1]}), n)
    outs, grads = [], []
    with drawing(draws) as told:
        for start in range(0, n, 2):
            told.micro_batch(start, 2)
            part = (x[start * per_sample:(start + 2) * per_sample] if rows else x).clone().requires_grad_()
            out = dropout_site(part, p, True, site=7)
            out.backward(g[len(outs) * out.shape[0]:(len(outs) + 1) * out.shape[0]])
            outs.append(out.detach())
            grads.append(part.grad)
    assert torch.equal(torch.get_rng_state(), after)
    if rows:
        yr.backward(g)
        assert torch.equal(torch.cat(outs), yr) and torch.equal(torch.cat(grads), xr.grad)
    else:
        torch.manual_seed(3)
        noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)  # torch.dropout's own noise
        assert torch.equal(yr, x * noise)
        for k, (out, grad) in enumerate(zip(outs, grads)):
            assert torch.equal(out, yr) and torch.equal(grad, g[k:k + 1] * noise)


def test_verify_compares_a_split_step_drawing_whole_batch_masks_with_one_full_batch_step():
    """edgetrain.verify's plain reference is one full-batch step where the split step draws the whole batch's
    masks (an accumulating reference would draw each micro-batch's and fail it)."""
    model = _bert()
    x, y = torch.randint(0, 200, (16, 32)), torch.randint(0, 2, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, (x, y),
                                  "2GiB", planning=edgetrain.PlanConfig(micro_batch_size=4))
    assert report.passed, str(report)
    assert report.micro_batch_size == 4 and any("full-batch step" in n for n in report.notes), report.notes


@pytest.mark.parametrize("switch", ["1", "0"])
def test_whole_batch_draws_switch(switch, monkeypatch):
    """``EDGETRAIN_WHOLE_BATCH_DRAWS=0`` draws per micro-batch (as gradient accumulation does), and says so."""
    monkeypatch.setenv("EDGETRAIN_WHOLE_BATCH_DRAWS", switch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    step, said = _prepared(model, torch.randn(16, 8), torch.randint(0, 3, (16,)))
    assert (EXACT_DRAWS_NOTE in step.plan.notes) == (switch == "1")
    assert bool([s for s in said if "EDGETRAIN_WHOLE_BATCH_DRAWS=0" in s]) == (switch == "0")


def test_a_plan_without_room_for_the_masks_is_made_again_with_their_bytes_held_back(monkeypatch):
    """Where only the budget rules the masks out, prepare plans again with their bytes held back and takes that
    plan (exact before fast); where no plan leaves room, the first plan stands, drawing per micro-batch."""
    import edgetrain.api as api

    real = api.batch_draws
    calls = []

    def first_without_room(chain, example, n, peak, room):  # the first plan used the room the masks need
        calls.append(peak)
        found = real(chain, example, n, peak, room)
        return "the whole batch's masks do not fit (as if)" if len(calls) == 1 else found

    monkeypatch.setattr(api, "batch_draws", first_without_room)
    x, y = torch.randint(0, 200, (16, 32)), torch.randint(0, 2, (16,))
    step, said = _prepared(_bert(), x, y)
    assert len(calls) == 2 and EXACT_DRAWS_NOTE in step.plan.notes and not [s for s in said if "random" in s]
    monkeypatch.setattr(api, "batch_draws", real)
    monkeypatch.setattr(Sites, "extra_bytes", lambda self, n: 2**40)
    step, said = _prepared(_bert(), x, y)
    assert RANDOM_MICRO_BATCH_NOTE in step.plan.notes and [s for s in said if "do not fit" in s]
