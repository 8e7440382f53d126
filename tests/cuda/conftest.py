"""Tests that need a CUDA GPU: skipped where torch sees none (CI). On the GPU machine:
    bash .gpu/remote.sh python3 -m pytest -q tests/cuda"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
