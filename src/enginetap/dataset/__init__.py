"""FlashInfer-Trace datasets: schema, append-only store, validation and summaries.

Importing this package does not import torch; tensor work imports it when it happens.
"""

from __future__ import annotations

from enginetap.dataset.store import Dataset
from enginetap.dataset.summary import DefinitionSummary, summarize_dataset
from enginetap.dataset.validate import validate_dataset
from enginetap.dataset.writer import ConcurrentWriterError, WorkloadRecord

__all__ = [
    "ConcurrentWriterError", "Dataset", "DefinitionSummary", "WorkloadRecord",
    "summarize_dataset", "validate_dataset",
]
