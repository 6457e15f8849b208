"""Fixtures for dataset tests: a receipt, a seeded generator, an empty dataset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import HIDDEN, random_tensor


@pytest.fixture
def receipt() -> Receipt:
    return Receipt(source="manual", created_at="2026-01-02T03:04:05Z", engine="test",
                   notes={"purpose": "dataset tests"})


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    return Dataset(tmp_path / "ds", create=True)


@pytest.fixture
def copy_inputs(gen: torch.Generator) -> Callable[..., dict]:
    def make(batch: int = 3, dtype: torch.dtype = torch.float32) -> dict:
        return {"x": random_tensor((batch, HIDDEN), dtype, gen), "n": 7, "alpha": 0.25,
                "flag": True}
    return make
