"""Crash-safe file writes: a file appears whole or not at all, and is never overwritten.

New files are written to a temporary file in the target's directory, flushed to disk and
renamed into place (a rename within one directory is atomic). JSONL lines are appended with
a single write each, so a crash can at worst leave a partial *last* line, which the next
append closes with a newline so it cannot corrupt the line after it.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from enginetap.errors import DatasetError

__all__ = ["append_line", "replace_text", "write_new_file", "write_new_text"]


def write_new_file(path: Path, fill: Callable[[Path], None]) -> None:
    """Create ``path`` atomically; ``fill(tmp)`` writes the content into ``tmp``.

    Raises:
        DatasetError: ``path`` already exists (existing data is never overwritten).
        OSError: the disk refused the write; the temporary file is removed.
    """
    _refuse_existing(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        # Checked again just before the rename: the window left is only against another
        # writer racing for the same path, which uuid-named blobs make practically moot.
        _refuse_existing(path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_new_text(path: Path, text: str) -> None:
    """Create ``path`` atomically with UTF-8 ``text``; same guarantees as :func:`write_new_file`."""
    write_new_file(path, lambda tmp: tmp.write_bytes(text.encode("utf-8")))


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` atomically with UTF-8 ``text``, replacing the file there if any.

    For files outside datasets that are meant to be rewritten (a guard lock): a crash or a
    full disk leaves the old file whole, never a truncated one.

    Raises:
        OSError: the disk refused the write; the old file and no temporary file are left.
    """
    path = Path(os.path.abspath(path))  # "." and "dir/.." name a directory, not a file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.new")
    write_new_text(tmp, text)  # durable under its own name first
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line (no newline inside) to a JSONL file with a single durable write."""
    if "\n" in line:
        raise ValueError("a JSONL line must not contain a newline")
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    with open(path, "a+b") as f:
        data = line.encode("utf-8") + b"\n"
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data  # close a line a crash left unfinished
        f.write(data)  # append mode: always lands at the end, whatever was read
        f.flush()
        os.fsync(f.fileno())
    if created:
        _fsync_dir(path.parent)


def _refuse_existing(path: Path) -> None:
    if path.exists() or path.is_symlink():
        raise DatasetError(f"refusing to overwrite {path}", "the file already exists",
                           "datasets are append-only: use a new uuid or a new dataset root")


def _fsync_dir(directory: Path) -> None:
    # Makes the new directory entry itself durable; not possible on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. filesystems that do not support fsync on directories
    finally:
        os.close(fd)
