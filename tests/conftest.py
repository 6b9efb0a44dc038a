import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

# Profiles measured by one test must not leak into another through the on-disk cache.
os.environ.setdefault("EDGETRAIN_NO_CACHE", "1")

# TorchInductor's on-disk cache (compile=True tests) is one directory per test process, removed at its exit: no
# test reads code another process compiled, and nothing is left in the user's default cache. (The SIGSEGV in
# generated code first put down to a shared cache was TorchInductor's max-pool kernel reading past a buffer that
# ended on a page with nothing mapped after it: the tensor pool now keeps bytes mapped past every tensor,
# tests/test_pool.py::test_every_block_keeps_bytes_mapped_past_its_tensor.)
# pytest-xdist's controller imports this file too, and its workers inherit its environment: a directory this file
# set in a parent process is made anew here.
if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.environ.get("EDGETRAIN_TESTS_INDUCTOR_DIR")):
    _INDUCTOR_DIR = tempfile.mkdtemp(prefix="edgetrain-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["EDGETRAIN_TESTS_INDUCTOR_DIR"] = _INDUCTOR_DIR
    atexit.register(shutil.rmtree, _INDUCTOR_DIR, ignore_errors=True)

# Under pytest-xdist (`make test` runs one worker per core) each worker gets its share of the cores, and so do
# the fresh processes tests start (OMP_NUM_THREADS): workers that each start a thread per core oversubscribe
# the machine and every test runs slower than alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _THREADS = max(1, _CORES // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
