"""edgetrain.profile.memory.process_peak_rss_bytes: the lifetime peak survives edgetrain's resets of VmHWM."""

from __future__ import annotations

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
