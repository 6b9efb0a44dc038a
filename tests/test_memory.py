"""The allocator phases change where memory comes from, never the maths, and leave glibc as they found it."""

import copy

import pytest
import torch

import edgetrain
from edgetrain import memory
from tests._models import convnet


def _train(model: torch.nn.Module, backward_heap: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    step = edgetrain.prepare(model, opt, torch.nn.functional.cross_entropy, (x, y), micro_batch_size=4,
                             backward_heap=backward_heap, use_cache=False)
    for _ in range(2):
        step(x, y)
    return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]


def test_backward_heap_is_bit_exact():
    torch.manual_seed(0)
    model = convnet(classes=10)
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    a = _train(model, True)
    torch.manual_seed(1)
    b = _train(other, False)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.skipif(not memory.allocator_tuned(), reason="allocator not tuned (EDGETRAIN_ALLOCATOR=system)")
def test_backward_phase_restores_release_mode():
    tuned = memory._TUNED
    with memory.backward_phase():
        big = torch.ones(4 << 20, dtype=torch.uint8)  # below 32 MiB: served by the heap inside the phase
        del big
    assert memory._TUNED == tuned
    # After the phase a freed tensor is unmapped again: resident memory returns to where it was.
    before = memory.rss_bytes()
    t = torch.ones(64 << 20, dtype=torch.uint8)
    assert memory.rss_bytes() >= before + (60 << 20)
    del t
    assert memory.rss_bytes() < before + (8 << 20)


def test_backward_phase_disabled_is_noop():
    with memory.backward_phase(enabled=False):
        pass
