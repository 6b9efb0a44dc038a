"""`TrainConfig`: what ``edgetrain train`` runs, one typed dataclass that YAML files, flags and ``key=value`` load into.

Precedence: the defaults below, then the config file, then command-line flags, then ``key=value``
overrides (``model_kwargs.width_mult=0.5`` sets one entry of a dict field). Values of flags and
overrides are read as YAML scalars (``3``, ``0.1``, ``true``, ``null``, ``{a: 1}``). An unknown key is an
error that names the valid ones.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import ConfigError

__all__ = ["TrainConfig", "load_train_config", "parse_value", "config_fields"]


def _opt(default: Any, help: str) -> Any:  # noqa: A002
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``edgetrain train`` (each is also a ``--flag`` and a YAML key; see ``edgetrain train --help``)."""

    model: str = _opt("mobilenet_v2", "model: an import path to a factory 'pkg.module:build', an in-project "
                      "model (mobilenet_v2, resnet18, transformer), or 'hf:NAME' (a Hugging Face model "
                      "available offline)")
    model_kwargs: dict = _opt({}, "keyword arguments of the model factory (num_classes and in_channels are "
                              "filled in from the data when the factory takes them)")
    data: str = _opt("mnist", "training data: an image folder (one subfolder per class), a table (.csv, .tsv, "
                     ".jsonl, .json; a column of text for model hf:NAME), a .npy / .npz file, a Hugging Face "
                     "dataset saved to disk, an import path 'pkg.module:make' to a dataset factory, or 'mnist' "
                     "(the digits in the data extra)")
    data_kwargs: dict = _opt({}, "keyword arguments of a dataset factory")
    val_data: str | None = _opt(None, "validation data, same forms as data (default: val_fraction of data)")
    val_fraction: float = _opt(0.0, "share of the training data held out for evaluation when val_data is unset")
    image_size: int = _opt(32, "image folders and mnist: images are resized to this many pixels a side")
    channels: int = _opt(3, "image folders: 3 (RGB) or 1 (grey)")
    image_cache: str = _opt("256MiB", "image folders: keep the decoded images in memory up to this size; a larger "
                            "folder is read from disk as batches are drawn (num_workers read in parallel)")
    target_column: int | str = _opt(-1, "tables / .npy: the column holding the target, by index (-1: the last; "
                                    "JSON records: label, where there is one) or, with a header, by name")
    max_length: int = _opt(128, "text CSV with model hf:NAME: at most this many tokens per text (every text is "
                           "padded to the longest, so every batch has the planned shape); language-modeling: "
                           "the tokens of a block")
    standardize: bool = _opt(True, "CSV tables: standardise each feature column with the training rows' mean and "
                             "std (written beside the saved weights)")
    task: str = _opt("auto", "classification, regression, auto (classification when the targets are whole "
                     "numbers) or language-modeling (a Hugging Face causal LM, model: hf:NAME, learns to continue "
                     "the data's text: documents cut into blocks of max_length tokens)")
    epochs: int = _opt(1, "epochs to train (counting those before a resume)")
    batch_size: int = _opt(32, "logical batch per optimizer step")
    optimizer: str = _opt("sgd", "sgd, adam or adamw")
    lr: float = _opt(0.01, "learning rate")
    momentum: float = _opt(0.9, "SGD momentum")
    weight_decay: float = _opt(0.0, "weight decay")
    scheduler: str = _opt("none", "LR schedule: none, cosine (to 0 over all steps) or exponential (x gamma "
                          "each epoch)")
    gamma: float = _opt(0.9, "exponential schedule: LR factor per epoch")
    memory_budget: str | None = _opt(None, "peak memory budget, e.g. 300MiB (null: unbounded)")
    solver: str = _opt("dp", "planner: dp, no_saving, recompute_all, chen_sqrt, checkpoint_sequential, poet")
    micro_batch_size: int | None = _opt(None, "fix the micro-batch size (null: the planner chooses)")
    paging: bool = _opt(False, "let the planner page saved activations to disk as well as recompute")
    page_optimizer_state: bool | str = _opt("auto", "with a memory_budget, write the optimizer's large state "
                                            "(momentum, Adam's moments) to a file during the forward and "
                                            "backward passes and read it back for the update: auto (when "
                                            "the planner finds that faster, or the only way to fit), true "
                                            "or false")
    state_dir: str | None = _opt(None, "directory of that file (null: the system's temporary directory); "
                                 "put it on fast local storage")
    fused_update: bool | str = _opt("auto", "with a memory_budget, update each parameter inside the backward as "
                                    "soon as its gradient is complete and free that gradient (exact; whole-batch "
                                    "steps, off with grad_clip_norm): auto (when the planner finds that faster, "
                                    "or the only way to fit), true or false")
    compile: bool = _opt(False, "run the step as torch.compile code where the plan keeps every activation and a "
                         "measured compiled trial fits the memory_budget (results equal up to rounding; the first "
                         "step compiles); eager, with a warning saying why, elsewhere")
    layout: str = _opt("keep", "how a convolutional model's images are fed: keep (as loaded), channels_last "
                       "(oneDNN's fast CPU layout; results equal up to rounding) or auto (profiled both ways, "
                       "channels_last where predicted at least 5 percent faster inside the memory_budget)")
    grad_clip_norm: float | None = _opt(None, "clip the gradient norm to this before each step (null: no clipping)")
    early_stopping_patience: int | None = _opt(None, "stop after this many epochs without a better val_loss")
    checkpoint_dir: str | None = _opt(None, "directory of crash-safe checkpoints (null: none)")
    checkpoint_every_steps: int = _opt(0, "also checkpoint every this many steps (0: at epoch ends only)")
    keep_checkpoints: int = _opt(3, "how many checkpoints to keep")
    resume: bool = _opt(False, "continue from the newest good checkpoint in checkpoint_dir")
    log_dir: str | None = _opt(None, "write steps.csv and epochs.csv here (null: no log files)")
    tensorboard: bool = _opt(False, "also write TensorBoard events to log_dir")
    seed: int = _opt(0, "seed of the model initialisation, the shuffling and the validation split")
    num_workers: int = _opt(0, "DataLoader worker processes")
    threads: int = _opt(0, "torch threads (0: torch's default)")
    progress: bool | None = _opt(None, "progress bar (null: only on a terminal outside CI)")
    save: str | None = _opt(None, "write the trained weights (state_dict) here, atomically, and beside them (same "
                            "name, .json) the model spec, classes and input preprocessing")
    report: str | None = _opt(None, "write the plan report (HTML and PNGs) here after training")

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), f.type))
        choices = {"task": ("auto", "classification", "regression", "language-modeling"),
                   "layout": ("keep", "channels_last", "auto"),
                   "optimizer": ("sgd", "adam", "adamw"),
                   "scheduler": ("none", "cosine", "exponential")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        for name in ("page_optimizer_state", "fused_update"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ConfigError(f"{name} must be auto, true or false; got {getattr(self, name)!r}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ConfigError(f"epochs and batch_size must be >= 1; got {self.epochs} and {self.batch_size}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1); got {self.val_fraction}")
        from ..units import parse_bytes

        try:
            parse_bytes(self.image_cache)
        except ValueError as e:
            raise ConfigError(f"image_cache: {e}") from None
        if self.memory_budget is not None:
            try:
                parse_bytes(self.memory_budget)
            except ValueError as e:
                raise ConfigError(f"memory_budget: {e}") from None


def config_fields() -> list[tuple[str, Any, str, str]]:
    """``(name, default, type, help)`` of every :class:`TrainConfig` option."""
    out = []
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, default, str(f.type), f.metadata.get("help", "")))
    return out


