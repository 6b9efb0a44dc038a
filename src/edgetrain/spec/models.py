"""Model specs of the command line: a factory import path, an in-project model, or an offline Hugging Face model.

* ``"pkg.module:build"``: ``build(**kwargs)`` (or the ``nn.Module`` named there); ``num_classes``,
  ``in_channels`` (images) and ``in_features`` (tables) are passed when the factory takes them and the
  caller knows them from the data.
* ``"mobilenet_v2"``, ``"resnet18"``, ``"transformer"``: :func:`edgetrain.models.get_model`.
* ``"hf:NAME"`` (a hub name in the local cache, or a local directory): a classifier from ``transformers``
  loaded with ``local_files_only=True`` (a head of another number of classes is replaced): for a text
  model a sequence classifier whose forward takes ``input_ids`` and an optional ``attention_mask``, for a
  vision model (a config with channels and no vocabulary) an image classifier taking ``pixel_values``;
  either returns the logits. With ``task="language-modeling"``, a causal language model
  (``AutoModelForCausalLM``) returning its ``ModelOutput``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["build_model", "resolve_import", "is_in_project", "hf_reads_images", "hf_image_input"]

log = logging.getLogger(__name__)


def is_in_project(spec: str) -> bool:
    from ..models import MODEL_NAMES

    return spec in MODEL_NAMES


def resolve_import(spec: str, what: str) -> Any:
    """The object an import path ``pkg.module:attr`` names (the current directory is importable).

    Raises:
        ConfigError: the module does not import or has no such attribute.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} is not an import path of the form 'package.module:name'")
    if "" not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: a factory module in the working directory imports
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {spec!r}: cannot import {module_name!r} ({e})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _fill(fn: Any, kwargs: dict[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus the entries of ``known`` that ``fn`` accepts and ``kwargs`` lacks."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = dict(kwargs)
    for k, v in known.items():
        if v is not None and k not in out and (k in params or (takes_any and k == "num_classes")):
            out[k] = v
    return out


class _LogitsOnly(nn.Module):
    """A Hugging Face classifier whose forward takes token ids and returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class _PixelLogits(nn.Module):
    """A Hugging Face image classifier whose forward takes a batch of images and returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


@functools.lru_cache(maxsize=8)
def _hf_config(name: str) -> Any:
    """Hugging Face model ``name``'s config, offline (read once per process: the CLI asks it several things).

    Raises:
        ConfigError: transformers is missing or the config is not available offline.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(f"model 'hf:{name}' needs transformers: pip install 'edgetrain[text]'") from None
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"Hugging Face model {name!r} is not available offline (not in the local cache nor a "
                          f"directory): {' '.join(str(e).split())[:200]}") from None


def hf_reads_images(name: str) -> bool:
    """Whether Hugging Face model ``name`` (offline) reads images (a vision config: channels, no vocabulary).

    Raises:
        ConfigError: transformers is missing or the model's config is not available offline.
    """
    cfg = _hf_config(name)
    return hasattr(cfg, "num_channels") and not hasattr(cfg, "vocab_size")


def hf_image_input(name: str) -> dict[str, Any]:
    """What a Hugging Face image model expects of its images: ``size`` and ``channels`` (its config's
    ``image_size`` and ``num_channels``, where it has them) and ``mean`` / ``std`` (its image processor's,
    where one is saved with it)."""
    out: dict[str, Any] = {}
    cfg = _hf_config(name)
    size, channels = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
    if isinstance(size, int):
        out["size"] = size
    if isinstance(channels, int):
        out["channels"] = channels
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(name, local_files_only=True)
    except Exception:  # no processor saved with the model (or no vision extras): the data's own statistics
        return out
    mean, std = getattr(proc, "image_mean", None), getattr(proc, "image_std", None)
    if mean is not None and std is not None:
        out.update(mean=[float(v) for v in mean], std=[float(v) for v in std])
    return out


def _hf_causal_lm(name: str, kwargs: dict[str, Any], vocab: int | None) -> nn.Module:
    """A causal language model (``AutoModelForCausalLM``) returning its ``ModelOutput`` (the logits in it),
    its cache off as training wants it."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConfigError(f"model 'hf:{name}' needs transformers: pip install 'edgetrain[text]'") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, **kwargs)
    except OSError as e:
        raise ConfigError(f"Hugging Face model {name!r} is not available offline (not in the local cache nor a "
                          f"directory): {' '.join(str(e).split())[:200]}") from None
    except ValueError as e:  # a config of a model that does not generate text
        raise ConfigError(f"Hugging Face model {name!r} is not a causal language model "
                          f"({' '.join(str(e).split())[:200]})") from None
    size = model.get_input_embeddings().num_embeddings
    if vocab is not None and vocab > size:
        raise ConfigError(f"the tokenizer of {name!r} has {vocab} tokens and the model embeds {size}: save the "
                          "model and tokenizer together (model.resize_token_embeddings(len(tokenizer)))")
    model.config.use_cache = False
    model.train()
    return model


def _hf_model(name: str, kwargs: dict[str, Any], num_classes: int | None) -> nn.Module:
    try:
        from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification
    except ImportError:
        raise ConfigError(f"model 'hf:{name}' needs transformers: pip install 'edgetrain[text]'") from None
    images = hf_reads_images(name)
    if num_classes is not None:
        kwargs.setdefault("num_labels", num_classes)
        kwargs.setdefault("ignore_mismatched_sizes", True)  # a pretrained head of other classes is replaced
    auto = AutoModelForImageClassification if images else AutoModelForSequenceClassification
    try:
        model = auto.from_pretrained(name, local_files_only=True, **kwargs)
    except OSError as e:
        raise ConfigError(f"Hugging Face model {name!r} is not available offline (not in the local cache nor a "
                          f"directory): {' '.join(str(e).split())[:200]}") from None
    except ValueError as e:  # a config of a model with no classifier of this kind
        raise ConfigError(f"Hugging Face model {name!r} has no {'image' if images else 'sequence'} classifier "
                          f"({' '.join(str(e).split())[:200]})") from None
    cfg = model.config
    if getattr(cfg, "pad_token_id", None) is None and isinstance(getattr(cfg, "eos_token_id", None), int):
        # decoder models (GPT-2, ...) have no padding token; their classifier finds each text's last token
        # by it, and edgetrain's text data pads with the same one (spec.text)
        cfg.pad_token_id = cfg.eos_token_id
    model.train()  # from_pretrained returns it in eval mode; it is built here to be trained (dropout on)
    return _PixelLogits(model) if images else _LogitsOnly(model)


def build_model(spec: str, kwargs: Mapping[str, Any] | None = None, *, num_classes: int | None = None,
                in_channels: int | None = None, image_size: int | None = None,
                in_features: int | None = None, task: str | None = None) -> nn.Module:
    """Build the model a spec names (see the module doc).

    Args:
        spec: the model spec.
        kwargs: keyword arguments of the factory.
        num_classes: outputs the data needs, passed when the factory takes ``num_classes``.
        in_channels: input channels of image data, passed when the factory takes ``in_channels``.
        image_size: side of image inputs (in-project ResNet-18 uses its small-input stem below 64).
        in_features: feature columns of table data, passed when the factory takes ``in_features``.
        task: ``"language-modeling"``: an ``hf:`` model is built as a causal language model
            (``num_classes``: the tokenizer's vocabulary, checked against the model's embedding).

    Raises:
        ConfigError: the spec names nothing importable, the factory rejects its arguments or does not
            return an ``nn.Module``.
    """
    kwargs = dict(kwargs or {})
    known = {"num_classes": num_classes, "in_channels": in_channels}
    if spec.startswith("hf:"):
        if task == "language-modeling":
            return _hf_causal_lm(spec[3:], kwargs, num_classes)
        return _hf_model(spec[3:], kwargs, num_classes)
    if is_in_project(spec):
        from ..models import get_model

        if spec == "resnet18" and image_size is not None:
            known["small_input"] = image_size < 64
        if spec == "transformer":
            known = {"num_classes": num_classes}
        fn: Any = lambda **kw: get_model(spec, **kw)  # noqa: E731
        from ..models import _BUILDERS

        kwargs = _fill(_BUILDERS[spec], kwargs, known)
    elif ":" in spec:
        known["in_features"] = in_features
        fn = resolve_import(spec, "model")
        if isinstance(fn, nn.Module):
            return fn
        if not callable(fn):
            raise ConfigError(f"model {spec!r} names a {type(fn).__name__}, not a factory or an nn.Module")
        kwargs = _fill(fn, kwargs, known)
    else:
        from ..models import MODEL_NAMES

        raise ConfigError(f"unknown model {spec!r}: give an import path 'package.module:build', an in-project "
                          f"model ({', '.join(MODEL_NAMES)}) or 'hf:NAME'")
    try:
        model = fn(**kwargs)
    except TypeError as e:
        raise ConfigError(f"model {spec!r} rejected its arguments {sorted(kwargs)}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
    log.info("model %s built with %s", spec, kwargs)
    return model
