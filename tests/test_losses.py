"""``TokenCrossEntropyLoss``: a language model's token-mean loss that micro-batches split exactly.

The reference is plain PyTorch's full-batch step on the loss the Hugging Face model computes from its own
``labels=`` (padding at -100, a different amount in every sequence, two sequences with no counted token), so
a micro-batched step must reproduce the full batch's objective, not an accumulation of micro-batch means.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

import edgetrain

transformers = pytest.importorskip("transformers")

V, B, T = 120, 8, 12


def _causal_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(cfg)


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    for i in range(B):
        labels[i, T - i:] = -100  # sequence i has i padded positions
    labels[2] = -100  # no token of these counts: a micro-batch of them weighs nothing
    labels[3] = -100
    return ids, labels


def _updated(model: torch.nn.Module, loss_of) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    loss = loss_of(model)
    if isinstance(loss, torch.Tensor):
        loss.backward()
        loss = float(loss.detach())
    opt.step()
    return {"loss": torch.tensor(loss), **{k: v.detach().clone() for k, v in model.named_parameters()}}


@pytest.mark.parametrize("micro", [1, 3, 4])
def test_micro_batched_causal_lm_step_equals_the_models_own_full_batch_loss(micro):
    ids, labels = _padded_batch()
    model = _causal_lm()
    plain = _updated(copy.deepcopy(model), lambda m: m(input_ids=ids, labels=labels).loss)

    loss_fn = edgetrain.TokenCrossEntropyLoss(shift=True)
    ours = copy.deepcopy(model)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(ours, opt, loss_fn, ({"input_ids": ids}, labels),
                                 planning=edgetrain.PlanConfig(micro_batch_size=micro, use_cache=False))
    assert step.plan.micro_batch_size == micro and step.loss_norm.kind == "weighted"
    loss = step({"input_ids": ids}, labels)
    assert loss == pytest.approx(float(plain["loss"]), rel=1e-5)
    for k, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), plain[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_lambda_hiding_the_token_count_is_refused_and_named_the_fix():
    ids, labels = _padded_batch()
    model = _causal_lm()

    def lam(out, y):
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), ignore_index=-100)

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(edgetrain.InputError, match="TokenCrossEntropyLoss"):
        edgetrain.prepare(model, opt, lam, ({"input_ids": ids}, labels),
                          planning=edgetrain.PlanConfig(micro_batch_size=4, use_cache=False))


def test_token_classifier_with_class_weights_splits_exactly():
    """No shift (token classification): class weights and padding make each slice weigh its own targets."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForTokenClassification(cfg)
    ids, labels = _padded_batch()
    labels = torch.where(labels >= 0, labels % 5, labels)
    weight = torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0])
    loss_fn = edgetrain.TokenCrossEntropyLoss(weight=weight)
    plain = _updated(copy.deepcopy(model), lambda m: F.cross_entropy(m(input_ids=ids).logits.reshape(-1, 5),
                                                                      labels.reshape(-1), weight=weight))
    ours = copy.deepcopy(model)
    step = edgetrain.prepare(ours, torch.optim.SGD(ours.parameters(), lr=0.5), loss_fn, ({"input_ids": ids}, labels),
                             planning=edgetrain.PlanConfig(micro_batch_size=3, use_cache=False))
    assert step.loss_norm.kind == "weighted"
    assert step({"input_ids": ids}, labels) == pytest.approx(float(plain["loss"]), rel=1e-5)
    for k, p in ours.named_parameters():
        torch.testing.assert_close(p.detach(), plain[k], rtol=1e-5, atol=1e-6, msg=k)


def test_token_loss_reads_model_outputs_and_says_what_does_not_fit():
    loss_fn = edgetrain.TokenCrossEntropyLoss(shift=True)
    logits = torch.randn(2, 5, 7)
    y = torch.randint(0, 7, (2, 5))
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 7), y[:, 1:].reshape(-1))
    for out in (logits, {"logits": logits}, (logits, None)):
        torch.testing.assert_close(loss_fn(out, y), want)
    assert loss_fn.target_weight(torch.tensor([[1, 2, -100], [-100, 3, 4]])) == 3.0  # first column dropped
    with pytest.raises(edgetrain.InputError, match="shift=True"):
        edgetrain.TokenCrossEntropyLoss()(logits, y[:, 1:])
    with pytest.raises(edgetrain.InputError, match="per-token logits"):
        loss_fn(torch.randn(2, 7), torch.randint(0, 7, (2,)))
    with pytest.raises(edgetrain.InputError, match="output_key"):
        loss_fn({"scores": logits}, y)
    with pytest.raises(edgetrain.InputError, match="integer class targets"):
        loss_fn(logits, y.float())
    with pytest.raises(ValueError, match="reduction"):
        edgetrain.TokenCrossEntropyLoss(reduction="none")


def _collated(ids: torch.Tensor, labels: torch.Tensor) -> "transformers.BatchEncoding":
    """A batch as a Hugging Face collator hands it over: a ``BatchEncoding`` (not a dict) with ``labels``."""
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})


def test_trainer_takes_collated_batches_and_trains_as_the_models_own_loss():
    """Two steps of the Trainer on collator batches (``labels`` inside), micro-batched under a fixed size, equal
    two plain steps of ``model(**batch).loss``; validation's loss is the token mean over the whole data."""
    ids, labels = _padded_batch()
    batches = [_collated(ids, labels), _collated(ids.roll(1, 0), labels.roll(1, 0))]
    model = _causal_lm()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for b in batches:
        opt.zero_grad()
        plain(**b).loss.backward()
        opt.step()
    ours = copy.deepcopy(model)
    trainer = edgetrain.Trainer(ours, torch.optim.SGD(ours.parameters(), lr=0.5),
                                edgetrain.TokenCrossEntropyLoss(shift=True), batches, [batches[0]],
                                prepare_options={"planning": edgetrain.PlanConfig(micro_batch_size=3,
                                                                                  use_cache=False)})
    assert trainer.step.plan.micro_batch_size == 3
    trainer.fit(1)
    for (k, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=k)
    # validation: two batches whose sequences count different numbers of tokens weigh by their tokens
    short = labels.clone()
    short[:, 2:] = -100
    val = [_collated(ids, labels), _collated(ids, short)]
    got = trainer.evaluate(val)["val_loss"]
    ours.eval()
    with torch.no_grad():
        logits = torch.cat([ours(input_ids=ids).logits] * 2)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.cat([labels, short])[:, 1:].reshape(-1))
    assert got == pytest.approx(float(want), rel=1e-5)


def test_a_step_takes_the_batch_whole_and_a_mapping_without_labels_is_named():
    ids, labels = _padded_batch()
    model = _causal_lm()
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             edgetrain.TokenCrossEntropyLoss(shift=True), _collated(ids, labels))
    with torch.no_grad():
        before = float(model(**_collated(ids, labels)).loss)  # the model's own loss, labels handed to it
    assert step(_collated(ids, labels)) == pytest.approx(before, rel=1e-5)  # labels taken out as the targets
    with pytest.raises(edgetrain.InputError, match="'labels'"):
        step({"input_ids": ids})
