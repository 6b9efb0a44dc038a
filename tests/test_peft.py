"""LoRA fine-tuning through PEFT (``get_peft_model``), the usual way to fine-tune a Hugging Face model on a small
device: the wrapper's blocks are recomputed, and steps equal plain PyTorch's."""

from __future__ import annotations

import warnings

import pytest
import torch

import edgetrain

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _gpt2_lora(dropout: float):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=dropout, fan_in_fan_out=True)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).train()
    ids = torch.randint(0, 128, (8, 16))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt, ({"input_ids": ids}, ids)


@pytest.mark.parametrize("dropout, micro", [(0.0, 4), (0.1, None)])
def test_a_peft_wrapped_causal_lm_recomputes_its_blocks_exactly(dropout, micro):
    """PeftModel's forward takes ``**kwargs``, not ``use_cache``: the step did not turn the cache off, every block
    was handed a DynamicCache, none could be recomputed, and the model trained as one stage (no memory saved)."""
    model, opt, example = _gpt2_lora(dropout)
    loss = edgetrain.TokenCrossEntropyLoss(shift=True)
    planning = edgetrain.PlanConfig(solver="recompute_all", micro_batch_size=micro)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, loss, example, planning=planning)
        assert step.chain.method == "modules" and len(step.chain) == 4, step.chain.warning
        report = edgetrain.verify(model, opt, loss, example, tolerance=1e-5, planning=planning)
    assert report.passed and report.recomputed == report.stages == 4, str(report)
