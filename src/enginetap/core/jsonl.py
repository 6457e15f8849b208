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
from typing import Any

from enginetap.core import context
from enginetap.core.ranks import rank_path

try:  # a tenth of json's encoding time: records are written on the engine's host thread
    import orjson
except ImportError:  # pragma: no cover - a dependency; json writes the same lines
    orjson = None  # type: ignore[assignment]

__all__ = ["Encoded", "NonFinite", "RankJsonl", "close_all", "encode_line", "encode_line_bytes"]


class NonFinite(dict):  # type: ignore[type-arg]
    """A record that holds NaN or infinite floats: a ``fast`` writer encodes it with json,
    which keeps them (orjson would write ``null``). Its maker, who knows where floats
    are, returns this type only when it has to."""


class Encoded:
    """A value already encoded as compact JSON (UTF-8 ``data``), written into a record's
    line as it is: a record's largest part (the tap's hashes) built in one numpy pass
    rather than as Python strings for the encoder to copy again. The lines are those of
    the decoded value, with json as with orjson."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _fast_default(value: Any) -> Any:
    return orjson.Fragment(value.data) if isinstance(value, Encoded) else str(value)


def _default(value: Any) -> Any:
    return json.loads(value.data) if isinstance(value, Encoded) else str(value)


def encode_line(record: dict[str, Any], fast: bool = False) -> str:
    """``record`` as one compact JSON line (newline included); values JSON has no type
    for are written as their ``str``.

    ``fast`` encodes with orjson, for records of ints and strings written on the engine's
    host thread every step: the same line, except that a NaN or infinite float would be
    written as ``null`` (json writes ``NaN``), so records that may hold such floats
    leave it off."""
    return encode_line_bytes(record, fast).decode()


def encode_line_bytes(record: dict[str, Any], fast: bool = False) -> bytes:
    """:func:`encode_line` as UTF-8 bytes (what the writer hands the OS)."""
    if fast and orjson is not None:
        try:
            return orjson.dumps(record, default=_fast_default, option=orjson.OPT_NON_STR_KEYS
                                | orjson.OPT_APPEND_NEWLINE)
        except TypeError:  # e.g. an int beyond 64 bits: json writes it
            pass
    return (json.dumps(record, separators=(",", ":"), default=_default) + "\n").encode()


_OPEN: dict[Path, int] = {}
"""Open files by path: raw descriptors (O_APPEND), so that a line is one ``write`` call,
flushed to the OS as it returns, with no buffer layer on the engine's thread."""
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
        line = encode_line_bytes(stamped, self.fast and not isinstance(record, NonFinite))
        with _LOCK:
            fd = _OPEN.get(self.path)
            if fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = _OPEN[self.path] = os.open(
                    self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                    | getattr(os, "O_CLOEXEC", 0), 0o666)
            view = memoryview(line)
            while view:  # a regular file takes it whole unless the disk is full
                view = view[os.write(fd, view):]

    def close(self) -> None:
        """Fsync and close this file (a later write starts it afresh)."""
        with _LOCK:
            _close(self.path)


def _close(path: Path) -> None:
    fd = _OPEN.pop(path, None)
    if fd is not None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def close_all() -> None:
    """Fsync and close every file of this process (disarm, tests)."""
    with _LOCK:
        for path in list(_OPEN):
            _close(path)
