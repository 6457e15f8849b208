"""Helpers of the replay tests: dataset handles, receipts, a foreign definition."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from enginetap.dataset import Dataset
from enginetap.dataset.schema import AxisConst, AxisVar, Definition, Receipt, TensorSpec

CANDIDATES = Path(__file__).with_name("replay_candidates.py")


@dataclass
class Built:
    root: Path
    dataset: Dataset
    definition: Definition


def receipt() -> Receipt:
    now = datetime.datetime.now(datetime.timezone.utc)
    return Receipt(source="manual", created_at=now.isoformat())


def foreign_definition(marker: Path) -> Definition:
    """A definition enginetap did not generate; its reference writes ``marker`` when run."""
    source = (f"import torch\nopen({str(marker)!r}, 'w').close()\n\n"
              "def run(x, factor):\n    return x * factor\n")
    return Definition(
        name="scale_d16", op_type="scale",
        axes={"n": AxisVar(), "d": AxisConst(value=16)},
        inputs={"x": TensorSpec(shape=["n", "d"], dtype="float32"),
                "factor": TensorSpec(shape=None, dtype="float32")},
        outputs={"y": TensorSpec(shape=["n", "d"], dtype="float32")},
        reference=source)
