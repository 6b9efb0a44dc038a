"""Mixed precision: a step run inside ``torch.autocast``, prepared inside the same region, gives what PyTorch's
recipe gives (forward and loss under autocast, backward outside it), bit for bit; a step whose autocast
differs from prepare's is refused, since the plan was measured without it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.errors import InputError

transformers = pytest.importorskip("transformers")


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    return transformers.BertForSequenceClassification(config)


def _loss(out, y):
    return nn.functional.cross_entropy(out.logits, y)


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_a_step_under_autocast_is_pytorchs_mixed_precision_step(solver):
    """Before, the backward ran inside the caller's autocast region, where the CPU engine casts the backward's
    own matmuls again: 0.47% off the recipe's gradients (value.bias of this BERT), no error."""
    model = _bert()
    x, y = {"input_ids": torch.randint(1, 100, (8, 12))}, torch.randint(0, 3, (8,))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _bf16(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, _loss, (x, y), planning=edgetrain.PlanConfig(solver=solver))
        torch.manual_seed(5)
        got = step(x, y)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(5)
    with _bf16():
        loss = _loss(reference(**x), y)
    loss.backward()
    ref_opt.step()
    assert got == float(loss)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_a_step_whose_autocast_differs_from_prepares_is_refused():
    model = _bert()
    x, y = {"input_ids": torch.randint(1, 100, (8, 12))}, torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, _loss, (x, y), memory_budget="1GiB")
    with _bf16(), pytest.raises(InputError, match=r"runs under torch.autocast\('cpu', dtype=torch.bfloat16\) but "
                                                  r"was prepared under no torch.autocast.*inside the same"):
        step(x, y)
    step(x, y)  # as prepared: fine
    with _bf16(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, _loss, (x, y), memory_budget="1GiB")
    with pytest.raises(InputError, match=r"runs under no torch.autocast but was prepared under torch.autocast"):
        step(x, y)
