"""``edgetrain fl ...``: federated learning with Flower (``edgetrain fl simulate --clients 8 --rounds 5``)."""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetrain fl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="the bundled MNIST digits on Flower's simulation engine (Ray), offline")
    s.add_argument("--clients", type=int, default=8)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--partition", choices=("iid", "dirichlet"), default="iid")
    s.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (non-IID)")
    s.add_argument("--local-epochs", type=int, default=1)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--lr", type=float, default=0.05)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tiers", default=None,
                   help="device tiers as PROFILE=BUDGET,... (default: rpi4=24MiB,phone-2024=28MiB,"
                        "jetson-nano=34MiB,jetson-tx2=96MiB)")
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
    cfg = SimulationConfig(clients=args.clients, rounds=args.rounds, partition=args.partition, alpha=args.alpha,
                           seed=args.seed, tiers=tiers, local_epochs=args.local_epochs, batch_size=args.batch_size,
                           lr=args.lr, mode=args.mode, num_cpus=args.num_cpus)
    report = run(cfg)
    print(format_report(report, cfg))
    if args.report:
        with open(args.report, "w") as f:
            f.write(report.to_json())
    over = [c for r in report.rounds for c in r["clients"] if not c["within-budget"]]
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
