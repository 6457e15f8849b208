"""Where things live in a FlashInfer-Trace dataset, and safe resolution of stored paths.

Every path a dataset stores is relative to its root, uses forward slashes, and must stay
inside the root once symlinks are followed: a workload line read from disk is untrusted
input, and a path in it must never make us read or write elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from enginetap.errors import DatasetError

__all__ = [
    "OUTPUT_KEY_PREFIX", "blob_relpath", "definition_relpath", "resolve_within",
    "safe_component", "workloads_relpath",
]

OUTPUT_KEY_PREFIX = "enginetap_output:"
"""Prefix of the blob keys holding the engine's captured outputs (inputs use their name)."""

# Names become file and directory names: keep them portable and free of path syntax.
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


def safe_component(kind: str, value: str) -> str:
    """Return ``value`` if it can be one path component (a name, op_type or uuid).

    Raises:
        DatasetError: ``value`` is empty, too long, starts with a dot or dash, or holds
            characters other than letters, digits, ``_``, ``.`` and ``-``.
    """
    if _COMPONENT.fullmatch(value) and ".." not in value:
        return value
    raise DatasetError(
        f"{kind} {value!r} cannot be used in a dataset path",
        "it must be 1-200 characters of letters, digits, '_', '.', '-', start with a letter, "
        "digit or '_', and not contain '..'",
        f"rename the {kind}")


def definition_relpath(op_type: str, name: str) -> str:
    return f"definitions/{safe_component('op_type', op_type)}/{safe_component('name', name)}.json"


def workloads_relpath(op_type: str, name: str) -> str:
    return f"workloads/{safe_component('op_type', op_type)}/{safe_component('name', name)}.jsonl"


def blob_relpath(op_type: str, name: str, uuid: str) -> str:
    op_type, name = safe_component("op_type", op_type), safe_component("name", name)
    return f"blob/workloads/{op_type}/{name}/{name}_{safe_component('uuid', uuid)}.safetensors"


def resolve_within(root: Path, relative: str) -> Path:
    """Resolve ``relative`` against ``root`` (already resolved) and check containment.

    Returns the real path (symlinks followed). The target need not exist.

    Raises:
        DatasetError: the path is empty, absolute, has ``..`` components or backslashes,
            or leads outside ``root`` through a symlink.
    """
    why = _syntax_problem(relative)
    if why:
        raise DatasetError(f"refusing dataset path {relative!r}", why,
                           "store paths relative to the dataset root, with forward slashes")
    real = (root / PurePosixPath(relative)).resolve()
    if not real.is_relative_to(root):
        raise DatasetError(
            f"refusing dataset path {relative!r}",
            f"it resolves to {real}, outside the dataset root {root} (through a symlink)",
            "replace the symlink by the file itself, or move the data inside the root")
    return real


def _syntax_problem(relative: str) -> str:
    if not relative or "\x00" in relative:
        return "it is empty or holds a NUL character"
    if "\\" in relative:
        return "it holds a backslash"
    pure = PurePosixPath(relative)
    if pure.is_absolute():
        return "it is absolute"
    if ".." in pure.parts:
        return "it has a '..' component"
    return ""
