"""The ``edgetrain`` command line (``edgetrain --help``): demo, train, plan, profile, verify, report, bench, fl."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
