"""The one per-rank JSONL writer: every record of an armed process goes through it.

``<dir>/<name>.jsonl`` is written per rank as ``<dir>/<name>-rank<r>.jsonl`` (see
:func:`~enginetap.core.ranks.rank_path`), so ranks never share a file and
:func:`~enginetap.core.ranks.merge_rank_files` can join them. Every record is stamped with
``step`` (the step in flight, else the last published one, -1 before the first: never
decreasing within a file, as the merge needs) and ``rank``.

Durability rule, one for every writer: a line is written whole and flushed to the OS as
soon as it is written (a crashed engine leaves every finished record on disk; a torn last
line is possible only if the machine itself fails), and fsynced when the writer closes.
A file is truncated the first time this process opens it and appended to after that, so
several writers of one file in one process (two guard patches) share it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

from enginetap.core import context
from enginetap.core.ranks import rank_path

try:  # a tenth of json's encoding time: records are written on the engine's host thread
    import orjson
except ImportError:  # pragma: no cover - a dependency; json writes the same lines
    orjson = None  # type: ignore[assignment]

__all__ = ["RankJsonl", "close_all", "encode_line"]


def encode_line(record: dict[str, Any], fast: bool = False) -> str:
    """``record`` as one compact JSON line (newline included); values JSON has no type
    for are written as their ``str``.

    ``fast`` encodes with orjson, for records of ints and strings written on the engine's
    host thread every step: the same line, except that a NaN or infinite float would be
    written as ``null`` (json writes ``NaN``), so records that may hold such floats
    leave it off."""
    if fast and orjson is not None:
        try:
            return orjson.dumps(record, default=str, option=orjson.OPT_NON_STR_KEYS
                                | orjson.OPT_APPEND_NEWLINE).decode()
        except TypeError:  # e.g. an int beyond 64 bits: json writes it
            pass
    return json.dumps(record, separators=(",", ":"), default=str) + "\n"


_OPEN: dict[Path, IO[str]] = {}
_LOCK = threading.RLock()
"""Reentrant: if a signal's exception leaves it held by the thread that was writing,
that thread's own exit handlers can still take it."""


class RankJsonl:
    """Appends records to this rank's file of ``path`` (opened lazily)."""

    def __init__(self, path: str | Path, rank: int, fast: bool = False) -> None:
        self.path = rank_path(Path(path), rank)
        self.rank = rank
        self.fast = fast
        """Encode with :func:`encode_line`'s ``fast`` (records without NaN/inf floats)."""

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        """Write ``record`` (stamped with ``step`` and ``rank``) as one flushed line.

        Raises:
            OSError: the directory cannot be created or the file written.
        """
        stamped = {"step": context.step_number() if step is None else step, "rank": self.rank,
                   **record}
        line = encode_line(stamped, self.fast)
        with _LOCK:
            sink = _OPEN.get(self.path)
            if sink is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                sink = _OPEN[self.path] = self.path.open("w", encoding="utf-8")
            sink.write(line)
            sink.flush()

    def close(self) -> None:
        """Fsync and close this file (a later write starts it afresh)."""
        with _LOCK:
            _close(self.path)


def _close(path: Path) -> None:
    sink = _OPEN.pop(path, None)
    if sink is not None:
        sink.flush()
        os.fsync(sink.fileno())
        sink.close()


def close_all() -> None:
    """Fsync and close every file of this process (disarm, tests)."""
    with _LOCK:
        for path in list(_OPEN):
            _close(path)
