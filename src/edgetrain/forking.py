"""A forked copy of this process that runs one function and sends back its bytes through a pipe.

The plain mechanism under both uses of a child in edgetrain: kernel self-checks whose answer matters and
whose memory must not stay here (:func:`answer_in_fork`), and the budgeted analysis, whose child first
mirrors its parent's resident pages so that what it measures is what this process would
(:mod:`edgetrain.profile.fork`, built on :func:`fork_pipe`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from typing import Any, Callable

from . import settings

__all__ = ["NoThreadError", "fork_pipe", "write_all", "answer_in_fork", "on_new_thread"]


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


def on_new_thread(fn: Callable[[], Any], threads: int) -> Any:
    """``fn()`` run in this forked child with ``threads`` intra-op threads, on a thread of its own when more
    than one; its value, or what it raised.

    GNU OpenMP, PyTorch's CPU thread pool (oneDNN's and MKL's too), is not fork-safe: a forked child whose
    thread starts a parallel region after the parent's same thread ran one waits for ever on the parent's
    pool threads, which a fork does not copy. The pool belongs to the thread that started it, so a new
    thread starts a pool of its own and runs parallel regions as the parent does (measured: a forked child's
    new thread ran convolutions and matmuls at 1.8x one thread's speed, where the main thread hung). The
    child then measures what this process's threads hold (each keeps its own scratch; oneDNN builds and
    caches primitives per thread count) and times steps as they will run here.

    The new thread starts with PyTorch's thread-local defaults; this one's grad mode, inference mode and
    autocast regions are entered there again, so that ``fn`` runs under what the caller runs under.
    """
    import threading

    import torch

    from ._state import autocast_state

    if threads <= 1:
        torch.set_num_threads(1)
        return fn()
    grad, inference, regions = torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast_state()
    cache = torch.is_autocast_cache_enabled()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            torch.set_num_threads(threads)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                if inference:
                    stack.enter_context(torch.inference_mode())
                for device, dtype in regions:
                    stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype), cache_enabled=cache))
                box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- raised again on the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="edgetrain-analysis", daemon=True)
    try:
        worker.start()
    except RuntimeError as e:  # out of threads, or a sandbox that forbids them
        raise NoThreadError(str(e)) from e
    worker.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


class NoThreadError(RuntimeError):
    """:func:`on_new_thread` could not start its thread (``fn`` did not run)."""


def answer_in_fork(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value from a forked copy of this process, or None when it cannot come from one (no usable
    fork here, an error there, a value of None).

    For a kernel's self-check, whose answer matters and whose memory must not: the torch code and heap the
    check touches stay in the child (lean BatchNorm's check left 3.6 MiB resident, lean dropout's 2.0 MiB,
    in every step and every budget's fixed bytes). The child runs this process's intra-op threads
    (:func:`on_new_thread`), so the answer is this process's.
    """
    import torch

    if (not settings.fork_enabled() or not hasattr(os, "fork") or sys.platform == "darwin"
            or (torch.cuda.is_available() and torch.cuda.is_initialized())):
        return None
    threads = torch.get_num_threads()
    try:
        data, _ = fork_pipe(lambda fd: write_all(fd, pickle.dumps(on_new_thread(fn, threads))))
    except OSError:
        return None
    try:
        return pickle.loads(data) if data else None
    except Exception:  # noqa: BLE001
        return None
