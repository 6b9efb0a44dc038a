"""``edgetrain fl ...``: federated learning with Flower (``edgetrain fl simulate --clients 8 --rounds 5``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetrain fl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="federated training on Flower's simulation engine (Ray), offline: the "
                       "bundled MNIST digits, or your model and data (--model, --data)")
    s.add_argument("--model", default=None, help="your model: the spec `edgetrain train` takes (pkg.module:build, "
                   "hf:NAME, an in-project model); needs --data")
    s.add_argument("--data", default=None, help="your data: the spec `edgetrain train` takes (an image folder, a "
                   "table, a saved Hugging Face dataset, pkg.module:make), split across the clients")
    s.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments of the model factory")
    s.add_argument("--image-size", type=int, default=32, help="image folders: side in pixels")
    s.add_argument("--channels", type=int, default=3, help="image folders: 3 (RGB) or 1 (grey)")
    s.add_argument("--target-column", default="-1", help="tables: the target column, by index or name")
    s.add_argument("--max-length", type=int, default=128, help="text: tokens per text at most (language modelling: "
                   "tokens per block)")
    s.add_argument("--task", choices=("language-modeling",), default=None,
                   help="language-modeling: --data is text a Hugging Face causal LM (--model hf:DIR) learns to "
                        "continue, split IID; default: classification or regression, as the data says")
    s.add_argument("--val-fraction", type=float, default=0.2,
                   help="share of your data the server evaluates on (where the data has no validation split)")
    s.add_argument("--clients", type=int, default=8)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--partition", choices=("iid", "dirichlet"), default="iid")
    s.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (non-IID)")
    s.add_argument("--local-epochs", type=int, default=1)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--lr", type=float, default=0.05)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tiers", default=None,
                   help="device tiers as PROFILE=BUDGET,... (BUDGET none: unbounded; default: rpi4=24MiB,"
                        "phone-2024=28MiB,jetson-nano=34MiB,jetson-tx2=96MiB, budgets for the bundled CNN: give "
                        "your own model's)")
    s.add_argument("--mode", choices=("edgetrain", "heterofl"), default="edgetrain")
    s.add_argument("--num-cpus", type=int, default=2)
    s.add_argument("--report", default=None, help="also write the report as JSON here")
    s.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from .simulation import DEFAULT_TIERS, SimulationConfig, format_report, run

    tiers = DEFAULT_TIERS
    if args.tiers:
        tiers = tuple(tuple(t.split("=", 1)) for t in args.tiers.split(","))  # type: ignore[misc]
    task = None
    if (args.model is None) != (args.data is None):
        print("edgetrain fl simulate: error: --model and --data go together (your model and your data)",
              file=sys.stderr)
        return 2
    if args.task is not None and args.model is None:
        print(f"edgetrain fl simulate: error: --task {args.task} needs your model and text: --model hf:DIR --data "
              "FILE", file=sys.stderr)
        return 2
    if args.model is not None:
        from ..cli.args import parse_kwargs
        from ..errors import EdgetrainError
        from .spec_task import SpecTask, load_spec_task

        target = int(args.target_column) if args.target_column.lstrip("-").isdigit() else args.target_column
        try:
            task = SpecTask(args.model, args.data, json.dumps(parse_kwargs(args.model_kwargs)), args.image_size,
                            args.channels, target, args.max_length, args.val_fraction, args.seed, task=args.task)
            load_spec_task(task)
        except EdgetrainError as e:
            print(f"edgetrain fl simulate: error: {e}", file=sys.stderr)
            return 2
    if args.task is not None and args.partition != "iid":
        print(f"edgetrain fl simulate: --partition {args.partition} skews shards by class, which blocks of text do "
              "not have: language modelling splits them IID", file=sys.stderr)
    if task is not None and not args.tiers:
        print("edgetrain fl simulate: the default tiers' budgets (24-96 MiB) are the bundled CNN's; give your "
              "model's with --tiers PROFILE=BUDGET,... (none: unbounded)", file=sys.stderr)
    cfg = SimulationConfig(clients=args.clients, rounds=args.rounds, partition=args.partition, alpha=args.alpha,
                           seed=args.seed, tiers=tiers, local_epochs=args.local_epochs, batch_size=args.batch_size,
                           lr=args.lr, mode=args.mode, num_cpus=args.num_cpus, task=task)
    report = run(cfg)
    print(format_report(report, cfg))
    if args.report:
        with open(args.report, "w") as f:
            f.write(report.to_json())
    over = [c for r in report.rounds for c in r["clients"] if not c["within-budget"]]
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
