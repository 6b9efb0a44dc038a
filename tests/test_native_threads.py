"""The native kernels' OpenMP paths at two threads.

`make test` gives each pytest-xdist worker its share of the cores (tests/conftest.py), one thread each on a
2-core machine, so without these the suite would run lean BatchNorm's and gradient filtering's kernels
single-threaded only. Each test re-runs a check of the kernel's own test module at two threads."""

from __future__ import annotations

import pytest
from conftest import torch_threads
from test_gradfilter_native import WIDE

from edgetrain.models.zoo import has_transformers


@pytest.fixture(autouse=True)
def _two_threads():
    with torch_threads(2):
        yield


@pytest.mark.parametrize("act", ["none", "relu", "hardtanh"])
@pytest.mark.parametrize("training", [True, False])
def test_lean_batchnorm_bit_exact(monkeypatch, act, training):
    from test_lean_bn import test_matches_batchnorm_and_activation as check

    check(monkeypatch, True, act, False, training, (13, 8, 4, 6))


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_hugging_face_cnn_step_bit_exact(monkeypatch):
    from test_lean_bn import test_hugging_face_cnn_step_matches_plain_pytorch as check

    check(monkeypatch, "hf-resnet", "no_saving")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_gradient_filtering_pool_and_unpool(channels_last):
    from test_gradfilter_native import test_pool_and_unpool_match_their_definitions as check

    check((2, 70, 14, 14), 3, channels_last)


@pytest.mark.parametrize("cfg", [WIDE[0], WIDE[4], WIDE[6]], ids=["depthwise", "1x1", "3x3"])
def test_gradient_filtering_backward(monkeypatch, cfg):
    from test_gradfilter_native import test_native_backward_matches_reference_and_fallback as check

    monkeypatch.delenv("EDGETRAIN_NATIVE", raising=False)
    check(cfg, 2, False, monkeypatch)
