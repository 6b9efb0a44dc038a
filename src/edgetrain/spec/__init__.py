"""Model and data specs: the strings a config file or the command line names a model and its data with."""

from __future__ import annotations

from .data import LoadedData, load_data
from .models import build_model, resolve_import

__all__ = ["LoadedData", "load_data", "build_model", "resolve_import"]
