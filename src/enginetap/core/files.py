"""Open untrusted files safely: regular files only, never blocking, never unbounded.

Datasets, traces, tap files and guard locks are untrusted data. A FIFO, socket or device
in place of a definition, a JSONL file, a trace or a blob (or a symlink to one) would block ``open()`` forever or stream without end,
so every read goes through :func:`open_regular`: the path is checked with ``stat`` before
opening, opened with ``O_NONBLOCK`` (opening a FIFO then returns at once instead of
waiting for a writer), and checked again with ``fstat`` on the open descriptor, which is
what actually decides. Sizes are capped before anything is read into memory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["NotRegular", "file_kind", "iter_lines", "open_regular", "path_of_fd", "read_capped"]

_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotRegular(OSError):
    """The path is not a readable regular file; ``str()`` says what it is instead."""


def file_kind(path: Path) -> str:
    """``""`` for a regular file (or a link to one), else what the path is, in words.

    Examples: ``"missing"``, ``"a FIFO (named pipe)"``, ``"a symlink to a directory"``,
    ``"a dangling symlink"``.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "a dangling symlink" if os.path.islink(path) else "missing"
    except OSError as exc:
        return f"not accessible ({exc.strerror})"
    if stat.S_ISREG(info.st_mode):
        return ""
    what = _kind_of(info.st_mode)
    return f"a symlink to {what}" if os.path.islink(path) else what


def _kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


@contextmanager
def open_regular(path: Path) -> Iterator[int]:
    """A read-only descriptor of ``path``, which must be a regular file.

    Raises:
        NotRegular: ``path`` is missing, or is something other than a regular file.
        OSError: opening it failed otherwise (permissions, too many links, ...).
    """
    kind = file_kind(path)
    if kind:
        raise NotRegular(f"is {kind}, not a regular file" if kind != "missing" else "is missing")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped after the check above: the fd decides
            raise NotRegular(f"is {_kind_of(mode)}, not a regular file")
        yield fd
    finally:
        os.close(fd)


def path_of_fd(fd: int, path: Path) -> str:
    """A name that opens exactly the file behind ``fd`` (for libraries that take a name).

    On Linux ``/proc/self/fd/N`` reopens the very file checked by :func:`open_regular`, so
    nothing swapped in afterwards can be opened instead; elsewhere the original path.
    """
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(path)


def read_capped(path: Path, limit: int) -> bytes:
    """The whole content of regular file ``path``, refused when larger than ``limit`` bytes.

    Raises:
        NotRegular: not a regular file.
        OSError: unreadable, or larger than ``limit`` (checked before reading).
    """
    with open_regular(path) as fd:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(f"it is {size} bytes, more than the {limit}-byte limit for this file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:  # grew while read
            raise OSError(f"it is more than the {limit}-byte limit for this file")
        return data


def iter_lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes without the newline)`` of regular file ``path``, 1-based.

    Only ``\\n`` ends a line. A line longer than ``limit`` bytes is yielded as ``None`` (and
    skipped to its end), so one giant line costs bounded memory.

    Raises:
        NotRegular: not a regular file.
        OSError: unreadable.
    """
    with open_regular(path) as fd, os.fdopen(os.dup(fd), "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > limit and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                yield lineno, None
                continue
            yield lineno, raw.removesuffix(b"\n")
