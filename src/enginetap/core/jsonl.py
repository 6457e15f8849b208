"""The one per-rank JSONL writer: every record of an armed process goes through it.

``<dir>/<name>.jsonl`` is written per rank as ``<dir>/<name>-rank<r>.jsonl`` (see
:func:`~enginetap.core.ranks.rank_path`), so ranks never share a file and
:func:`~enginetap.core.ranks.merge_rank_files` can join them. Every record is stamped with
``step`` (the step in flight, else the last published one, -1 before the first: never
decreasing within a file, as the merge needs) and ``rank``.

Durability rule, one for every writer: a line is written whole and flushed to the OS as
soon as it is written (a crashed engine leaves every finished record on disk; a torn last
line is possible only if the machine itself fails), and fsynced when the writer closes.
A writer made with ``offload=True`` (the tap's: a step's record is hundreds of KB, and
the ``write`` call's copy into the OS costs the engine's thread more than encoding it)
hands each encoded line to its file's appender thread, which makes the ``write`` call
with the GIL released; its lines reach the OS in order a moment later, and all of them
before :meth:`RankJsonl.flush` or ``close`` returns, and at exit.
A file is truncated the first time this process opens it and appended to after that, so
several writers of one file in one process (two guard patches) share it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import Any

from enginetap.core import context, shutdown
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
    """A value already encoded as compact JSON (``data``), written into a record's
    line as it is: a record's largest part (the tap's hashes) built in a few numpy passes
    rather than as Python strings for the encoder to copy again. The lines are those of
    the decoded value, with json as with orjson."""

    __slots__ = ("data",)

    def __init__(self, data: str | bytes) -> None:
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


class _Appender:
    """One file's appender thread: writes the lines queued to it, in order (see the
    module docstring); an ``OSError`` is kept for the writers to raise."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.error: OSError | None = None
        self.lines: queue.SimpleQueue[bytes | threading.Event | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="enginetap-appender", daemon=True)
        self.thread.start()
        shutdown.on_exit(self.flush, stuck=self.flush_briefly, signals=False)

    def _run(self) -> None:
        while True:
            line = self.lines.get()
            if line is None:
                return
            if isinstance(line, threading.Event):
                line.set()
                continue
            try:
                _write_all(self.fd, line)
            except OSError as exc:
                self.error = self.error or exc

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every line queued so far is written (at most ``timeout`` s)."""
        if self.thread.is_alive():
            done = threading.Event()
            self.lines.put(done)
            done.wait(timeout)

    def flush_briefly(self) -> None:
        """:meth:`flush` for a stuck exit: it waits a moment, never more."""
        self.flush(STUCK_FLUSH_S)

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        shutdown.forget(self.flush)
        self.lines.put(None)
        self.thread.join()


STUCK_FLUSH_S = 2.0
"""How long a stuck exit waits for an appender thread to write what is queued to it."""

_APPENDERS: dict[Path, _Appender] = {}
"""The appender thread of each file an offloading writer wrote (this process's)."""


def _write_all(fd: int, line: bytes) -> None:
    view = memoryview(line)
    while view:  # a regular file takes it whole unless the disk is full
        view = view[os.write(fd, view):]


class RankJsonl:
    """Appends records to this rank's file of ``path`` (opened lazily)."""

    def __init__(self, path: str | Path, rank: int, fast: bool = False,
                 offload: bool = False) -> None:
        self.path = rank_path(Path(path), rank)
        self.rank = rank
        self.fast = fast
        """Encode with :func:`encode_line`'s ``fast`` (records without NaN/inf floats)."""
        self.offload = offload
        """Hand lines to the file's appender thread (see the module docstring)."""

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        """Write ``record`` (stamped with ``step`` and ``rank``) as one line, flushed to the
        OS now, or queued to the file's appender thread where a writer offloads.

        Raises:
            OSError: the directory cannot be created or the file written (where a writer
                offloads: an earlier line could not be written; this one is not either).
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
            appender = _APPENDERS.get(self.path)
            if appender is not None and appender.pid != os.getpid():  # a forked child's
                appender = _APPENDERS.pop(self.path)
            if appender is None and self.offload:
                appender = _APPENDERS[self.path] = _Appender(fd)
            if appender is None:
                _write_all(fd, line)
                return
            appender.raise_error()  # an earlier line's (this one is not written either)
            appender.lines.put(line)  # after the lines queued before it: in order

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every line written so far reached the OS (an offloading writer's
        appender thread wrote them; at most ``timeout`` s).

        Raises:
            OSError: a line could not be written.
        """
        appender = _APPENDERS.get(self.path)
        if appender is not None:
            appender.flush(timeout)
            appender.raise_error()

    def close(self) -> None:
        """Fsync and close this file (a later write starts it afresh)."""
        with _LOCK:
            _close(self.path)


def _close(path: Path) -> None:
    appender = _APPENDERS.pop(path, None)
    if appender is not None and appender.pid == os.getpid():
        appender.stop()
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
