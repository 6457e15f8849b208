"""Crash-safe file writes: a file appears whole or not at all, and is never overwritten.

New files are written to a temporary file in the target's directory, flushed to disk and
then linked into place: ``link`` fails when the target exists, so a file another writer
put there first is never replaced, even in a race (where hard links are not supported,
a checked rename is used instead). JSONL lines are appended with a single write per call,
so a crash can at worst leave a partial *last* line, which the next append closes with a
newline so it cannot corrupt the line after it.

Directories created on the way are made durable in their parents, so that a durable line
never points into a directory a power loss could forget.

Files are created with mode ``0o666`` less the process umask, like any file ``open()``
creates, so a dataset is as readable by others as the user's other files.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from enginetap.errors import DatasetError

__all__ = [
    "AlreadyExists", "append_line", "append_lines", "fsync_dir", "fsync_dirs", "make_dirs",
    "replace_text", "write_new_bytes", "write_new_file", "write_new_text",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Errors of link() that mean "this filesystem has no hard links", not "the write failed".
_NO_LINKS = {errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
             errno.ENOSYS}


class AlreadyExists(DatasetError):
    """The file to create exists already (written before, or by another writer just now)."""


def write_new_file(path: Path, fill: Callable[[Path], None], *, sync_dir: bool = True,
                   race_free: bool = True) -> None:
    """Create ``path`` atomically; ``fill(tmp)`` writes the content into ``tmp``.

    With ``sync_dir=False`` the new directory entry is not made durable here: the caller
    calls :func:`fsync_dir` once for many files of one directory. ``race_free=False``
    places the file with one checked rename instead of link + unlink (cheaper), for names
    no other writer can want (uuid-named blobs).

    Raises:
        AlreadyExists: ``path`` already exists (existing data is never overwritten).
        OSError: the disk refused the write; the temporary file is removed.
    """
    _refuse_existing(path)
    make_dirs(path.parent)
    tmp = _new_tmp(path)
    try:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # 0o666 less the umask, set by the kernel
        fill(tmp)
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:
            os.chmod(tmp, mode)  # fill may recreate the file 0600 (safetensors does)
        _sync_file(tmp)
        _put(tmp, path, race_free)
    finally:
        tmp.unlink(missing_ok=True)
    if sync_dir:
        fsync_dir(path.parent)


def write_new_bytes(path: Path, chunks: Sequence[bytes | memoryview], *,
                    sync_dir: bool = True, race_free: bool = True) -> None:
    """Create ``path`` atomically with the concatenation of ``chunks``; the guarantees and
    options of :func:`write_new_file`, with fewer calls: the temporary file is written
    through the descriptor that created it (``writev``, the interpreter released) and
    flushed through it too.

    Raises:
        AlreadyExists: ``path`` already exists.
        OSError: the disk refused the write; the temporary file is removed.
    """
    _refuse_existing(path)
    make_dirs(path.parent)
    tmp, fd = _open_tmp(path)
    try:
        try:
            _writev_all(fd, chunks)
            getattr(os, "fdatasync", os.fsync)(fd)
        finally:
            os.close(fd)
        _put(tmp, path, race_free)
    finally:
        tmp.unlink(missing_ok=True)
    if sync_dir:
        fsync_dir(path.parent)


def write_new_text(path: Path, text: str) -> None:
    """Create ``path`` atomically with UTF-8 ``text``; same guarantees as :func:`write_new_file`."""
    write_new_file(path, lambda tmp: tmp.write_bytes(text.encode("utf-8")))


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` atomically with UTF-8 ``text``, replacing the file there if any.

    For files outside datasets that are meant to be rewritten (a guard lock): a crash or a
    full disk leaves the old file whole, never a truncated one.

    A symlink to a regular file is written through (its target is replaced, the link
    kept); anything else that is not a regular file (a FIFO, a device such as
    ``/dev/null``, a directory, a dangling link) is refused, never renamed over.

    Raises:
        OSError: the disk refused the write, or ``path`` is not a regular file; the old
            file and no temporary file are left.
    """
    from enginetap.core.files import file_kind

    path = Path(os.path.abspath(path))  # "." and "dir/.." name a directory, not a file
    kind = file_kind(path)
    if kind not in ("", "missing"):
        raise OSError(errno.EEXIST, f"it is {kind}, not a regular file to replace")
    if path.is_symlink():
        path = path.resolve()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.new")
    write_new_text(tmp, text)  # durable under its own name first
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line (no newline inside) to a JSONL file with a single durable write."""
    append_lines(path, [line])


def append_lines(path: Path, lines: Sequence[str]) -> None:
    """Append ``lines`` (no newline inside any) to a JSONL file: one write, one fsync.

    Raises:
        ValueError: a line holds a newline.
        DatasetError: ``path`` exists but is not a regular file (a FIFO, a directory...).
        OSError: the disk refused the write.
    """
    if any("\n" in line for line in lines):
        raise ValueError("a JSONL line must not contain a newline")
    if not lines:
        return
    make_dirs(path.parent)
    created = not os.path.lexists(path)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _CLOEXEC, 0o666)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"cannot append to {path}", "it is not a regular file",
                               "replace it by the workloads file itself")
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        if info.st_size > 0 and os.pread(fd, 1, info.st_size - 1) != b"\n":
            data = b"\n" + data  # close a line a crash left unfinished
        _write_all(fd, data)  # O_APPEND: lands at the end, whatever another writer did
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def make_dirs(directory: Path) -> None:
    """``mkdir -p``; each directory it creates is made durable in its parent (once)."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    if missing:
        missing[0].mkdir(parents=True, exist_ok=True)  # exist_ok: another writer may race
        fsync_dirs(d.parent for d in reversed(missing))