def _coerce(name: str, value: Any, typ: Any) -> Any:
    typ = str(typ).replace(" ", "")
    optional = typ.endswith("|None")
    base = typ[: -len("|None")] if optional else typ
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} must not be null")
    try:
        if base == "int|str":  # an index or a name
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError
            return int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value
        if base == "bool|str":  # a switch with a third, named setting ("auto")
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
                return value.lower() in ("true", "yes", "on")
            if isinstance(value, (bool, str)):
                return value
            raise ValueError
        if base == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base == "dict":
            if not isinstance(value, Mapping):
                raise ValueError
            return dict(value)
        if base == "str":
            if isinstance(value, (dict, list, bool)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {'null or ' if optional else ''}a{'n' if base == 'int' else ''} "
                          f"{base}; got {value!r}") from None
    return value


def parse_value(text: str) -> Any:
    """A flag or override value as a YAML scalar (JSON where PyYAML is missing; else the text itself)."""
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except ValueError:
            return {"null": None, "true": True, "false": False}.get(text, text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading a YAML config needs PyYAML: pip install 'edgetrain[cli]' (or write the "
                              "config as .json)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of options, got {type(data).__name__}")
    return data


def _check_keys(keys: Sequence[str], where: str) -> None:
    valid = [f.name for f in fields(TrainConfig)]
    bad = [k for k in keys if k not in valid]
    if bad:
        raise ConfigError(f"unknown option{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))} in {where}; "
                          f"valid options: {', '.join(valid)}")


def load_train_config(path: str | None = None, flags: Mapping[str, Any] | None = None,
                      overrides: Sequence[str] = ()) -> TrainConfig:
    """Build a :class:`TrainConfig` from a YAML/JSON file, flag values and ``key=value`` strings.

    Raises:
        ConfigError: the file is missing or malformed, a key is unknown, or a value has the wrong type.
    """
    values: dict[str, Any] = {}
    if path is not None:
        data = _read_file(Path(path))
        _check_keys(list(data), str(path))
        values.update(data)
    if flags:
        values.update({k: v for k, v in flags.items()})
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must be key=value, e.g. epochs=3")
        top, _, sub = key.partition(".")
        _check_keys([top], "the overrides")
        if sub:
            current = dict(values.get(top) or {})
            current[sub] = parse_value(raw)
            values[top] = current
        else:
            values[top] = parse_value(raw)
    try:
        return replace(TrainConfig(), **values)
    except TypeError as e:  # a field that is not init-able; should not happen (keys are checked)
        raise ConfigError(str(e)) from None
