"""Batches shorter than the example: a collator that pads each batch to its longest sequence, a smaller image.

The plan is made for the example's per-sample shapes; a batch no larger in any dimension runs on it, exactly
(every policy is shape-free) and inside the budget (it holds less than the planned batch). A larger one is
refused before the step, with what to do.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

import edgetrain

transformers = pytest.importorskip("transformers")

V, B = 150, 8


def _lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=128))


def _batch(length: int, seed: int) -> "transformers.BatchEncoding":
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(B):  # padded to the batch's longest, as DataCollatorWithPadding does
        mask[i, length - i:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


def test_shorter_sequences_train_exactly_on_the_plan_of_the_longest():
    model = _lm()
    plain = copy.deepcopy(model)
    ours = copy.deepcopy(model)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(ours, opt, edgetrain.TokenCrossEntropyLoss(shift=True), _batch(32, 0),
                                 planning=edgetrain.PlanConfig(micro_batch_size=3, solver="recompute_all",
                                                               use_cache=False))
    assert step.plan.micro_batch_size == 3 and step.plan.policies.count("keep") == 0
    popt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for length, seed in ((32, 1), (20, 2), (7, 3)):
        b = _batch(length, seed)
        popt.zero_grad()
        want = plain(**b).loss
        want.backward()
        popt.step()
        assert step(b) == pytest.approx(float(want.detach()), rel=1e-5)
        for (k, p), q in zip(ours.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"{length}: {k}")
    with pytest.raises(edgetrain.InputError, match="as long as the longest"):
        step(_batch(33, 4))
    with pytest.raises(edgetrain.InputError, match="not those of the example"):
        step(({"input_ids": torch.zeros(B, 16, dtype=torch.int32)}, torch.zeros(B, 16, dtype=torch.long)))


def test_smaller_images_keep_batchnorm_exact_and_the_budget():
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", num_labels=5)
    model = transformers.ResNetForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 48, 48, generator=g), torch.randint(0, 5, (16,), generator=g)

    def loss_fn(out, t):
        return F.cross_entropy(out.logits, t)

    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(edgetrain.BudgetError) as err:
        edgetrain.prepare(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, (x, y),
                          "1MiB", planning=edgetrain.PlanConfig(use_cache=False))
    budget = int(1.2 * err.value.min_feasible_bytes)  # named for a fresh process: this one carries other tests
    step = edgetrain.prepare(ours, opt, loss_fn, (x, y), budget, planning=edgetrain.PlanConfig(use_cache=False))
    popt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    small = (torch.randn(16, 3, 40, 36, generator=g), torch.randint(0, 5, (16,), generator=g))
    with edgetrain.measure_peak() as peak:
        got = step(*small)
    assert peak.above_baseline_bytes <= budget
    popt.zero_grad()
    want = loss_fn(plain(small[0]), small[1])
    want.backward()
    popt.step()
    assert got == pytest.approx(float(want.detach()), rel=1e-5)
    for (k, p), q in zip(ours.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)  # BatchNorm statistics and counters too


def test_trainer_plans_again_on_a_longer_batch_and_trains_as_plain_pytorch():
    """A collator pads each batch to its own longest: the first batch is not the longest. The Trainer plans
    again on each full batch longer than its example (twice here), and trains exactly as the plain loop."""
    lengths = [12, 20, 9, 28, 16]
    batches = [_batch(n, seed) for seed, n in enumerate(lengths)]
    longer = _batch(40, 9)
    batches.append(transformers.BatchEncoding({k: v[:5, :30] for k, v in longer.items()}))  # short and longer
    model = _lm()
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    popt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)  # linear in the gradients: Adam would magnify
    for b in batches[:-1]:                                             # the rounding of micro-batch sums
        popt.zero_grad()
        plain(**b).loss.backward()
        popt.step()
    trainer = edgetrain.Trainer(ours, torch.optim.SGD(ours.parameters(), lr=0.5, momentum=0.9),
                                edgetrain.TokenCrossEntropyLoss(shift=True), batches[:-1], memory_budget="2GiB",
                                prepare_options={"planning": edgetrain.PlanConfig(micro_batch_size=3,
                                                                                  use_cache=False)})
    trainer.fit(1)
    assert trainer.replans == 2 and trainer.step.example_signature[0][0] == (28,)
    assert trainer.step.plan.micro_batch_size == 3  # the options carried over
    for (k, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=k)
    with pytest.raises(edgetrain.InputError, match="as long as the longest"):
        trainer.step(batches[-1])