def fsync_dir(directory: Path) -> None:
    """Make new entries of ``directory`` durable; a no-op where the platform cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. filesystems that do not support fsync on directories
    finally:
        os.close(fd)


def fsync_dirs(directories: Iterable[Path]) -> None:
    """:func:`fsync_dir` once per distinct directory."""
    for directory in dict.fromkeys(directories):
        fsync_dir(directory)


def _new_tmp(path: Path) -> Path:
    tmp, fd = _open_tmp(path)
    os.close(fd)
    return tmp


def _open_tmp(path: Path) -> tuple[Path, int]:
    # Our own O_EXCL create (not mkstemp, which makes 0600 files): mode 0666 less umask.
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o666)
        except FileExistsError:
            continue  # 48 random bits taken already: draw again


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        # The data and the size are what a reader needs; fdatasync skips the rest.
        getattr(os, "fdatasync", os.fsync)(fd)
    finally:
        os.close(fd)


def _put(tmp: Path, path: Path, race_free: bool) -> None:
    """Give the durable ``tmp`` its name ``path``, never replacing a file there."""
    if race_free:
        _place(tmp, path)
    else:
        _refuse_existing(path)
        os.replace(tmp, path)


def _place(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _exists(path) from None
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        # No hard links here: checked just before the rename, the window left is only
        # against another writer racing for the same path.
        _refuse_existing(path)
        os.replace(tmp, path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_IOV_MAX = 512
"""Buffers per ``writev`` call, below every platform's IOV_MAX (Linux: 1024)."""


def _writev_all(fd: int, chunks: Sequence[bytes | memoryview]) -> None:
    """Write every chunk in order; a short write (a signal, a 2 GiB call limit) resumes
    where it stopped."""
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    while views:
        done = os.writev(fd, views[:_IOV_MAX])
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def _refuse_existing(path: Path) -> None:
    if os.path.lexists(path):
        raise _exists(path)


def _exists(path: Path) -> AlreadyExists:
    return AlreadyExists(f"refusing to overwrite {path}", "the file already exists",
                         "datasets are append-only: use a new uuid or a new dataset root")
