"""Request labels: what the traffic driver knows about each request, for receipts and
selection (label, profile, expected output length).

The driver writes ``capture-labels.json`` (request key → fields) atomically; every armed
process re-reads it when its modification time changes, so labels reach vLLM's worker
processes with no channel other than the file. In one process, :meth:`RequestLabels.add`
registers labels directly.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("enginetap.capture")

__all__ = ["RequestLabels", "write_labels"]


def write_labels(path: str | Path, labels: dict[str, dict[str, Any]]) -> None:
    """Write ``labels`` to ``path`` atomically (temporary file, then rename).

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(labels, sort_keys=True), encoding="utf-8")
    partial.replace(path)


class RequestLabels:
    """Labels by request key, from a file re-read on change plus direct registrations."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mtime: float | None = None
        self._from_file: dict[str, dict[str, Any]] = {}
        self._direct: dict[str, dict[str, Any]] = {}

    def add(self, labels: dict[str, dict[str, Any]]) -> None:
        self._direct.update(labels)

    def peek(self, key: str) -> dict[str, Any]:
        """``key``'s labels as last read (no look at the file: callers :meth:`refresh`
        once for many keys)."""
        return self._direct.get(key) or self._from_file.get(key) or {}

    def refresh(self) -> None:
        """Re-read the file if its modification time changed (one ``stat`` otherwise)."""
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("enginetap capture: cannot read request labels %s: %s", self.path, exc)
            return
        if isinstance(data, dict):
            self._from_file = {str(k): v for k, v in data.items() if isinstance(v, dict)}
