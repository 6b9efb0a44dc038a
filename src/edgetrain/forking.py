"""A forked copy of this process that runs one function and sends back its bytes through a pipe.

The plain mechanism under both uses of a child in edgetrain: kernel self-checks whose answer matters and
whose memory must not stay here (:func:`answer_in_fork`), and the budgeted analysis, whose child first
mirrors its parent's resident pages so that what it measures is what this process would
(:mod:`edgetrain.profile.fork`, built on :func:`fork_pipe`).
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Callable

from . import settings

__all__ = ["fork_pipe", "write_all", "answer_in_fork"]


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to the file descriptor ``fd`` (a pipe takes a write in pieces)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fork_pipe(child: Callable[[int], None]) -> tuple[bytes, int]:
    """Fork; the child calls ``child(fd)``, writes what it has to say to ``fd`` and exits (status 1 if it
    raised); this process reads everything written and reaps the child.

    Returns:
        ``(bytes the child wrote, its wait status)``; no bytes when it died before writing.

    Raises:
        OSError: no pipe or no fork here (out of processes, out of memory).
    """
    sys.stdout.flush()  # buffered output would otherwise be written twice, once by the child
    sys.stderr.flush()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: never return into the caller's code
        code = 0
        try:
            os.close(r)
            child(w)
        except BaseException:  # noqa: BLE001 -- no answer: the parent works it out itself
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(1 << 20):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks), status


def answer_in_fork(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value from a forked copy of this process, or None when it cannot come from one (no usable
    fork here, more than one intra-op thread here, an error there, a value of None).

    For a kernel's self-check, whose answer matters and whose memory must not: the torch code and heap the
    check touches stay in the child (lean BatchNorm's check left 3.6 MiB resident, lean dropout's 2.0 MiB,
    in every step and every budget's fixed bytes). The child runs one intra-op thread (GNU OpenMP deadlocks
    in a fork that starts more), so only a process running one asks: the answer is then this process's.
    """
    import torch

    if (not settings.fork_enabled() or not hasattr(os, "fork") or sys.platform == "darwin"
            or torch.get_num_threads() != 1 or (torch.cuda.is_available() and torch.cuda.is_initialized())):
        return None
    try:
        data, _ = fork_pipe(lambda fd: write_all(fd, pickle.dumps(fn())))
    except OSError:
        return None
    try:
        return pickle.loads(data) if data else None
    except Exception:  # noqa: BLE001
        return None
