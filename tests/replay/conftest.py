"""Replay fixtures: small datasets built in tmp_path from a real family and a foreign one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.definitions.registry import get_template
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import Built, foreign_definition, receipt


@pytest.fixture
def rmsnorm_dataset(tmp_path: Path) -> Built:
    """The rmsnorm example (hidden 128, bf16) with two synthetic workloads."""
    dataset = Dataset(tmp_path / "ds", create=True)
    definition = synthesize(dataset, get_template("rmsnorm"), workloads=2, seed=3)
    return Built(dataset.root, dataset, definition)


@pytest.fixture
def foreign_dataset(tmp_path: Path) -> Built:
    """Two workloads of :func:`foreign_definition`, engine outputs exact."""
    dataset = Dataset(tmp_path / "foreign", create=True)
    definition = foreign_definition(tmp_path / "reference-ran")
    gen = torch.Generator().manual_seed(5)
    for rows in (3, 5):
        x = torch.randn(rows, 16, generator=gen)
        dataset.add_workload(definition, {"x": x, "factor": 1.5}, outputs={"y": x * 1.5},
                             receipt=receipt())
    return Built(dataset.root, dataset, definition)
