"""``edgetrain train CONFIG``: build model, data, optimizer and schedule from a :class:`TrainConfig` and fit a Trainer."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, random_split

from ..config import options
from ..errors import ConfigError
from ..losses import TokenCrossEntropyLoss, perplexity
from ..spec import build_model, load_data
from ..spec.lm import TASK, load_lm_data
from ..units import parse_bytes
from .train_config import TrainConfig

__all__ = ["config_data", "config_example", "config_model", "config_plan_options", "prepare_options", "run_train",
           "spec_model_and_batch", "write_card", "card_path"]

log = logging.getLogger("edgetrain.cli")


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer, steps: int) -> tuple[Any, str]:
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1)), "step"
    if cfg.scheduler == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.gamma), "epoch"
    return None, "epoch"


def _accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(dim=1) == y).float().mean()


class _Printer:
    """Prints one line per epoch (the CLI may print; the library only logs)."""

    def __init__(self, out: Callable[[str], None], epochs: int, perplexity: bool = False) -> None:
        self.out, self.epochs, self.perplexity = out, epochs, perplexity

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        extra = "".join(f", {k} {v:.4f}" for k, v in logs.items() if k not in ("step", "train_loss"))
        if self.perplexity and "val_loss" in logs:  # the token-mean loss's exponential
            extra += f", val_perplexity {perplexity(logs['val_loss']):.2f}"
        self.out(f"epoch {epoch + 1}/{self.epochs}: train_loss {logs['train_loss']:.4f}{extra} "
                 f"(step {int(logs['step'])})")


def config_data(cfg: TrainConfig) -> tuple[Any, Any, Any]:
    """The data a config names, as ``(data, training set, validation set or None)``: text tokenized for its
    Hugging Face model, images at its input size, language-modelling text cut into token blocks; the validation
    set from ``val_data`` (prepared as the training data was) or split off by ``val_fraction``."""
    text_model, image_input = _hf_inputs(cfg)
    data_options = dict(kwargs=cfg.data_kwargs, image_size=cfg.image_size, channels=cfg.channels,
                        target_column=cfg.target_column, seed=cfg.seed, text_model=text_model,
                        max_length=cfg.max_length, standardize=cfg.standardize, image_stats=image_input or None,
                        image_cache_bytes=parse_bytes(cfg.image_cache))
    lm = cfg.task == TASK
    if lm:
        data = load_lm_data(cfg.data, text_model, cfg.max_length, cfg.val_data)
    else:
        data = load_data(cfg.data, task=cfg.task, **data_options)
    if image_input.get("channels") not in (None, data.in_channels):
        raise ConfigError(f"model {cfg.model} takes images of {image_input['channels']} channels, and the data's "
                          f"have {data.in_channels}: set channels: {image_input['channels']}")
    train, val = data.train, data.val
    if cfg.val_data is not None and not lm:  # prepared as the training data was: classes, statistics, length
        val = load_data(cfg.val_data, task=data.task, like=data, **data_options).train
    elif cfg.val_fraction > 0:
        n_val = max(1, int(len(train) * cfg.val_fraction))
        train, val = random_split(train, [len(train) - n_val, n_val],
                                  generator=torch.Generator().manual_seed(cfg.seed))
    return data, train, val


def config_model(cfg: TrainConfig, data: Any) -> tuple[nn.Module, nn.Module]:
    """The model a config names, sized for ``data`` (classes, channels, features), and the loss for its task."""
    model = build_model(cfg.model, cfg.model_kwargs, num_classes=data.num_classes, in_channels=data.in_channels,
                        image_size=cfg.image_size, in_features=data.in_features, task=data.task)
    loss_fn: nn.Module = TokenCrossEntropyLoss(shift=True) if data.task == TASK else \
        nn.CrossEntropyLoss() if data.task == "classification" else nn.MSELoss()
    return model, loss_fn


def prepare_options(cfg: TrainConfig) -> dict[str, Any]:
    """The :func:`edgetrain.prepare` options a train config sets (``edgetrain train`` and ``verify`` alike)."""
    return {**options(solver=cfg.solver, micro_batch_size=cfg.micro_batch_size, paging=cfg.paging,
                      page_optimizer_state=cfg.page_optimizer_state, state_dir=cfg.state_dir,
                      fused_update=cfg.fused_update, compile=cfg.compile, layout=cfg.layout),
            "name": cfg.model}


def config_plan_options(cfg: TrainConfig, **given: Any) -> dict[str, Any]:
    """:func:`prepare_options` for a command that prepares the config's model outside ``train`` (``verify``,
    ``report``): planning options the command was given (None: the config's) replace the config's, and the update
    stays after the backward where the config clips gradients, as the trainer keeps it."""
    kw = prepare_options(cfg)
    change = {k: v for k, v in given.items() if v is not None}
    if cfg.grad_clip_norm:
        change["fused_update"] = False
    kw["planning"] = replace(kw["planning"], **change)
    return kw


def config_example(path: str, **given: Any) -> tuple[Any, Any, Any, str | None, torch.optim.Optimizer, dict[str, Any]]:
    """Model, example batch, loss, budget, optimizer and :func:`edgetrain.prepare` options from a train config (its
    first training batch), built as ``edgetrain train`` builds them; ``given``: planning options a command was
    given (:func:`config_plan_options`)."""
    from ..profile import memory
    from .train_config import load_train_config

    cfg = load_train_config(path)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data, train, _ = config_data(cfg)
    x, y = next(iter(DataLoader(train, batch_size=cfg.batch_size)))
    memory.record_baseline(release=True)  # as in `edgetrain train`: the data is not training memory, the model is
    model, loss = config_model(cfg, data)
    return model, (x, y), loss, cfg.memory_budget, _optimizer(cfg, model), config_plan_options(cfg, **given)


def run_train(cfg: TrainConfig, out: Callable[[str], None] = print) -> int:
    """Train as ``cfg`` says; returns the exit code (1 when the measured peak exceeds the budget)."""
    from ..profile import memory
    from ..trainer import Trainer
    from ..units import format_bytes

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data, train, val = config_data(cfg)
    lm = data.task == TASK
    # The data in memory is not training memory (nor what loading it left free in the heap, handed back first):
    # the budget's zero point is here, as for `edgetrain demo`.
    memory.record_baseline(release=True)
    memory.reset_peak()
    model, loss_fn = config_model(cfg, data)
    opt = _optimizer(cfg, model)
    loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.num_workers)
    val_loader = DataLoader(val, batch_size=cfg.batch_size) if val is not None else None
    sched, interval = _scheduler(cfg, opt, len(loader) * cfg.epochs)
    classification = data.task == "classification"
    budget = None if cfg.memory_budget is None else parse_bytes(cfg.memory_budget)
    trainer = Trainer(model, opt, loss_fn, loader, val_loader, memory_budget=budget, scheduler=sched,
                      metrics={"accuracy": _accuracy} if classification else None,
                      callbacks=[_Printer(out, cfg.epochs, perplexity=lm)], resume=cfg.resume,
                      prepare_options=prepare_options(cfg),
                      checkpoint_dir=cfg.checkpoint_dir, checkpoint_every_steps=cfg.checkpoint_every_steps,
                      keep_checkpoints=cfg.keep_checkpoints, grad_clip_norm=cfg.grad_clip_norm,
                      scheduler_interval=interval, early_stopping_patience=cfg.early_stopping_patience,
                      seed=cfg.seed, progress=cfg.progress, log_dir=cfg.log_dir, tensorboard=cfg.tensorboard)
    what = f"blocks of {cfg.max_length} tokens" if lm else "samples"
    outputs = f"a vocabulary of {data.num_classes}" if lm else \
        f"{data.num_classes} " + ("classes" if classification else "outputs")
    out(f"{cfg.model} on {cfg.data}: {len(train)} training {what}"
        + (f", {len(val)} validation" if val is not None else "") + f", {outputs}")
    out(trainer.step.plan.summary())
    if trainer.state.global_step:
        out(f"resumed from {cfg.checkpoint_dir} at epoch {trainer.state.epoch + 1}, step {trainer.state.global_step}")
    trainer.fit(cfg.epochs)
    if trainer.stopped_early:
        out("stopped early: val_loss stopped improving")
    peak = memory.peak_rss_bytes() - memory.baseline_rss_bytes()
    if cfg.save:
        path = Path(cfg.save)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
        card = write_card(path, cfg, data)
        out(f"saved model weights to {path}, and how to build the model and prepare its inputs to {card}")
    if cfg.report:
        out(f"report written to {trainer.report(cfg.report)}")
    trainer.close()
    if budget is None:
        out(f"measured peak {format_bytes(peak)} (no budget)")
        return 0
    verdict = "within" if peak <= budget else "ABOVE"
    out(f"measured peak {format_bytes(peak)} vs budget {format_bytes(budget)}: {verdict} budget")
    return 0 if peak <= budget else 1


def _hf_inputs(cfg: TrainConfig) -> tuple[str | None, dict[str, Any]]:
    """For an ``hf:`` model: the model to tokenize text for (a text model), or what its images must be like
    (a vision model: size, channels, its processor's mean and std)."""
    if not cfg.model.startswith("hf:"):
        return None, {}
    from ..spec.models import hf_image_input, hf_reads_images

    name = cfg.model[3:]
    if not hf_reads_images(name):
        return name, {}
    wants = hf_image_input(name)
    if wants.get("size") not in (None, cfg.image_size):
        raise ConfigError(f"model {cfg.model} takes images of {wants['size']}x{wants['size']} pixels: set "
                          f"image_size: {wants['size']}")
    return None, wants


def write_card(weights: Path, cfg: TrainConfig, data: Any) -> Path:
    """Write ``weights`` with suffix ``.json`` beside the weights, atomically: what a program that uses the
    trained model needs besides them (the model spec and its arguments, the task, the class names and how
    the raw inputs were prepared: image size and per-channel mean and std, a table's columns and their
    statistics, the tokenizer and sequence length)."""
    card = {
        "weights": weights.name,
        "model": cfg.model,
        "model_kwargs": dict(cfg.model_kwargs),
        "task": data.task,
        "outputs": data.num_classes,
        "classes": list(data.classes),
        "in_channels": data.in_channels,
        "in_features": data.in_features,
        "input": dict(data.preprocessing),
        "edgetrain": _version(),
    }
    path = card_path(weights)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(card, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def card_path(weights: Path) -> Path:
    """Where the card of ``weights`` lies: beside them, suffix ``.json``."""
    return weights.with_suffix(".json") if weights.suffix != ".json" else weights.with_name(weights.name + ".json")


def _version() -> str:
    from .. import __version__

    return __version__


def spec_model_and_batch(model: str, kwargs: dict[str, Any], input_shape: tuple[int, ...],
                         batch_size: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model from any model spec and a random batch for it (plan, profile, report, bench)."""
    from ..spec.models import hf_reads_images, is_in_project

    if is_in_project(model):
        from ..measure import Job, build_model_and_batch

        return build_model_and_batch(Job(model, input_shape, batch_size, model_kwargs=kwargs))
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    if model.startswith("hf:") and hf_reads_images(model[3:]):
        from ..spec.models import hf_image_input

        wants = hf_image_input(model[3:])
        shape = (wants.get("channels", input_shape[0]), wants.get("size", input_shape[-1]),
                 wants.get("size", input_shape[-1]))
        if tuple(input_shape) != shape:
            raise ConfigError(f"model {model} takes images of shape {','.join(map(str, shape))}: pass "
                              f"--input-shape {','.join(map(str, shape))}")
    classes = int(kwargs.pop("num_classes", 10) if model.startswith("hf:") else kwargs.get("num_classes", 10))
    in_channels = input_shape[0] if len(input_shape) == 3 else None
    net = build_model(model, kwargs, num_classes=classes, in_channels=in_channels,
                      image_size=input_shape[-1] if len(input_shape) == 3 else None)
    if model.startswith("hf:") and not hf_reads_images(model[3:]):
        vocab = int(getattr(getattr(net, "model", None), "config", None).vocab_size)  # type: ignore[union-attr]
        x = torch.randint(0, vocab, (batch_size, *input_shape))
    else:
        x = torch.randn(batch_size, *input_shape)
    y = torch.randint(0, classes, (batch_size,))
    return net, x, y


_UNSET = object()
#: flags of the MNIST trainer that `edgetrain train` ran before it took a config (still accepted without one)
LEGACY_FLAGS = ("--model", "--epochs", "--batch-size", "--image-size", "--width", "--lr", "--budget",
                "--budget-fraction", "--solver", "--seed", "--threads", "--no-progress", "--precise-bn", "--save",
                "--checkpoint")


def add_config_flags(parser: Any) -> None:
    """One ``--flag`` per :class:`TrainConfig` option (booleans take an optional value: ``--resume``)."""
    from .train_config import config_fields

    for name, default, typ, help_text in config_fields():
        flag = "--" + name.replace("_", "-")
        shown = "null" if default is None else ("{}" if default == {} else default)
        extra: dict[str, Any] = {}
        if typ.startswith("bool"):
            extra = {"nargs": "?", "const": "true", "metavar": "AUTO|BOOL" if typ == "bool | str" else "BOOL"}
        aliases = {"memory_budget": ["--budget"]}.get(name, [])
        parser.add_argument(flag, *aliases, dest=f"cfg_{name}", default=_UNSET,
                            help=f"{help_text} (default: {shown})", **extra)
    parser.add_argument("--no-progress", dest="cfg_progress", action="store_const", const="false",
                        default=_UNSET, help="no progress bar (same as --progress false)")


def config_flags(args: Any) -> dict[str, Any]:
    """The TrainConfig values given as flags, each read as a YAML scalar."""
    from .train_config import parse_value

    return {k[4:]: parse_value(v) if isinstance(v, str) else v for k, v in vars(args).items()
            if k.startswith("cfg_") and v is not _UNSET}


def is_config_invocation(argv: list[str]) -> bool:
    """Whether ``edgetrain train ARGS`` is the config form (a config file, key=value, or a config-only flag);
    otherwise it is the MNIST trainer's older flag form, kept as it was."""
    from .train_config import config_fields

    legacy = {f.split("=")[0] for f in LEGACY_FLAGS}
    config_only = {"--" + n.replace("_", "-") for n, *_ in config_fields()} - legacy
    for tok in argv:
        if tok in ("-h", "--help"):
            return True
        if not tok.startswith("-") and ("=" in tok or tok.lower().endswith((".yaml", ".yml", ".json"))):
            return True
        if tok.startswith("--") and tok.split("=")[0] in config_only:
            return True
    return False
