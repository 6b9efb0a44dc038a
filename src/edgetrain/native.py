"""Build a small native library from a source file shipped in the package, once, and cache it.

edgetrain's native parts (the CPU tensor pool, lean BatchNorm's passes, gradient filtering's kernels) are
compiled on first use with the system's compiler, because they must match the installed torch or the
machine's SIMD. The
result is cached under ``$EDGETRAIN_CACHE_DIR`` (default ``~/.cache/edgetrain``), named by a hash of the
source and everything else it was built from; a read-only home builds in the temp directory instead.
Concurrent processes never load a half-written library: it is compiled in a temporary directory beside
its final name and moved there atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import settings

__all__ = ["build_library", "load_c_library", "cpu_key", "C_FLAG_SETS", "NativeLibrary"]

log = logging.getLogger(__name__)


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
    target = settings.cache_dir() / folder / name
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


#: Compiler flag sets tried in turn for a C library: the fastest first, the plainest last.
C_FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())


def cpu_key() -> bytes:
    """What ``-march=native`` depends on: the architecture and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return (platform.machine() + flags).encode()


def load_c_library(source: Path, stem: str, what: str) -> tuple[ctypes.CDLL | None, str]:
    """Compile (once, cached by :func:`build_library`) and load a C source shipped in the package.

    The system's C compiler (``$CC``, else ``gcc``, ``cc`` or ``clang``) builds it with ``-O3`` and the
    first of :data:`C_FLAG_SETS` that works (``-march=native`` and OpenMP where they do).

    Args:
        source: the ``.c`` file.
        stem: file name prefix of the library.
        what: what is built, for log lines and errors.

    Returns:
        ``(library, "")``, or ``(None, why)`` when no compiler or no flag set works.
    """
    errors = []
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler found (install gcc or set CC)"
    for flags in C_FLAG_SETS:
        def cmd(out: Path, flags: tuple[str, ...] = flags) -> list[str]:
            return [cc, "-O3", "-std=gnu11", "-shared", "-fPIC", *flags, str(source), "-o", str(out)]
        try:
            target = build_library(source, "native", stem, " ".join((cc, *flags)).encode() + cpu_key(), cmd, what)
            return ctypes.CDLL(str(target)), ""
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    return None, "; ".join(errors)


class NativeLibrary:
    """A C source shipped in the package, compiled, loaded and typed on first use, once per process.

    Every exported function returns ``int`` and takes the ctypes argument types ``signatures`` names. A
    build that fails is logged once (as ``"<what> are unavailable (<why>); <fallback>"``) and not retried.

    Args:
        source: the ``.c`` file.
        stem: file name prefix of the compiled library.
        what: what the library is, plural (``"lean BatchNorm's passes"``), for log lines.
        signatures: ``{function name: [ctypes argument types]}``.
        fallback: what runs instead when the library cannot be built, for the log line.
    """

    def __init__(self, source: Path, stem: str, what: str, signatures: dict[str, Sequence[Any]],
                 fallback: str) -> None:
        self.source, self.stem, self.what, self.fallback = source, stem, what, fallback
        self.signatures = {name: list(args) for name, args in signatures.items()}
        self.lib: ctypes.CDLL | None = None
        self.failed: str | None = None  # why the build failed

    def get(self) -> ctypes.CDLL | None:
        """The typed library, building it on the first call; None when it cannot be built."""
        if self.lib is None and self.failed is None:
            lib, why = load_c_library(self.source, self.stem, self.what)
            if lib is None:
                self.failed = why or "unknown"
                log.warning("%s are unavailable (%s); %s", self.what, self.failed[-300:], self.fallback)
                return None
            for name, args in self.signatures.items():
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = ctypes.c_int
            self.lib = lib
        return self.lib
