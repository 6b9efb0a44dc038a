"""The ``edgetrain`` command line: demo, train, plan, profile, report, bench.

Every error a user can cause (a bad size, a missing file, an unknown option, solver or model, a budget no
plan fits) ends the command with one line on stderr and exit code 2; ``-v`` shows the traceback too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main"]

log = logging.getLogger("edgetrain.cli.main")

_DEFAULTS = argparse.ArgumentDefaultsHelpFormatter


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, Exception) and not isinstance(e, (KeyError,)) else f"{type(e).__name__}: {text}"


def _progress(iterable: Any, total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [cli] extra; without it, no bar
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True)


def _evaluate(model: Any, digits: Any, image_size: int, channels: int, layout: str) -> float:
    import torch

    was_training = model.training
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in digits.batches("test", batch_size=100, image_size=image_size, channels=channels,
                                   shuffle=False, drop_last=False, layout=layout):
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += int(y.numel())
    model.train(was_training)
    return correct / max(total, 1)


def _precise_bn(model: Any, batches: Any, n: int) -> int:
    """Set BatchNorm running statistics to their average over ``n`` training batches ("precise BN").

    The exponential average a training step keeps lags a network trained from scratch (after one epoch of
    the demo, plain PyTorch evaluates at 10% with it and at 82% with batch statistics); averaging forward
    passes without gradients costs no training and no gradient memory. Returns the batches used.
    """
    import torch

    from .._state import batchnorm_modules

    bns = [m for _, m in batchnorm_modules(model)]
    if not bns or n <= 0:
        return 0
    momenta = [b.momentum for b in bns]
    was_training = model.training
    for b in bns:
        b.reset_running_stats()
        b.momentum = None  # cumulative average over the calls that follow
    model.train()
    used = 0
    with torch.no_grad():
        for x, _ in batches:
            model(x)
            used += 1
            if used >= n:
                break
    for b, momentum in zip(bns, momenta):
        b.momentum = momentum
    model.train(was_training)
    return used


def _model_for(name: str, image_size: int, width: float) -> tuple[Any, int, str]:
    from ..models import get_model

    if name == "mobilenet_v2":
        return get_model(name, num_classes=10, in_channels=1, width_mult=width, dropout=0.0), 1, "image"
    if name == "resnet18":
        return get_model(name, num_classes=10, in_channels=1, small_input=True), 1, "image"
    if name == "transformer":
        return get_model(name, num_classes=10, input_dim=image_size), 1, "sequence"
    raise SystemExit(f"unknown model {name!r}")


def _plain_peak(model: str, image_size: int, batch: int, width: float) -> int:
    """Peak of plain PyTorch on this job, measured in a fresh process (system allocator, as users run it)."""
    from ..measure import Job, run_isolated

    shape = (image_size, image_size) if model == "transformer" else (1, image_size, image_size)
    kwargs: dict[str, Any] = {"num_classes": 10}
    if model == "mobilenet_v2":
        kwargs.update(in_channels=1, width_mult=width, dropout=0.0)
    elif model == "resnet18":
        kwargs.update(in_channels=1, small_input=True)
    else:
        kwargs.update(input_dim=image_size)
    res = run_isolated(Job(model, shape, batch, mode="plain", model_kwargs=kwargs, steps=2,
                           env={"EDGETRAIN_ALLOCATOR": "system"}))
    if not res.ok:
        raise SystemExit(f"measuring plain PyTorch failed: {res.error}")
    return res.peak_bytes


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    import edgetrain
    from edgetrain.profile import memory
    from edgetrain.data import load_mnist

    out = print
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = None if args.budget is None else edgetrain.parse_bytes(args.budget)
    if budget is None and args.budget_fraction:
        out(f"measuring plain PyTorch's peak for {args.model}, batch {args.batch_size} "
            f"({args.image_size}x{args.image_size}) in a fresh process ...")
        plain = _plain_peak(args.model, args.image_size, args.batch_size, args.width)
        budget = int(plain * args.budget_fraction)
        out(f"plain PyTorch peak: {edgetrain.format_bytes(plain)}; edgetrain budget "
            f"{args.budget_fraction:.0%} of it: {edgetrain.format_bytes(budget)}")
    digits = load_mnist(seed=args.seed)
    # The dataset (and the packages that load it) are not training memory: start the budget's zero point
    # here, as plain PyTorch's measurement (random data, no loader) does, and the peak with it (loading
    # peaks far above what it keeps).
    memory.record_baseline()
    memory.reset_peak()
    torch.manual_seed(args.seed)
    model, channels, layout = _model_for(args.model, args.image_size, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = lambda epoch: digits.batches("train", batch_size=args.batch_size, image_size=args.image_size,  # noqa: E731
                                           channels=channels, seed=args.seed + epoch, layout=layout)
    example = next(iter(batches(0)))
    t0 = time.perf_counter()
    step = edgetrain.prepare(model, opt, loss_fn, example, memory_budget=budget, solver=args.solver)
    out(f"prepared in {time.perf_counter() - t0:.1f} s\n" + step.plan.summary())
    first_epoch = 0
    if args.checkpoint and Path(args.checkpoint).exists():
        from ..checkpoint import load_checkpoint

        ck = load_checkpoint(args.checkpoint, model, opt)
        first_epoch = int(ck.extra.get("epoch", -1)) + 1
        out(f"resumed from {args.checkpoint} after epoch {first_epoch} (step {ck.step})")
    n_steps = digits.num_batches("train", args.batch_size) if hasattr(digits, "num_batches") else None
    losses: list[float] = []
    t_train = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        bar = _progress(batches(epoch), n_steps or 0, f"epoch {epoch + 1}/{args.epochs}", not args.no_progress)
        run_loss = []
        for x, y in bar:
            loss = step(x, y)
            run_loss.append(loss)
            losses.append(loss)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{sum(run_loss[-20:]) / len(run_loss[-20:]):.3f}")
        used = _precise_bn(model, batches(10_000 + epoch), args.precise_bn)
        acc = _evaluate(model, digits, args.image_size, channels, layout)
        note = f" (BatchNorm statistics averaged over {used} training batches first)" if used else ""
        out(f"epoch {epoch + 1}: mean loss {sum(run_loss) / max(len(run_loss), 1):.4f}, test accuracy {acc:.2%}"
            + note)
        if args.checkpoint:
            from ..checkpoint import save_checkpoint

            save_checkpoint(args.checkpoint, model, opt, step=step.steps_done, extra={"epoch": epoch})
    elapsed = time.perf_counter() - t_train
    peak = memory.peak_rss_bytes() - memory.baseline_rss_bytes()
    if getattr(args, "report", None):
        out(f"plan report: {step.report(args.report, batch=example)}")
    if not losses:
        out("nothing left to train (the checkpoint is past the last epoch)")
        return 0
    first, last = losses[:10], losses[-10:]
    out(f"loss {sum(first) / len(first):.3f} (first 10 steps) -> {sum(last) / len(last):.3f} (last 10); "
        f"{len(losses) * args.batch_size / elapsed:.1f} samples/s")
    if budget is None:
        out(f"measured peak {edgetrain.format_bytes(peak)} (no budget)")
        return 0
    verdict = "within" if peak <= budget else "ABOVE"
    out(f"measured peak {edgetrain.format_bytes(peak)} vs budget {edgetrain.format_bytes(budget)}: {verdict} "
        "budget (peak RSS above the RSS right after `import edgetrain`)")
    if args.save:
        path = Path(args.save)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
        out(f"saved model weights to {path}")
    return 0 if peak <= budget else 1


def _load_costs(args: argparse.Namespace, solver: str) -> Any:
    from ..graph import CostChain

    if args.costs:
        from ..errors import ConfigError

        if not Path(args.costs).is_file():
            raise ConfigError(f"cost-chain file {args.costs} does not exist (write one with edgetrain profile)")
        try:
            return CostChain.from_json(Path(args.costs).read_text())
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{args.costs} is not a cost-chain JSON file ({_one_line(e)})") from None
    import torch

    from .train import spec_model_and_batch
    from ..offline import profile_costs

    model, x, y = spec_model_and_batch(args.model, _kwargs(args.model_kwargs), _shape(args.input_shape),
                                       args.batch_size or 32)
    # the paging planners need a chain without cuts inside residual blocks; prepare() captures one for them
    return profile_costs(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9),
                         solver="poet" if solver.startswith("poet") or (solver == "all" and args.device) else "dp")


_PAGING = ("poet", "poet-milp")


def _shape(text: str) -> tuple[int, ...]:
    from ..errors import ConfigError

    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ConfigError(f"--input-shape {text!r} must be whole numbers separated by commas, e.g. 3,64,64") from None
    if not shape or min(shape) < 1:
        raise ConfigError(f"--input-shape {text!r} must be positive sizes, e.g. 3,64,64")
    return shape


def _kwargs(text: str) -> dict[str, Any]:
    from ..errors import ConfigError

    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--model-kwargs {text!r} is not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--model-kwargs {text!r} must be a JSON object, e.g. '{{\"num_classes\": 10}}'")
    return value


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planners import PLANNERS, solve
    from ..units import parse_bytes

    from ..errors import ConfigError

    parse_bytes(args.budget)  # a bad size fails before any profiling
    solver = args.solver or ("poet" if args.device else "dp")
    if solver != "all" and solver not in PLANNERS:
        raise ConfigError(f"unknown solver {solver!r}; choose one of {', '.join(sorted(PLANNERS))} or 'all'")
    if (args.measured_on or args.from_flops) and not args.device:
        raise ConfigError("--measured-on and --from-flops rescale the costs to a --device; give one")
    if args.measured_on and args.from_flops:
        raise ConfigError("give --measured-on or --from-flops, not both")
    chain = _load_costs(args, solver)
    if args.batch_size and args.costs:
        chain = chain.with_batch_size(args.batch_size)
    budget = parse_bytes(args.budget)
    target = None
    if args.device:
        from ..devices import load_profile, scale_chain
        from ..offline import plan_chain

        target = load_profile(args.device)
        # A profiled model's times are this host's; a cost file's are its device's unless told otherwise.
        source = "flops" if args.from_flops else args.measured_on or ("device" if args.costs else "host")
        if solver in _PAGING:
            print(plan_chain(chain, budget, device=target, objective=args.objective, time_budget=args.time_budget,
                             measured_on=source, solver=solver).summary())
            return 0
        if source != "device":
            chain = scale_chain(chain, None if source == "flops" else load_profile(source), target)
    names = ([n for n in PLANNERS if target is not None or not n.startswith("poet")] if solver == "all"
             else [solver])
    for name in names:
        kw = {} if target is None or not name.startswith("poet") else dict(
            device=target, objective=args.objective, time_budget=args.time_budget)
        if name.startswith("poet") and target is None:
            from ..devices import load_profile

            kw = dict(device=load_profile("host"), objective=args.objective, time_budget=args.time_budget)
        try:
            plan = solve(chain, budget, solver=name, **kw)
            print(plan.summary() if len(names) == 1 else
                  f"{name:>22}: m={plan.micro_batch_size:<4} peak {plan.peak_bytes / 2**20:8.1f} MiB  "
                  f"step {plan.step_time_s * 1e3:9.1f} ms  recomputed {plan.policies.count('recompute')}"
                  + ("" if plan.energy_j is None else f"  energy {plan.energy_j:.4g} J"))
        except Exception as e:  # one failing baseline must not hide the others
            print(f"{name:>22}: {e}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from ..profile import memory
    from .train import spec_model_and_batch
    from ..api import prepare

    model, x, y = spec_model_and_batch(args.model, _kwargs(args.model_kwargs), _shape(args.input_shape),
                                       args.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = prepare(model, opt, torch.nn.CrossEntropyLoss(), (x, y), name=args.model)
    Path(args.out).write_text(step.costs.to_json())
    print(f"wrote the profiled cost chain of {args.model} ({len(step.costs.stages)} stages) to {args.out}; "
          f"plan it with: edgetrain plan {args.out} --budget 200MiB --solver all")
    del memory
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from .train import spec_model_and_batch
    from ..verify import verify

    model, x, y = spec_model_and_batch(args.model, _kwargs(args.model_kwargs), _shape(args.input_shape),
                                       args.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    options: dict[str, Any] = {"solver": args.solver}
    if args.micro_batch_size:
        options["micro_batch_size"] = args.micro_batch_size
    report = verify(model, opt, torch.nn.CrossEntropyLoss(), (x, y), args.budget, tolerance=args.tolerance,
                    **options)
    print(report)
    return 0 if report.passed else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.model is not None:  # a model spec: compare the planners on it here
        from .report import bench_spec

        return bench_spec(args)
    script = Path(__file__).resolve().parents[2] / "bench" / "bench_budget.py"
    if not script.exists():
        from ..errors import ConfigError

        raise ConfigError("the benchmark scripts live in the repository's bench/ folder; run them from a checkout "
                          "(or give --model to compare the planners on a model here)")
    os.execv(sys.executable, [sys.executable, str(script), *args.rest])
    return 0


def cmd_train_config(args: argparse.Namespace) -> int:
    from .train import config_flags, run_train
    from ..errors import ConfigError
    from .train_config import load_train_config

    config = None
    overrides = []
    for item in args.items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"one config file only; got {config!r} and {item!r} (overrides are key=value)")
    cfg = load_train_config(config, config_flags(args), overrides)
    return run_train(cfg)


def cmd_report(args: argparse.Namespace) -> int:
    from .report import report_command

    return report_command(args)


def _model_args(sp: argparse.ArgumentParser, batch: int | None) -> None:
    sp.add_argument("--model", default="mobilenet_v2", help="model spec: an import path to a factory "
                    "'pkg.module:build', an in-project model (mobilenet_v2, resnet18, transformer) or 'hf:NAME' "
                    "(a Hugging Face model available offline)")
    sp.add_argument("--model-kwargs", default='{"num_classes": 10}', help="JSON object of the factory's keyword "
                    "arguments")
    sp.add_argument("--input-shape", default="3,64,64", help="per-sample input shape, comma-separated")
    sp.add_argument("--batch-size", type=int, default=batch, help="logical batch size (plan with a cost file: "
                    "rescale the file's batch to this)")


def _legacy_train_args(sp: argparse.ArgumentParser, *, epochs: int, fraction: float | None) -> None:
    sp.add_argument("--model", default="mobilenet_v2", choices=["mobilenet_v2", "resnet18", "transformer"],
                    help="in-project model")
    sp.add_argument("--epochs", type=int, default=epochs, help="epochs")
    sp.add_argument("--batch-size", type=int, default=128, help="batch per optimizer step")
    sp.add_argument("--image-size", type=int, default=32, help="digits are resized to this many pixels a side")
    sp.add_argument("--width", type=float, default=1.0, help="MobileNetV2 width multiplier")
    sp.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    sp.add_argument("--budget", default=None, help="memory budget, e.g. 300MiB (default: a fraction of "
                    "what plain PyTorch needs, measured first)")
    sp.add_argument("--budget-fraction", type=float, default=fraction,
                    help="budget as a fraction of plain PyTorch's measured peak")
    sp.add_argument("--solver", default="dp", help="planner name")
    sp.add_argument("--seed", type=int, default=0, help="seed of data order and initialisation")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--precise-bn", type=int, default=8, metavar="N",
                    help="before each evaluation, set BatchNorm running statistics to their average over N "
                    "training batches (0: evaluate with the running averages as trained)")
    sp.add_argument("--save", default=None, help="write the trained weights here (atomically)")
    sp.add_argument("--checkpoint", default=None, help="checkpoint file: written atomically after every "
                    "epoch; if it exists, training resumes from it")


def build_legacy_train_parser() -> argparse.ArgumentParser:
    """``edgetrain train`` with the MNIST trainer's flags only (no config file, no key=value)."""
    p = _Parser(prog="edgetrain train", formatter_class=_DEFAULTS)
    _legacy_train_args(p, epochs=3, fraction=None)
    p.set_defaults(func=cmd_train, verbose=False)
    p.add_argument("-v", "--verbose", action="store_true", help="log what edgetrain decides")
    return p


