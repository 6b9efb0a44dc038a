"""Text for language modelling: documents turned into blocks of tokens a causal language model learns to continue.

Every document is tokenized whole, followed by the tokenizer's end-of-text token, and the documents are laid
end to end and cut into blocks of ``length`` tokens, as Hugging Face's ``run_clm`` recipe does: every sample
has the planned shape, so a memory budget planned for one block holds for all. The last, partial block is
padded; its padding is masked from attention and labelled -100, so it counts for nothing in the loss
(:class:`edgetrain.TokenCrossEntropyLoss` with ``shift=True``). The labels are the input ids themselves.

Sources: a ``.txt`` file (one document per line; blank lines are skipped), a ``.jsonl`` / ``.json`` file of
records or a ``.csv`` / ``.tsv`` table with a ``text`` column, or a Hugging Face dataset saved to disk with a
``text`` column (its ``validation`` split, if any, is the validation set).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from .data import LoadedData, is_saved_dataset, saved_splits
from .text import TokenDataset, load_tokenizer

__all__ = ["read_texts", "token_blocks", "load_lm_data", "TASK"]

log = logging.getLogger(__name__)

TASK = "language-modeling"


def _column(records: Sequence[Any], where: Path) -> list[str]:
    if not records:
        return []
    if not all(isinstance(r, dict) and "text" in r for r in records):
        keys = sorted({k for r in records if isinstance(r, dict) for k in r})
        raise ConfigError(f"{where}: language modelling reads the 'text' of every record; found keys "
                          f"{', '.join(keys) or 'none'}")
    return [str(r["text"]) for r in records]


def read_texts(path: Path) -> tuple[list[str], list[str] | None]:
    """The documents of a source (see the module doc), and those of its validation split where it has one.

    Raises:
        ConfigError: the source does not exist, has no text, or is of a format this task does not read.
    """
    if path.is_dir():
        if not is_saved_dataset(path):
            raise ConfigError(f"{path}: language modelling reads a .txt, .jsonl, .json, .csv or .tsv file or a "
                              "Hugging Face dataset saved to disk, not a folder")
        train, val = saved_splits(path)
        if "text" not in train.column_names:
            raise ConfigError(f"{path}: language modelling reads the column 'text'; found "
                              f"{', '.join(train.column_names)}")
        return [str(t) for t in train["text"]], None if val is None else [str(t) for t in val["text"]]
    if not path.is_file():
        raise ConfigError(f"data {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()], None
    if suffix == ".jsonl":
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        try:
            return _column([json.loads(ln) for ln in lines], path), None
        except ValueError as e:
            raise ConfigError(f"{path}: not JSON lines ({e})") from None
    if suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{path}: not JSON ({e})") from None
        return _column(records if isinstance(records, list) else [records], path), None
    if suffix in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8") as f:
            return _column(list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")), path), None
    raise ConfigError(f"data file {path}: language modelling reads .txt (a document per line), .jsonl, .json, "
                      f".csv or .tsv (a 'text' column), or a Hugging Face dataset saved to disk; not {suffix!r}")


def token_blocks(tokenizer: Any, texts: Sequence[str], length: int) -> TokenDataset:
    """``texts`` tokenized, each followed by the end-of-text token, laid end to end and cut into blocks of
    ``length`` tokens; the last block padded, its padding masked and labelled -100. Samples are
    ``({"input_ids": ..., "attention_mask": ...}, labels)``, the labels a block's ids.

    Raises:
        ConfigError: the tokenizer has neither an end-of-text nor a padding token, or the texts hold no token.
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
        raise ConfigError("the tokenizer has no end-of-text, separator or padding token to end documents with")
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    if not stream:
        raise ConfigError("the training text holds no token")
    n = -(-len(stream) // length)
    ids = torch.full((n * length,), pad, dtype=torch.long)
    ids[:len(stream)] = torch.tensor(stream, dtype=torch.long)
    mask = torch.zeros(n * length, dtype=torch.long)
    mask[:len(stream)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return TokenDataset(ids.view(n, length), mask.view(n, length), labels.view(n, length))


def load_lm_data(spec: str, text_model: str | None, length: int, val_spec: str | None = None) -> LoadedData:
    """The blocks of a language-modelling source (and of its validation split, or of ``val_spec``).

    Returns:
        a :class:`~edgetrain.spec.data.LoadedData` of task ``language-modeling``: ``num_classes`` is the
        tokenizer's vocabulary, ``preprocessing`` names the tokenizer and the block length.

    Raises:
        ConfigError: no Hugging Face model to take the tokenizer from, or a source it cannot read.
    """
    if text_model is None:
        raise ConfigError("task: language-modeling trains a Hugging Face causal language model: set model: "
                          "hf:NAME (a hub name in the local cache, or a directory with its tokenizer)")
    tokenizer = load_tokenizer(text_model)
    texts, val_texts = read_texts(Path(spec))
    if val_spec is not None:
        val_texts = read_texts(Path(val_spec))[0]
    train = token_blocks(tokenizer, texts, length)
    val = token_blocks(tokenizer, val_texts, length) if val_texts else None
    log.info("%s: %d documents, %d blocks of %d tokens", spec, len(texts), len(train), length)
    pre = {"kind": "text-lm", "tokenizer": text_model, "length": length}
    return LoadedData(train, val, len(tokenizer), None, TASK, (), None, pre)
