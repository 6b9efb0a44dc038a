"""edgetrain.profile.memory.process_peak_rss_bytes: the lifetime peak survives edgetrain's resets of VmHWM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgetrain.profile import memory

CHILD = """
import numpy as np
from edgetrain import memory
big = np.ones(300 * 2**20 // 8); big[::512] = 2.0; del big     # a 300 MiB peak, then freed
peak = memory.peak_rss_bytes()
with memory.measure_peak() as m:                                 # resets the kernel's counter
    small = np.ones(2**20)
after = memory.peak_rss_bytes()
print(peak, after, m.peak_bytes, memory.process_peak_rss_bytes())
"""


@pytest.mark.skipif(not memory.can_reset_peak(), reason="needs a writable /proc/self/clear_refs")
def test_lifetime_peak_survives_the_resets_edgetrain_makes():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    peak, after, measured, lifetime = map(int, out.stdout.split())
    assert peak > 300 * 2**20                     # the big array was resident
    assert after < peak - 200 * 2**20             # the reset wiped it from VmHWM ...
    assert measured < peak - 200 * 2**20          # ... and from what measure_peak reports
    assert lifetime >= peak                       # but not from the lifetime peak


def test_a_whole_batch_step_slices_nothing(monkeypatch):
    """A step (or validation run) over the whole batch passes the batch as it is: a process's first slice
    faults in indexing code that plain PyTorch's loop never runs (0.1-0.6 MiB of a small model's peak).
    Losses and gradients are those of plain PyTorch either way."""
    import torch
    from torch import nn

    import edgetrain
    from edgetrain import api
    from edgetrain.planning import runs

    def whole(x, start, stop):
        raise AssertionError(f"sliced [{start}:{stop}]")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y))
    monkeypatch.setattr(api, "slice_batch", whole)
    monkeypatch.setattr(runs, "slice_batch", whole)
    loss = step(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = nn.CrossEntropyLoss()(ref(x), y)
    ref_loss.backward()
    opt.step()
    assert loss == ref_loss.item()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_a_zero_point_after_loading_data_hands_back_the_heap_the_loader_left_free():
    # A loader's garbage sits in the heap as free chunks between live ones; counted in the zero point it is
    # room the steps would reuse unseen, while prepare's analysis counts their growth in full.
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap")
    before = memory.baseline_rss_bytes()
    try:
        chunks = [bytearray(1000) for _ in range(60_000)]  # 60 MB of small allocations, in the heap
        kept = chunks[::16]
        del chunks
        held = memory.record_baseline()
        released = memory.record_baseline(release=True)
        assert held - released > 20 * 2**20, (held / 2**20, released / 2**20)
        assert memory.baseline_rss_bytes() == released
        del kept
    finally:
        memory._BASELINE_RSS = before


ONE_HEAP = """
import ctypes, os, sys, tempfile
import torch
import edgetrain  # tunes the allocator: one glibc heap for every thread
torch.set_num_threads(2)
x = torch.randn(8, 16, 32, 32, requires_grad=True)
conv = torch.nn.Conv2d(16, 16, 3, padding=1)
for _ in range(3):
    conv(x).square().sum().backward()  # oneDNN's parallel regions: a worker thread that allocates
libc = ctypes.CDLL("libc.so.6")
libc.fdopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = libc.fclose.argtypes = None
fd, path = tempfile.mkstemp()
f = ctypes.c_void_p(libc.fdopen(fd, b"w"))
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
os.unlink(path)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_info")
def test_every_thread_allocates_from_one_heap():
    """glibc gives each OpenMP worker thread that allocates an arena of its own, whose free memory is held
    apart; the analysing child, which validates plans, allocates from one. At two threads `edgetrain train
    data=mnist memory_budget=80MiB` ran in two to three heaps; the process now has one, as the child does."""
    out = subprocess.run([sys.executable, "-c", ONE_HEAP], capture_output=True, text=True, check=True,
                         env={**os.environ, "EDGETRAIN_ALLOCATOR": ""})
    assert int(out.stdout.split()[-1]) == 1, out.stdout