def build_parser() -> argparse.ArgumentParser:
    from .train import add_config_flags

    p = _Parser(prog="edgetrain", description="Exact training under hard memory budgets.", formatter_class=_DEFAULTS)
    p.add_argument("-v", "--verbose", action="store_true", help="log what edgetrain decides (and show the traceback "
                   "of an error)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train MobileNetV2 on real MNIST digits at half of plain PyTorch's memory",
                       formatter_class=_DEFAULTS)
    _legacy_train_args(d, epochs=2, fraction=0.5)
    d.add_argument("--report", default="edgetrain-report.html",
                   help="write the plan report here after training ('' for none)")
    d.set_defaults(func=cmd_train)
    t = sub.add_parser("train", help="train any model on your data under a budget: edgetrain train CONFIG.yaml "
                       "[--flags] [key=value ...]",
                       description="Train a model from a config file (YAML or JSON), flags and key=value overrides "
                       "(later ones win; model_kwargs.KEY=VALUE sets one entry). Without a config file, key=value "
                       "or a config-only flag, the older MNIST form runs: edgetrain train --model resnet18 --budget "
                       "200MiB (its flags are those of edgetrain demo).")
    t.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE",
                   help="a config file (.yaml, .yml, .json) and/or key=value overrides (default: none)")
    add_config_flags(t)
    t.set_defaults(func=cmd_train_config)
    pl = sub.add_parser("plan", help="plan a model or a cost-chain JSON file (see `edgetrain profile`) for a "
                        "budget, here or for a device profile", formatter_class=_DEFAULTS)
    pl.add_argument("costs", nargs="?", default=None, help="cost-chain JSON (default: profile --model here)")
    _model_args(pl, None)
    pl.add_argument("--budget", required=True, help="memory budget, e.g. 200MiB (required)")
    pl.add_argument("--solver", default=None, help="a planner name (dp, poet, poet-milp, the baselines) or 'all' "
                    "to compare them (default: dp; with --device: poet, the exact keep/recompute/page DP, shown "
                    "beside its recompute-only and paging-only plans; poet-milp likewise with the MILP; any other "
                    "planner runs on the chain as rescaled for the device)")
    pl.add_argument("--device", default=None, help="plan for a device profile (keep/recompute/page), e.g. rpi4, "
                    "jetson-nano, phone-2024, nrf52840; see edgetrain.devices.list_profiles()")
    pl.add_argument("--objective", default="energy", choices=["energy", "time"], help="with --device: minimise this")
    pl.add_argument("--time-budget", type=float, default=None, help="at most this multiple of the fastest step")
    pl.add_argument("--measured-on", default=None, metavar="PROFILE",
                    help="with --device: the profile the costs' times were measured on (e.g. host, rpi4); they "
                    "are rescaled by the ratio of compute rates. Default: a model profiled here counts as measured "
                    "on this host (measured, about a second); a COSTS.json file already holds its device's costs "
                    "and is planned as it is (the device profile then adds only its powers and storage speeds)")
    pl.add_argument("--from-flops", action="store_true", help="with --device: recompute stage times from the "
                    "chain's FLOP counts and the device's compute rate instead")
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("profile", help="profile a model here and write its cost chain as JSON",
                        formatter_class=_DEFAULTS)
    _model_args(pr, 32)
    pr.add_argument("--out", default="costs.json", help="where to write the cost chain")
    pr.set_defaults(func=cmd_profile)
    vf = sub.add_parser("verify", help="run one step of a model through the plan and through plain PyTorch (on "
                        "copies) and compare parameters, gradients and buffers", formatter_class=_DEFAULTS)
    _model_args(vf, 16)
    vf.add_argument("--budget", default=None, help="memory budget, e.g. 200MiB (default: none)")
    vf.add_argument("--solver", default="dp", help="planner name (dp, no_saving, recompute_all, chen_sqrt, ...)")
    vf.add_argument("--micro-batch-size", type=int, default=None, help="fix the micro-batch size")
    vf.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference that passes")
    vf.set_defaults(func=cmd_verify)
    rp = sub.add_parser("report", help="write the plan report (HTML with figures, PNGs beside it) for a model or "
                        "a train config", formatter_class=_DEFAULTS)
    rp.add_argument("config", nargs="?", default=None, help="a train config (model, data, budget from it); "
                    "default: --model with a random batch of --input-shape")
    _model_args(rp, 32)
    rp.add_argument("--budget", default=None, help="memory budget, e.g. 200MiB (default: the config's, else "
                    "unbounded)")
    rp.add_argument("--solver", default="dp", help="planner name")
    rp.add_argument("--paging", action="store_true", help="let the planner page as well as recompute (adds the "
                    "energy figure)")
    rp.add_argument("--out", default="edgetrain-report.html", help="the HTML file to write")
    rp.set_defaults(func=cmd_report)
    b = sub.add_parser("bench", help="compare planners on a model spec (--model), or run bench/bench_budget.py "
                       "(other arguments are passed on)", formatter_class=_DEFAULTS)
    b.add_argument("--model", default=None, help="model spec (as for plan); without it bench/bench_budget.py runs")
    b.add_argument("--model-kwargs", default='{"num_classes": 10}', help="JSON object of the factory's arguments")
    b.add_argument("--input-shape", default="3,64,64", help="per-sample input shape, comma-separated")
    b.add_argument("--batch-size", type=int, default=32, help="logical batch size")
    b.add_argument("--budget", default=None, help="memory budget (None: the fixed bytes plus 60%% of the activations "
                   "plain PyTorch keeps)")
    b.add_argument("--steps", type=int, default=3, help="timed optimizer steps per planner")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of bench/bench_budget.py")
    b.set_defaults(func=cmd_bench)
    f = sub.add_parser("fl", help="federated learning with Flower (edgetrain[flower]): `edgetrain fl simulate`")
    f.add_argument("rest", nargs=argparse.REMAINDER)
    f.set_defaults(func=lambda a: __import__("edgetrain.fl.cli", fromlist=["main"]).main(a.rest))
    return p


#: what a user can cause: reported as one line, never a traceback
_USER_ERRORS = (ValueError, OSError, ImportError, TypeError, KeyError, RuntimeError)


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import EdgetrainError

    argv = list(sys.argv[1:] if argv is None else argv)
    from .train import is_config_invocation

    if argv[:1] == ["train"] and not is_config_invocation(argv[1:]):
        args = build_legacy_train_parser().parse_args(argv[1:])
    elif argv[:1] == ["train"]:  # items (CONFIG, key=value) may come before and after the flags
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        flags = [e for e in extra if e.startswith("-")]
        if flags:
            parser.error(f"unrecognized arguments: {' '.join(flags)}")
        args.items = list(args.items) + extra
    else:
        args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (EdgetrainError, *_USER_ERRORS) as e:
        if args.verbose:
            log.exception("the command failed")
        print(f"edgetrain: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgetrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
