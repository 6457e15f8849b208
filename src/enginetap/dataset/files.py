"""Safe opening of dataset files; the helpers live in :mod:`enginetap.core.files`, shared
with the readers of traces, tap files and guard locks."""

from __future__ import annotations

from enginetap.core.files import NotRegular, file_kind, iter_lines, open_regular, path_of_fd, read_capped

__all__ = ["NotRegular", "file_kind", "iter_lines", "open_regular", "path_of_fd", "read_capped"]
