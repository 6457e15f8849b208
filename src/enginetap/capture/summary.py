"""What one rank's capture did: ``capture-summary-rank<r>.json`` beside the run.

Written when capture closes (at exit, after SIGTERM/SIGINT too) and read by the
``capture`` command's report and by tests: what was written, dropped and refused, which
probes failed or were disabled and why, what was skipped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from enginetap.capture.options import SelectionPolicy

if TYPE_CHECKING:
    from enginetap.capture.writers import WriterStats

logger = logging.getLogger("enginetap.capture")

__all__ = ["SUMMARY_FILE", "CaptureSummary"]

SUMMARY_FILE = "capture-summary-rank{rank}.json"


class CaptureSummary(BaseModel):
    """One rank's capture summary (field order is the file's)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int
    world_size: int
    dataset: str
    """The dataset root the capture writes (rank 0 writes; other ranks gather)."""
    policy: SelectionPolicy
    probes: list[str]
    """The probes of the engine's table this capture wanted."""
    targets: list[str]
    """Where their wrappers were installed (``module:qualname``), sorted."""
    written: int = 0
    bytes_written: int = 0
    per_definition: dict[str, int] = Field(default_factory=dict)
    """Workloads written, by definition name."""
    dropped_budget_full: int = 0
    """Workloads dropped because the byte budget was full (``when_full: drop``)."""
    dropped_after_write_error: int = 0
    refused_by_dataset: int = 0
    """Workloads the dataset refused (their probe was disabled)."""
    write_error: str = ""
    """The error that stopped the writer; empty when none did."""
    probe_failures: dict[str, int] = Field(default_factory=dict)
    disabled_probes: dict[str, str] = Field(default_factory=dict)
    """Probe name → what failed, for each probe disabled."""
    skipped: dict[str, int] = Field(default_factory=dict)
    """Calls not captured, by probe and reason."""
    steps_not_selected: int = 0

    @classmethod
    def read(cls, path: Path) -> CaptureSummary:
        """The summary in ``path``. Raises OSError when it cannot be read and pydantic's
        ValidationError when it is not a capture summary."""
        return cls.model_validate_json(path.read_bytes())

    def with_writer(self, stats: WriterStats | None) -> CaptureSummary:
        """This summary with the writer's counts (none on a rank that does not write)."""
        if stats is None:
            return self
        return self.model_copy(update={
            "written": stats.written, "bytes_written": stats.bytes_written,
            "per_definition": dict(stats.per_definition),
            "dropped_budget_full": stats.dropped_full,
            "dropped_after_write_error": stats.dropped_after_error,
            "refused_by_dataset": stats.refused, "write_error": stats.error})

    def write(self, out_dir: Path) -> None:
        """Write ``out_dir/capture-summary-rank<r>.json`` whole (a temporary file, then a
        rename: the exit watchdog may write it too); an error is logged, not raised (it
        runs at exit)."""
        path = out_dir / SUMMARY_FILE.format(rank=self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.model_dump(), indent=2, default=str) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            logger.error("enginetap capture: cannot write %s: %s", path, exc)
