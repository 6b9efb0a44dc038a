import os

import pytest
import torch

# Profiles measured by one test must not leak into another through the on-disk cache.
os.environ.setdefault("EDGETRAIN_NO_CACHE", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
