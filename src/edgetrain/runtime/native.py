"""Build a small native library from a source file shipped in the package, once, and cache it.

edgetrain's native parts (the CPU tensor pool, gradient filtering's pooling kernels) are compiled on first
use with the system's compiler, because they must match the installed torch or the machine's SIMD. The
result is cached under ``$EDGETRAIN_CACHE_DIR`` (default ``~/.cache/edgetrain``), named by a hash of the
source and everything else it was built from; a read-only home builds in the temp directory instead.
Concurrent processes never load a half-written library: it is compiled in a temporary directory beside
its final name and moved there atomically.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["build_library", "cache_root"]

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$EDGETRAIN_CACHE_DIR``, default ``~/.cache/edgetrain``."""
    return Path(os.environ.get("EDGETRAIN_CACHE_DIR", Path.home() / ".cache" / "edgetrain"))


def _compile(cmd: Callable[[Path], Sequence[str]], target: Path, what: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(list(cmd(out)), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {what} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: concurrent processes never load a half-written library


def build_library(source: Path, folder: str, stem: str, key: bytes,
                  cmd: Callable[[Path], Sequence[str]], what: str) -> Path:
    """The path of the compiled library for ``source``, compiling it first if it is not cached.

    Args:
        source: the source file.
        folder: sub-folder of the cache (``pool``, ``native``).
        stem: file name prefix of the library.
        key: bytes that, with the source, identify the build (torch version, flags, CPU).
        cmd: the compiler command that writes the library to the path it is given.
        what: what is built, for log lines and errors.

    Returns:
        The library's path.

    Raises:
        RuntimeError: when the compiler fails (its last error lines are in the message).
        OSError: when neither the cache nor the temp directory can be written.
        subprocess.SubprocessError: when the compiler cannot be run or times out.
    """
    digest = hashlib.sha256(source.read_bytes() + b"\0" + key).hexdigest()[:16]
    name = f"{stem}-{digest}.so"
    target = cache_root() / folder / name
    if target.exists():
        return target
    log.info("compiling %s (once per install)", what)
    try:
        _compile(cmd, target, what)
    except PermissionError:  # a read-only home: build in the temp directory instead
        target = Path(tempfile.gettempdir()) / f"edgetrain-{folder}-{os.getuid()}" / name
        if not target.exists():
            _compile(cmd, target, what)
    return target
