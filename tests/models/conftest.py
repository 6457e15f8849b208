"""Model-test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny matmuls run far faster on one thread when other processes share the cores
    (OpenMP workers spin-wait for each other); restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
