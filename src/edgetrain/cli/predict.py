"""``edgetrain predict WEIGHTS INPUT``: run a model ``edgetrain train`` saved on new inputs, prepared as its
training data was.

The card ``edgetrain train`` writes beside the weights (same name, ``.json``) says how to build the model and
how its inputs were prepared; the inputs are prepared the same way here: images resized, scaled and
standardised with the training folder's numbers; a table's feature columns picked by name and standardised
with the training rows' numbers (a target column, if the table still has one, is left out); texts tokenized
with the model's tokenizer. Predictions are written as CSV: per input, the predicted class and its
probability (classification), the predicted values (regression), or the continuation of each prompt, greedy
or sampled (language modelling).
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..batch import call_model
from ..errors import ConfigError

__all__ = ["Sampling", "load_card", "predict", "cmd_predict"]


def load_card(weights: Path, card: Path | None = None) -> dict[str, Any]:
    """The card of ``weights`` (``card``, else the ``.json`` beside them).

    Raises:
        ConfigError: no card, or not one ``edgetrain train`` wrote.
    """
    from .train import card_path

    path = card or card_path(weights)
    if not path.is_file():
        raise ConfigError(f"no card {path} beside {weights}: predict needs the .json `edgetrain train` writes with "
                          "save: (or give it with --card)")
    try:
        out = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path} is not JSON ({e})") from None
    if not isinstance(out, dict) or not {"model", "input", "task"} <= set(out):
        raise ConfigError(f"{path} is not a card `edgetrain train` wrote (it lacks model, input or task)")
    return out


def build_trained(weights: Path, card: dict[str, Any]) -> nn.Module:
    """The model the card names, with the saved weights, in eval mode."""
    from ..spec import build_model

    pre = card["input"]
    if str(card["model"]).startswith("hf:"):  # its pretrained weights are replaced below: no load report
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    model = build_model(card["model"], card.get("model_kwargs") or {}, num_classes=card.get("outputs"),
                        in_channels=card.get("in_channels"), image_size=pre.get("size"),
                        in_features=card.get("in_features"), task=card["task"])
    try:
        state = torch.load(weights, weights_only=True, map_location="cpu")
        model.load_state_dict(state)
    except (RuntimeError, OSError, ValueError) as e:
        raise ConfigError(f"{weights} does not load into {card['model']}: {' '.join(str(e).split())[:300]}") from None
    return model.eval()


def _images(source: Path, pre: dict[str, Any]) -> Iterator[tuple[list[str], torch.Tensor]]:
    from ..spec.images import IMAGE_SUFFIXES, read_image

    files = [source] if source.is_file() else sorted(
        p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES + (".npy",))
    if not files:
        raise ConfigError(f"no images under {source}")
    mean = torch.tensor(pre["mean"]).reshape(-1, 1, 1)
    std = torch.tensor(pre["std"]).reshape(-1, 1, 1)
    for start in range(0, len(files), 64):
        part = files[start:start + 64]
        x = torch.stack([torch.from_numpy(read_image(p, pre["size"], pre["channels"])) for p in part])
        yield [str(p) for p in part], (x - mean) / std


def _rows(source: Path, pre: dict[str, Any], text: bool) -> tuple[list[str], Any]:
    """A table's rows as the model's inputs: ``(row labels, features or texts)``; a ``.txt`` file is one text
    per line."""
    from ..spec.tables import input_columns

    if source.suffix.lower() == ".txt":
        if not text:
            raise ConfigError(f"{source}: a .txt file is texts, one per line; this model reads table rows: give a "
                              ".csv, .tsv, .jsonl or .json file with its columns")
        texts = [ln.strip() for ln in source.read_text(encoding="utf-8-sig").splitlines() if ln.strip()]
        if not texts:
            raise ConfigError(f"{source} holds no text")
        return [f"line {i + 1}" for i in range(len(texts))], texts
    if source.is_dir():
        raise ConfigError(f"{source} is a folder: this model reads {'texts' if text else 'table rows'}; give a "
                          f"{'.txt, ' if text else ''}.csv, .tsv, .jsonl or .json file")
    table = input_columns(source, [pre["text_column"]] if text else list(pre["features"]), text=text)
    if text:
        assert table.text is not None
        return [f"row {i + 1}" for i in range(len(table.text))], table.text
    return [f"row {i + 1}" for i in range(len(table.features))], torch.as_tensor(table.features)


def _batches(source: Path, card: dict[str, Any]) -> Iterator[tuple[list[str], Any]]:
    pre = card["input"]
    kind = pre.get("kind")
    if kind == "image":
        yield from _images(source, pre)
        return
    if kind == "text":
        from ..spec.text import load_tokenizer, tokenize

        if "tokenizer" not in pre:
            raise ConfigError("this model was trained on token ids a saved dataset held (no tokenizer is named in "
                              "its card): tokenize new texts as that dataset was and run the model from Python")
        labels, texts = _rows(source, pre, text=True)
        tok = load_tokenizer(pre["tokenizer"])
        for start in range(0, len(texts), 64):
            ids, mask = tokenize(tok, texts[start:start + 64], int(pre["max_length"]))
            yield labels[start:start + 64], {"input_ids": ids, "attention_mask": mask}
        return
    if kind == "table":
        labels, x = _rows(source, pre, text=False)
        if "mean" in pre:
            x = (x - torch.tensor(pre["mean"])) / torch.tensor(pre["std"])
        for start in range(0, len(labels), 256):
            yield labels[start:start + 256], x[start:start + 256]
        return
    raise ConfigError(f"predict reads images, tables and texts; this model was trained on {kind!r} data (from "
                      f"{pre.get('factory') or pre.get('columns') or 'arrays'}): run it from Python")


@dataclass(frozen=True)
class Sampling:
    """How a language model continues a prompt: greedy at ``temperature`` 0, else drawn at that temperature
    from the ``top_k`` most likely tokens (0: all) whose probabilities sum to ``top_p``, seeded."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1 (got temperature "
                              f"{self.temperature}, top_k {self.top_k}, top_p {self.top_p})")

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k or None, "top_p": self.top_p}


