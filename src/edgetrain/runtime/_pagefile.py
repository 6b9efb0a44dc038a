"""The page file's plumbing for :mod:`edgetrain.runtime.paging`: whole reads and writes, the transfer
thread, and removal of files left by runs that no longer exist."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["FILE_RE", "page_dir_or_default", "open_page_file", "write_all", "read_all", "remove_stale_page_files",
           "cleanup", "work"]

log = logging.getLogger(__name__)
FILE_RE = re.compile(r"^edgetrain-pages-(\d+)-[0-9a-f]+\.bin$")


def page_dir_or_default(directory: str | os.PathLike[str] | None) -> Path:
    """``directory``, or ``<tmp>/edgetrain-pages`` when None."""
    return Path(directory) if directory is not None else Path(tempfile.gettempdir()) / "edgetrain-pages"


def open_page_file(directory: Path) -> tuple[Path, int]:
    """Create a new page file of this process in ``directory`` (made if missing, stale files of dead
    processes removed first): its path and a read-write descriptor. Raises ``OSError``."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    remove_stale_page_files(directory)
    path = directory / f"edgetrain-pages-{os.getpid()}-{os.urandom(6).hex()}.bin"
    return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


def write_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (raises ``OSError``, e.g. ``ENOSPC``)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write to the page file")
        done += n


def read_all(fd: int, view: memoryview, offset: int) -> None:
    """``preadv`` all of ``view`` from ``offset``."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short read from the page file")
        done += n


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_page_files(page_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove page files left by processes that no longer run; returns the removed paths."""
    removed: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for p in Path(page_dir).iterdir():
            m = FILE_RE.match(p.name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    if removed:
        log.info("removed %d stale page file(s) in %s", len(removed), page_dir)
    return removed


def cleanup(fd: int, path: str, jobs: "queue.Queue[Any]", worker: Any = None) -> None:
    jobs.put(None)
    # Let the worker finish its job before the file goes (and before interpreter shutdown: a daemon thread
    # still inside torch when the process exits can abort it).
    if worker is not None and worker is not threading.current_thread():
        worker.join(timeout=30)
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)


def work(jobs: "queue.Queue[Any]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, *args = job
        try:
            fn(*args)
        except Exception:   # never let the worker die silently: errors are recorded by the jobs
            log.exception("edgetrain pager job failed")
