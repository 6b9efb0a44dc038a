"""Every ``EDGETRAIN_*`` environment variable, read and parsed in one place.

Each switch is read when it is used (not at import), so a test or a launcher can set it for one call.
A switch has one vocabulary: booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); the
allocator takes ``pool``, ``tuned`` or ``system``. A value outside the vocabulary is an error naming the
variable, never silently read as the default.

:data:`SETTINGS` describes them all; the README's table of environment variables is written from it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["Setting", "SETTINGS", "allocator", "cache_dir", "cache_enabled", "conv_chunk_bytes", "flag",
           "fork_enabled", "huge_pages", "native_enabled", "lean_batchnorm_enabled", "lean_dropout_enabled",
           "whole_batch_draws_enabled", "selective_enabled", "markdown_table", "override"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: the allocator modes, from most to least of edgetrain's own tuning
ALLOCATORS = ("pool", "tuned", "system")

#: slice size of the lean convolution backward when ``EDGETRAIN_CONV_CHUNK_BYTES`` is unset (8 MiB)
DEFAULT_CONV_CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, default (as written in the environment) and meaning."""

    name: str
    default: str
    meaning: str


SETTINGS: tuple[Setting, ...] = (
    Setting("EDGETRAIN_ALLOCATOR", "pool",
            "`pool`: edgetrain's CPU tensor pool plus a 64 KiB glibc mmap threshold; `tuned`: the threshold "
            "only; `system`: neither (plain glibc, as PyTorch runs by default)"),
    Setting("EDGETRAIN_HUGE_PAGES", "1", "the tensor pool asks for transparent huge pages on blocks of 2 MiB "
            "or more; `0` turns it off"),
    Setting("EDGETRAIN_FORK", "1", "profile, plan and check the loss in a forked child so their memory never "
            "counts in the process; `0` runs them in the process"),
    Setting("EDGETRAIN_CACHE_DIR", "~/.cache/edgetrain", "where stage profiles and compiled native kernels "
            "are cached"),
    Setting("EDGETRAIN_NO_CACHE", "0", "`1`: never read or write the profile cache (profile afresh each time)"),
    Setting("EDGETRAIN_NATIVE", "1", "compiled kernels (gradient filtering, lean BatchNorm); `0` runs "
            "gradient filtering's PyTorch formulation (same gradients, slower) and BatchNorm as written"),
    Setting("EDGETRAIN_LEAN_BN", "1", "captured graphs run BatchNorm and the ReLU/ReLU6 after it as one "
            "function with a two-tensor backward (bit-exact: PyTorch's own kernel, checked at first use), and "
            "write input gradients over inputs nothing else holds; `0` runs them as written"),
    Setting("EDGETRAIN_LEAN_DROPOUT", "1", "captured graphs run training dropout through a compiled pass that "
            "draws PyTorch's own masks (bit-exact, checked at first use; off where torch draws otherwise) and "
            "keeps a one-bit mask; `0` runs dropout as written"),
    Setting("EDGETRAIN_WHOLE_BATCH_DRAWS", "1", "a budgeted step that splits its batch draws each dropout's mask "
            "for the whole batch at the first micro-batch, as one full-batch step draws it (checked at prepare); "
            "`0` draws per micro-batch, as gradient accumulation does"),
    Setting("EDGETRAIN_SELECTIVE", "1", "per-op (selective) recompute options inside stages are profiled and "
            "planned; `0` plans whole-stage keep / recompute only"),
    Setting("EDGETRAIN_CONV_CHUNK_BYTES", str(DEFAULT_CONV_CHUNK_BYTES), "slice size of the lean "
            "convolution backward (bytes); `0` turns the lean path off"),
)

_DEFAULTS = {s.name: s.default for s in SETTINGS}


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool | None = None) -> bool:
    """The boolean switch ``name``; unset or empty gives ``default`` (its :data:`SETTINGS` default if None).

    Raises:
        ValueError: the value is not one of ``1/true/yes/on/0/false/no/off``.
    """
    raw = _raw(name).lower()
    if not raw:
        return default if default is not None else _DEFAULTS[name].lower() in _TRUE
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a switch: use one of {', '.join(_TRUE + _FALSE)}")


