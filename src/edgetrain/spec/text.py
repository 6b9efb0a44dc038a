"""Text inputs for Hugging Face models: a column of text turned into token ids and attention masks.

Every sequence of a data set is padded to one length (the longest text's, at most ``max_length`` tokens),
so every batch has the shape the plan was measured on: a memory budget planned for one sequence length is
kept for all of them. The attention mask goes to the model with the ids, so padding is never attended to.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError

__all__ = ["TokenDataset", "load_tokenizer", "tokenize"]

log = logging.getLogger(__name__)


class TokenDataset(Dataset):
    """Samples ``({"input_ids": ..., "attention_mask": ...}, target)`` of equal length."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor) -> None:
        if not len(input_ids) == len(attention_mask) == len(targets):
            raise ValueError("input_ids, attention_mask and targets differ in length")
        self.input_ids, self.attention_mask, self.targets = input_ids, attention_mask, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i]}, self.targets[i]


def load_tokenizer(name: str) -> Any:
    """The tokenizer of Hugging Face model ``name`` (a hub name in the local cache or a directory), offline.

    Raises:
        ConfigError: transformers is not installed, or the tokenizer is not available offline.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("text data needs transformers: pip install 'edgetrain[text]'") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer of {name!r} is not available offline (not in the local cache nor a "
                          f"directory): {' '.join(str(e).split())[:200]}") from None


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int,
             length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention masks ``[len(texts), L]`` (int64).

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: the texts.
        max_length: texts longer than this many tokens are cut to it.
        length: pad every sequence to exactly this length (a validation set takes its training set's);
            None: to the longest sequence of ``texts``.
    """
    if max_length < 2:
        raise ConfigError(f"max_length must be at least 2 tokens; got {max_length}")
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < max_length:
        max_length = limit  # the model's position embeddings end there
    enc = tokenizer(list(texts), truncation=False, padding=False)
    cut = sum(1 for ids in enc["input_ids"] if len(ids) > max_length)
    if cut:  # again, cut by the tokenizer (which keeps the closing special tokens)
        log.warning("%d of %d texts are longer than max_length=%d tokens and were cut", cut, len(texts), max_length)
        enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
    lengths = [len(ids) for ids in enc["input_ids"]]
    width = length if length is not None else max(lengths, default=1)
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    ids = torch.full((len(texts), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(texts), width), dtype=torch.int64)
    for i, seq in enumerate(enc["input_ids"]):
        seq = seq[:width]
        ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
        mask[i, :len(seq)] = 1
    return ids, mask
