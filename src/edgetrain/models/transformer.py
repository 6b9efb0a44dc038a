"""A small pre-norm transformer encoder classifier, written from plain layers so torch.fx traces it.

Layout (children in forward order, so the module tree is also the chain of stages)::

    embed   token ids [B, L] -> nn.Embedding, or features [B, L, input_dim] -> nn.Linear;
            plus a learned positional embedding sliced to L, then dropout      -> [B, L, d_model]
    blocks  num_layers x EncoderBlock (pre-norm):
                x = x + Dropout(SelfAttention(LayerNorm(x)))
                x = x + Dropout(FeedForward(LayerNorm(x)))                    -> [B, L, d_model]
    norm    final LayerNorm (pre-norm blocks leave the residual stream unnormalised)
    pool    mean over the L positions                                          -> [B, d_model]
    head    nn.Linear                                                          -> [B, num_classes]

Pre-norm (Xiong et al., 2020) rather than the original post-norm: it trains from scratch without a
learning-rate warm-up, which suits short edge fine-tuning runs. There is no padding mask: every
position of every sequence is a real token and counts in the mean. Position ids are a slice of the
positional-embedding parameter taken inside ``embed``, so no tensor created in ``forward`` is shared by
two blocks: exactly one tensor crosses every boundary between children and between encoder blocks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TransformerClassifier", "EncoderBlock", "SelfAttention", "transformer_classifier"]


class _InputEmbedding(nn.Module):
    """Token or feature embedding plus a learned positional embedding, then dropout."""

    def __init__(self, d_model: int, max_len: int, dropout: float, vocab_size: int | None,
                 input_dim: int | None) -> None:
        super().__init__()
        self.max_len = max_len
        self.proj: nn.Module = (nn.Embedding(vocab_size, d_model) if vocab_size is not None
                                else nn.Linear(int(input_dim), d_model))  # type: ignore[arg-type]
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # first, so the raw input is dead once the embedding starts
        # narrow() rejects L > max_len itself ("start (0) + length (L) exceeds dimension size"),
        # which keeps assertion nodes out of the traced graph.
        return self.drop(h + self.pos.narrow(1, 0, h.size(1)))


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention over ``[B, L, d_model]`` (no mask).

    Args:
        d_model: width of the residual stream.
        nhead: number of heads; must divide ``d_model``.
        dropout: dropout on the attention probabilities.
    """

    def __init__(self, d_model: int, nhead: int, dropout: float) -> None:
        super().__init__()
        self.nhead = nhead
        self.head_dim = d_model // nhead
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length = x.size(0), x.size(1)
        # [B, L, 3*D] -> [3, B, heads, L, head_dim]
        qkv = self.qkv(x).reshape(b, length, 3, self.nhead, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        probs = self.attn_drop((q @ k.transpose(-2, -1)).softmax(dim=-1))  # [B, heads, L, L]
        context = (probs @ v).transpose(1, 2).reshape(b, length, self.nhead * self.head_dim)
        return self.out(context)


class EncoderBlock(nn.Module):
    """One pre-norm encoder layer: attention and a GELU feed-forward, each with a residual."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, nhead, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, dim_feedforward), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(dim_feedforward, d_model),
        )
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.ffn(self.norm2(x)))


class _MeanPool(nn.Module):
    """Mean over the sequence dimension: ``[B, L, D] -> [B, D]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


class TransformerClassifier(nn.Module):
    """Encoder-only sequence classifier; see :func:`transformer_classifier`."""

    def __init__(self, num_classes: int, *, vocab_size: int | None = None, input_dim: int | None = None,
                 d_model: int = 128, nhead: int = 4, num_layers: int = 4, dim_feedforward: int = 256,
                 max_len: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("transformer_classifier needs exactly one of vocab_size (token ids) or "
                             f"input_dim (float features); got vocab_size={vocab_size}, input_dim={input_dim}")
        sizes = dict(num_classes=num_classes, d_model=d_model, nhead=nhead, num_layers=num_layers,
                     dim_feedforward=dim_feedforward, max_len=max_len,
                     vocab_size=1 if vocab_size is None else vocab_size,
                     input_dim=1 if input_dim is None else input_dim)
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ValueError(f"transformer_classifier sizes must be >= 1; got {bad}")
        if d_model % nhead:
            raise ValueError(f"nhead={nhead} must divide d_model={d_model}")
        self.embed = _InputEmbedding(d_model, max_len, dropout, vocab_size, input_dim)
        self.blocks = nn.Sequential(*[EncoderBlock(d_model, nhead, dim_feedforward, dropout)
                                      for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.pool = _MeanPool()
        self.head = nn.Linear(d_model, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # BERT/ViT-style: N(0, 0.02) truncated at 2 std for weights and positions, zero biases.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.embed.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.norm(self.blocks(self.embed(x)))))


def transformer_classifier(num_classes: int, *, vocab_size: int | None = None,
                           input_dim: int | None = None, d_model: int = 128, nhead: int = 4,
                           num_layers: int = 4, dim_feedforward: int = 256, max_len: int = 512,
                           dropout: float = 0.1) -> TransformerClassifier:
    """Build a randomly initialised pre-norm transformer encoder classifier.

    Give ``vocab_size`` for token-id inputs (int64 ``[B, L]``) or ``input_dim`` for float feature
    sequences ``[B, L, input_dim]`` (e.g. MNIST as 28 rows of 28 pixels: ``input_dim=28``).

    Args:
        num_classes: size of the classification head.
        vocab_size: number of token ids; selects an ``nn.Embedding`` input.
        input_dim: features per position; selects an ``nn.Linear`` input.
        d_model: width of the residual stream.
        nhead: attention heads; must divide ``d_model``.
        num_layers: encoder blocks.
        dim_feedforward: hidden width of each feed-forward.
        max_len: the longest sequence the positional embedding covers; a longer input raises
            RuntimeError ("exceeds dimension size").
        dropout: dropout on embeddings, attention probabilities, feed-forward and residual branches.

    Returns:
        The model, in training mode; logits ``[B, num_classes]``.

    Raises:
        ValueError: when both or neither of ``vocab_size``/``input_dim`` are given, a size is not
            positive, or ``nhead`` does not divide ``d_model``.
    """
    return TransformerClassifier(num_classes, vocab_size=vocab_size, input_dim=input_dim, d_model=d_model,
                                 nhead=nhead, num_layers=num_layers, dim_feedforward=dim_feedforward,
                                 max_len=max_len, dropout=dropout)