def allocator() -> str:
    """``EDGETRAIN_ALLOCATOR``: ``"pool"`` (default), ``"tuned"`` or ``"system"``.

    Raises:
        ValueError: any other value.
    """
    raw = _raw("EDGETRAIN_ALLOCATOR").lower() or "pool"
    if raw not in ALLOCATORS:
        raise ValueError(f"EDGETRAIN_ALLOCATOR={raw!r}: use one of {', '.join(ALLOCATORS)}")
    return raw


def huge_pages() -> bool:
    """``EDGETRAIN_HUGE_PAGES``: the tensor pool madvises huge pages on large blocks (default on)."""
    return flag("EDGETRAIN_HUGE_PAGES")


def fork_enabled() -> bool:
    """``EDGETRAIN_FORK``: analysis runs in a forked child where the platform allows (default on)."""
    return flag("EDGETRAIN_FORK")


def native_enabled() -> bool:
    """``EDGETRAIN_NATIVE``: gradient filtering and lean BatchNorm may compile and use C kernels (default on)."""
    return flag("EDGETRAIN_NATIVE")


def lean_batchnorm_enabled() -> bool:
    """``EDGETRAIN_LEAN_BN``: captured graphs run BatchNorm (and the ReLU / ReLU6 after it) as one function
    with a two-tensor backward, and write input gradients over owned inputs (default on; see
    docs/design.md, "Lean BatchNorm")."""
    return flag("EDGETRAIN_LEAN_BN")


def lean_dropout_enabled() -> bool:
    """``EDGETRAIN_LEAN_DROPOUT``: captured graphs run training dropout through lean dropout (default on; it
    stays off where its self-check finds torch drawing otherwise)."""
    return flag("EDGETRAIN_LEAN_DROPOUT")


def whole_batch_draws_enabled() -> bool:
    """``EDGETRAIN_WHOLE_BATCH_DRAWS``: a split step draws its dropout masks for the whole batch (default on;
    :mod:`edgetrain.capture.draws`)."""
    return flag("EDGETRAIN_WHOLE_BATCH_DRAWS")


def selective_enabled() -> bool:
    """``EDGETRAIN_SELECTIVE``: the profiler measures selective recompute options (default on)."""
    return flag("EDGETRAIN_SELECTIVE")


def cache_enabled() -> bool:
    """Profiles are read from and written to the cache unless ``EDGETRAIN_NO_CACHE`` is on."""
    return not flag("EDGETRAIN_NO_CACHE")


def cache_dir() -> Path:
    """``$EDGETRAIN_CACHE_DIR``, default ``~/.cache/edgetrain``: profiles and compiled kernels live here."""
    raw = _raw("EDGETRAIN_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "edgetrain"


def conv_chunk_bytes() -> int:
    """``EDGETRAIN_CONV_CHUNK_BYTES``: slice size of the lean convolution backward; 0 turns it off.

    Raises:
        ValueError: the value is not a whole number of bytes.
    """
    raw = _raw("EDGETRAIN_CONV_CHUNK_BYTES")
    if not raw:
        return DEFAULT_CONV_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"EDGETRAIN_CONV_CHUNK_BYTES must be a byte count (0 turns the lean convolution "
                         f"backward off); got {raw!r}") from None
    return max(0, value)


@contextlib.contextmanager
def override(**values: str | int | bool | None) -> Iterator[None]:
    """Set switches for the code inside a ``with`` block, restoring them afterwards (also on error).

    Names are given without the prefix: ``with settings.override(FORK=False, NO_CACHE=True): ...``. True
    and False are written as ``1`` and ``0``; None unsets the variable (its default applies).

    Raises:
        KeyError: a name that is not a setting of :data:`SETTINGS`.
    """
    names = {f"EDGETRAIN_{k}": v for k, v in values.items()}
    unknown = sorted(set(names) - set(_DEFAULTS))
    if unknown:
        raise KeyError(f"not an edgetrain setting: {', '.join(unknown)} (known: {', '.join(sorted(_DEFAULTS))})")
    saved = {k: os.environ.get(k) for k in names}
    try:
        for k, v in names.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(int(v)) if isinstance(v, bool) else str(v)
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def markdown_table() -> str:
    """The settings as a Markdown table (variable, default, meaning), as the README shows them."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | `{s.default}` | {s.meaning} |" for s in SETTINGS]
    return "\n".join(rows)
