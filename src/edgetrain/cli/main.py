"""The ``edgetrain`` command line: demo, train, plan, profile, report, bench.

Every error a user can cause (a bad size, a missing file, an unknown option, solver or model, a budget no
plan fits) ends the command with one line on stderr and exit code 2; ``-v`` shows the traceback too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..config import options
from .args import parse_kwargs, parse_shape
from .demo import cmd_train

__all__ = ["main"]

log = logging.getLogger("edgetrain.cli")

_DEFAULTS = argparse.ArgumentDefaultsHelpFormatter


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, Exception) and not isinstance(e, (KeyError,)) else f"{type(e).__name__}: {text}"


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

    from ..offline import profile_costs
    from .train import spec_model_and_batch

    model, x, y = spec_model_and_batch(args.model, parse_kwargs(args.model_kwargs), parse_shape(args.input_shape),
                                       args.batch_size or 32)
    # the paging planners need a chain without cuts inside residual blocks; prepare() captures one for them
    return profile_costs(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9),
                         solver="poet" if solver.startswith("poet") or (solver == "all" and args.device) else "dp")


_PAGING = ("poet", "poet-milp")


def cmd_plan(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..planners import PLANNERS, solve
    from ..units import parse_bytes

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

    from ..api import prepare
    from ..profile import memory
    from .train import spec_model_and_batch

    model, x, y = spec_model_and_batch(args.model, parse_kwargs(args.model_kwargs), parse_shape(args.input_shape),
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

    from ..verify import verify
    from .train import spec_model_and_batch

    if args.config:  # your model, the first batch of your data, your loss and optimizer, as train builds them
        from .train import config_example

        # the plan `edgetrain train` would run: the config's solver, layout, update and paging
        model, batch, loss, budget, opt, kw = config_example(args.config, solver=args.solver,
                                                             micro_batch_size=args.micro_batch_size or None)
        budget = args.budget or budget
    else:
        model, x, y = spec_model_and_batch(args.model, parse_kwargs(args.model_kwargs),
                                           parse_shape(args.input_shape), args.batch_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batch, loss, budget = (x, y), torch.nn.CrossEntropyLoss(), args.budget
        kw = options(solver=args.solver or "dp", micro_batch_size=args.micro_batch_size or None)
    report = verify(model, opt, loss, batch, budget, tolerance=args.tolerance, **kw)
    print(report)
    return 0 if report.passed else 1


#: the in-project models ``edgetrain bench`` compares without --model: (name, input shape, batch size)
BENCH_MODELS = (("resnet18", "3,32,32", 32), ("mobilenet_v2", "3,64,64", 32), ("transformer", "28,28", 64))


def cmd_bench(args: argparse.Namespace) -> int:
    from .report import bench_spec

    if args.script:  # the repository's full benchmark (fresh processes, the peers, tables)
        script = Path.cwd() / "bench" / "bench_budget.py"
        if not script.exists():
            from ..errors import ConfigError

            raise ConfigError(f"--script runs bench/bench_budget.py of an edgetrain checkout, and there is none "
                              f"under {Path.cwd()}: run it from the checkout's root, or drop --script to compare "
                              "the planners with the installed package")
        os.execv(sys.executable, [sys.executable, str(script), *args.rest])
    if args.model is not None:  # a model spec: compare the planners on it here
        return bench_spec(args)
    # no model: the in-project models, each planner prepared and timed, all from the installed package
    rc = 0
    for name, shape, batch in BENCH_MODELS:
        kwargs = args.model_kwargs if name != "transformer" else '{"num_classes": 10}'
        rc |= bench_spec(argparse.Namespace(**{**vars(args), "model": name, "input_shape": shape,
                                               "batch_size": batch, "model_kwargs": kwargs}))
        print()
    return rc


def cmd_train_config(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from .train import config_flags, run_train
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
    vf.add_argument("config", nargs="?", default=None, help="a train config: its model, the first batch of its "
                    "data, its loss, optimizer, budget and planning options (default: --model on a random batch of "
                    "--input-shape)")
    _model_args(vf, 16)
    vf.add_argument("--budget", default=None, help="memory budget, e.g. 200MiB (default: none, or the config's)")
    vf.add_argument("--solver", default=None, help="planner name (dp, no_saving, recompute_all, chen_sqrt, ...; "
                    "default: the config's, else dp)")
    vf.add_argument("--micro-batch-size", type=int, default=None, help="fix the micro-batch size (default: the "
                    "config's, else the planner's choice)")
    vf.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference that passes")
    vf.set_defaults(func=cmd_verify)
    rp = sub.add_parser("report", help="write the plan report (HTML with figures, PNGs beside it) for a model or "
                        "a train config", formatter_class=_DEFAULTS)
    rp.add_argument("config", nargs="?", default=None, help="a train config (model, data, budget from it); "
                    "default: --model with a random batch of --input-shape")
    _model_args(rp, 32)
    rp.add_argument("--budget", default=None, help="memory budget, e.g. 200MiB (default: the config's, else "
                    "unbounded)")
    rp.add_argument("--solver", default=None, help="planner name (default: the config's, else dp)")
    rp.add_argument("--paging", action="store_true", help="let the planner page as well as recompute (adds the "
                    "energy figure)")
    rp.add_argument("--out", default="edgetrain-report.html", help="the HTML file to write")
    rp.set_defaults(func=cmd_report)
    b = sub.add_parser("bench", help="compare the planners, prepared and timed here, on a model spec (--model) or "
                       "on the in-project models; --script runs a checkout's bench/bench_budget.py",
                       formatter_class=_DEFAULTS)
    b.add_argument("--model", default=None, help="model spec (as for plan); without it: resnet18, mobilenet_v2 and "
                   "the transformer at their bench sizes")
    b.add_argument("--script", action="store_true", help="run bench/bench_budget.py of the edgetrain checkout in the "
                   "current directory (fresh processes, plain PyTorch and the peers); the other arguments go to it")
    b.add_argument("--model-kwargs", default='{"num_classes": 10}', help="JSON object of the factory's arguments")
    b.add_argument("--input-shape", default="3,64,64", help="per-sample input shape, comma-separated")
    b.add_argument("--batch-size", type=int, default=32, help="logical batch size")
    b.add_argument("--budget", default=None, help="memory budget (None: the fixed bytes plus 60%% of the activations "
                   "plain PyTorch keeps)")
    b.add_argument("--steps", type=int, default=3, help="timed optimizer steps per planner")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="with --script: arguments of bench/bench_budget.py")
    b.set_defaults(func=cmd_bench)
    pd = sub.add_parser("predict", help="run a model `edgetrain train` saved on new images, table rows or texts, "
                        "prepared as its training data was (from the card beside the weights); CSV out",
                        formatter_class=_DEFAULTS)
    pd.add_argument("weights", help="the weights file train's save: wrote (its .json card beside it)")
    pd.add_argument("input", help="an image or a folder of images; a .csv / .tsv / .jsonl / .json table with the "
                    "training columns; a .txt of one text per line")
    pd.add_argument("--card", default=None, help="the card, where it is not beside the weights")
    pd.add_argument("--out", default=None, help="write the predictions here (default: standard output)")
    pd.add_argument("--max-new-tokens", type=int, default=32, help="language models: tokens to continue each "
                    "prompt with")
    pd.add_argument("--temperature", type=float, default=0.0, help="language models: sample the continuations at "
                    "this temperature (0: greedy, the most likely token each time)")
    pd.add_argument("--top-k", type=int, default=0, help="language models, sampling: from the k most likely "
                    "tokens only (0: all)")
    pd.add_argument("--top-p", type=float, default=1.0, help="language models, sampling: from the most likely "
                    "tokens whose probabilities sum to p (1: all)")
    pd.add_argument("--seed", type=int, default=0, help="language models, sampling: seed of the draws (the same "
                    "seed, the same continuations)")
    pd.set_defaults(func=lambda a: __import__("edgetrain.cli.predict", fromlist=["cmd_predict"]).cmd_predict(a))
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