def _continuations(model: nn.Module, source: Path, card: dict[str, Any], new_tokens: int,
                   sampling: Sampling) -> Iterator[list[str]]:
    """A language model's continuation of each prompt (a line of a .txt file, or a table's text column)."""
    from ..spec.text import load_tokenizer

    pre = card["input"]
    labels, prompts = _rows(source, {**pre, "text_column": "text"}, text=True)
    if not hasattr(model, "generate"):
        raise ConfigError(f"{card['model']} has no generate(): continue its prompts from Python")
    tok = load_tokenizer(pre["tokenizer"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    yield ["input", "prompt", "continuation"]
    torch.manual_seed(sampling.seed)
    for name, prompt in zip(labels, prompts):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        if ids["input_ids"].shape[1] == 0:
            raise ConfigError(f"{source}, {name}: the prompt holds no token")
        out = model.generate(**ids, max_new_tokens=new_tokens, pad_token_id=pad, **sampling.generate_kwargs())
        yield [name, prompt, tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)]


def predict(weights: Path, source: Path, card: dict[str, Any], new_tokens: int = 32,
            sampling: Sampling = Sampling()) -> Iterator[list[str]]:
    """CSV rows of predictions, the header first (a language model's: each prompt's continuation,
    ``new_tokens`` tokens at most, greedy unless ``sampling`` says otherwise)."""
    model = build_trained(weights, card)
    if card["task"] == "language-modeling":
        sampling.check()
        with torch.no_grad():
            yield from _continuations(model, source, card, new_tokens, sampling)
        return
    classes: Sequence[str] = card.get("classes") or []
    classification = card["task"] == "classification"
    batches = _batches(source, card)
    first = next(batches)  # inputs the model cannot read are refused before any output
    yield ["input", "prediction", "probability"] if classification else \
        ["input"] + [f"output {i + 1}" for i in range(int(card.get("outputs") or 1))]
    with torch.no_grad():
        for labels, x in itertools.chain([first], batches):
            out = call_model(model, x)
            if classification:
                prob, idx = torch.softmax(out.float(), dim=1).max(dim=1)
                for name, i, p in zip(labels, idx.tolist(), prob.tolist()):
                    yield [name, classes[i] if i < len(classes) else str(i), f"{p:.4f}"]
            else:
                for name, row in zip(labels, out.reshape(len(labels), -1).tolist()):
                    yield [name] + [f"{v:.6g}" for v in row]


def cmd_predict(args: Any) -> int:
    weights = Path(args.weights)
    if not weights.is_file():
        raise ConfigError(f"no weights file {weights}")
    source = Path(args.input)
    if not source.exists():
        raise ConfigError(f"no input {source}")
    card = load_card(weights, Path(args.card) if args.card else None)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if not args.out:
        writer = csv.writer(sys.stdout)
        for row in predict(weights, source, card, args.max_new_tokens, sampling):
            writer.writerow(row)
        return 0
    path = Path(args.out)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as f:  # a failure half way leaves no partial file behind
            writer = csv.writer(f)
            n = sum(1 for row in predict(weights, source, card, args.max_new_tokens, sampling)
                    if writer.writerow(row) is not None) - 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{n} predictions written to {path}", file=sys.stderr)
    return 0
