"""More Hugging Face architectures than the zoo the tests run: decoder LLMs, encoder variants, seq2seq, windowed
and hierarchical vision models, masked pretraining. Each is built offline from a small config.

The test suite runs :data:`edgetrain.models.zoo.ZOO` (every mechanism, three ways each); these cases are for
``bench/bench_zoo.py --models more`` (or any of their names), which measures them the same way: capture,
exactness recomputed and micro-batched against plain PyTorch, memory against plain's, the named minimum and
whether it trains.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .zoo import ZooCase, _lm_tokens, _logits_ce, _pixels, _seeded, _tokens

__all__ = ["MORE"]

#: the small encoder / decoder size every text model here is built at
_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=200)
_VISION = {k: v for k, v in _TEXT.items() if k != "vocab_size"}


def _hf(model: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kw))
    return build


def _mae_loss(out: Any, _y: torch.Tensor) -> torch.Tensor:
    """ViTMAE's own reconstruction loss over the patches its forward masked at random."""
    return out.loss


def _cases() -> list[ZooCase]:
    cls = dict(num_labels=3)
    text, lm, pix = _tokens(200, 16), _lm_tokens(200, 16), _pixels(32)
    kv = dict(_TEXT, num_key_value_heads=2)
    return [
        ZooCase("distilbert", _seeded(_hf("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=200,
                                          dim=64, n_layers=2, n_heads=4, hidden_dim=128, **cls)),
                text, _logits_ce, True),
        ZooCase("roberta", _seeded(_hf("RobertaForSequenceClassification", "RobertaConfig", **_TEXT,
                                       max_position_embeddings=40, **cls)), text, _logits_ce, True),
        ZooCase("deberta-v2", _seeded(_hf("DebertaV2ForSequenceClassification", "DebertaV2Config", **_TEXT, **cls)),
                text, _logits_ce, True),
        ZooCase("electra", _seeded(_hf("ElectraForSequenceClassification", "ElectraConfig", **_TEXT,
                                       embedding_size=32, **cls)), text, _logits_ce, True),
        ZooCase("xlnet", _seeded(_hf("XLNetForSequenceClassification", "XLNetConfig", vocab_size=200, d_model=64,
                                     n_layer=2, n_head=4, d_inner=128, **cls)), text, _logits_ce, True),
        ZooCase("mpnet", _seeded(_hf("MPNetForSequenceClassification", "MPNetConfig", **_TEXT, **cls)), text,
                _logits_ce, True),
        ZooCase("llama", _seeded(_hf("LlamaForCausalLM", "LlamaConfig", **kv)), lm, _logits_ce, True),
        ZooCase("mistral", _seeded(_hf("MistralForCausalLM", "MistralConfig", **kv)), lm, _logits_ce, True),
        ZooCase("qwen2", _seeded(_hf("Qwen2ForCausalLM", "Qwen2Config", **kv)), lm, _logits_ce, True),
        ZooCase("gemma", _seeded(_hf("GemmaForCausalLM", "GemmaConfig", **kv, head_dim=16)), lm, _logits_ce, True),
        ZooCase("phi", _seeded(_hf("PhiForCausalLM", "PhiConfig", **_TEXT)), lm, _logits_ce, True),
        ZooCase("falcon", _seeded(_hf("FalconForCausalLM", "FalconConfig", vocab_size=200, hidden_size=64,
                                      num_hidden_layers=2, num_attention_heads=4)), lm, _logits_ce, True),
        ZooCase("gpt-neo", _seeded(_hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=200, hidden_size=64,
                                       num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0)),
                lm, _logits_ce, True),
        ZooCase("opt", _seeded(_hf("OPTForCausalLM", "OPTConfig", vocab_size=200, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                                   max_position_embeddings=64)), lm, _logits_ce, True),
        ZooCase("bloom", _seeded(_hf("BloomForCausalLM", "BloomConfig", vocab_size=200, hidden_size=64, n_layer=2,
                                     n_head=4)), lm, _logits_ce, True),
        ZooCase("bart", _seeded(_hf("BartForConditionalGeneration", "BartConfig", vocab_size=200, d_model=64,
                                    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                    max_position_embeddings=64)),
                _lm_tokens(200, 16, seq2seq=True), _logits_ce, True),
        ZooCase("swin", _seeded(_hf("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=2,
                                    embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, **cls)),
                pix, _logits_ce, True),
        ZooCase("deit", _seeded(_hf("DeiTForImageClassification", "DeiTConfig", image_size=32, patch_size=8,
                                    **_VISION, **cls)), pix, _logits_ce, True),
        ZooCase("beit", _seeded(_hf("BeitForImageClassification", "BeitConfig", image_size=32, patch_size=8,
                                    **_TEXT, **cls)), pix, _logits_ce, True),
        ZooCase("dinov2", _seeded(_hf("Dinov2ForImageClassification", "Dinov2Config", image_size=32, patch_size=8,
                                      **_VISION, **cls)), pix, _logits_ce, True),
        ZooCase("segformer", _seeded(_hf("SegformerForImageClassification", "SegformerConfig", num_encoder_blocks=2,
                                         depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                         num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                         decoder_hidden_size=32, **cls)), pix, _logits_ce, True),
        ZooCase("regnet", _seeded(_hf("RegNetForImageClassification", "RegNetConfig", embedding_size=16,
                                      hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, **cls)),
                pix, _logits_ce, True, True),
        ZooCase("convnextv2", _seeded(_hf("ConvNextV2ForImageClassification", "ConvNextV2Config", num_stages=2,
                                          hidden_sizes=[16, 32], depths=[1, 1], **cls)), pix, _logits_ce, True),
        ZooCase("levit", _seeded(_hf("LevitForImageClassification", "LevitConfig", image_size=32,
                                     hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
                                     key_dim=[8, 8, 8], **cls)), pix, _logits_ce, True, True),
        ZooCase("poolformer", _seeded(_hf("PoolFormerForImageClassification", "PoolFormerConfig",
                                          hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], **cls)),
                pix, _logits_ce, True),
        ZooCase("mobilevit", _seeded(_hf("MobileViTForImageClassification", "MobileViTConfig", image_size=32,
                                         hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 80],
                                         **cls)), pix, _logits_ce, True, True),
        ZooCase("vit-mae", _seeded(_hf("ViTMAEForPreTraining", "ViTMAEConfig", image_size=32, patch_size=8,
                                       **_VISION, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                       decoder_num_attention_heads=2, decoder_intermediate_size=64)),
                pix, _mae_loss, True),
    ]


MORE: dict[str, ZooCase] = {c.name: c for c in _cases()}
