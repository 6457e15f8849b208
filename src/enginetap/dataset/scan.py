"""Read a dataset's definition files and workload lines, turning bad data into problems.

Readers here never raise on bad content: they return what parsed and one problem line per
file or line that did not, with its location (``path`` or ``path:line``, relative to the
root). Strict callers (the :class:`~enginetap.dataset.store.Dataset` loaders) raise on the
first problem; validation reports them all.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from enginetap.core.files import NotRegular, file_kind, iter_lines, read_capped
from enginetap.dataset.paths import resolve_within
from enginetap.dataset.schema import Definition, WorkloadLine
from enginetap.errors import DatasetError, describe_validation

__all__ = [
    "MAX_DEFINITION_BYTES", "MAX_LINE_BYTES", "DamagedLine", "DefinitionFile", "LineRecord",
    "WorkloadScan", "describe", "read_definitions", "read_lines", "scan_all", "scan_workloads",
    "unreadable",
]

M = TypeVar("M", bound=BaseModel)

MAX_DEFINITION_BYTES = 8 << 20
"""Largest definition file read (its reference is capped at 1 Mi characters)."""
MAX_LINE_BYTES = 8 << 20
"""Longest workload line read; a longer one is reported, not loaded."""

_BOM = b"\xef\xbb\xbf"
_PATH = re.compile(r'"path"\s*:\s*"([^"\\]{1,1000})"')


@dataclass(frozen=True)
class DefinitionFile:
    rel: str
    definition: Definition


@dataclass(frozen=True)
class DamagedLine:
    """A workload line (or a whole JSONL file) that cannot be read."""

    where: str
    """``path:line``, or ``path`` when the file itself cannot be read."""
    paths: tuple[str, ...] = ()
    """Stored paths its text still shows (``"path": "..."``); it may reference others."""


@dataclass
class WorkloadScan:
    """Everything :func:`scan_all` found: readable lines, problems, and what is damaged."""

    records: list[LineRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    damaged: list[DamagedLine] = field(default_factory=list)


@dataclass(frozen=True)
class LineRecord:
    rel: str
    lineno: int
    """1-based line number in the JSONL file."""
    line: WorkloadLine

    @property
    def where(self) -> str:
        return f"{self.rel}:{self.lineno}"


def read_definitions(root: Path) -> tuple[list[DefinitionFile], list[str]]:
    """Every ``definitions/**/*.json`` that parses; problems for the rest and for duplicates."""
    found: list[DefinitionFile] = []
    problems: list[str] = []
    first: dict[str, str] = {}
    for rel in _files(root, "definitions", ".json"):
        text, problem = _read(root, rel)
        definition = _parse(Definition, text, rel) if problem == "" else problem
        if isinstance(definition, str):
            problems.append(definition)
        elif definition.name in first:
            problems.append(f"{rel}: duplicate definition name {definition.name!r} "
                            f"(also in {first[definition.name]}); remove one of them")
        else:
            first[definition.name] = rel
            found.append(DefinitionFile(rel, definition))
    return found, problems


def read_lines(root: Path, rel: str) -> tuple[list[LineRecord], list[str]]:
    """The workload lines of one JSONL file (blank lines skipped, as flashinfer-bench does)."""
    scan = WorkloadScan()
    _scan_file(root, rel, scan)
    return scan.records, scan.problems


def scan_workloads(root: Path) -> tuple[list[LineRecord], list[str]]:
    """Every readable line of every ``workloads/**/*.jsonl`` file, and the problems."""
    scan = scan_all(root)
    return scan.records, scan.problems


def scan_all(root: Path) -> WorkloadScan:
    """Like :func:`scan_workloads`, also listing the damaged lines and files."""
    scan = WorkloadScan()
    for rel in _files(root, "workloads", ".jsonl"):
        _scan_file(root, rel, scan)
    return scan


def _scan_file(root: Path, rel: str, scan: WorkloadScan) -> None:
    try:
        path = resolve_within(root, rel)
        # Only "\n" ends a line: str.splitlines would also split on separators (U+2028,
        # ...) that JSON allows unescaped inside strings.
        for lineno, raw in iter_lines(path, MAX_LINE_BYTES):
            _scan_line(rel, lineno, raw, scan)
    except DatasetError as exc:
        scan.problems.append(f"{rel}: {exc}")
        scan.damaged.append(DamagedLine(rel))
    except OSError as exc:
        scan.problems.append(unreadable(root, rel, exc))
        scan.damaged.append(DamagedLine(rel))


def _scan_line(rel: str, lineno: int, raw: bytes | None, scan: WorkloadScan) -> None:
    where = f"{rel}:{lineno}"
    if raw is None:
        scan.problems.append(f"{where}: line longer than {MAX_LINE_BYTES} bytes, not read")
        scan.damaged.append(DamagedLine(where))
        return
    if not raw.strip():
        return
    problem = _line_problem(raw)
    parsed = f"{where}: {problem}" if problem else _parse(WorkloadLine, raw.decode(), where)
    if isinstance(parsed, str):
        scan.problems.append(parsed)
        text = raw.decode("utf-8", errors="replace")
        scan.damaged.append(DamagedLine(where, tuple(dict.fromkeys(_PATH.findall(text)))))
    else:
        scan.records.append(LineRecord(rel, lineno, parsed))


def _line_problem(raw: bytes) -> str:
    if raw.startswith(_BOM):
        return ("starts with a UTF-8 byte-order mark, which JSONL does not allow; remove "
                "its first 3 bytes")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"not valid UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                "repair or remove this line")
    return ""


def _files(root: Path, top: str, suffix: str) -> list[str]:
    """Every entry under ``root/top`` named ``*suffix`` that is not a directory.

    FIFOs, sockets and links are listed too, so that reading them reports what they are.
    """
    base = root / top
    if not base.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in base.rglob(f"*{suffix}")
                  if p.is_symlink() or not p.is_dir())


def _read(root: Path, rel: str) -> tuple[str, str]:
    """``(text, "")``, or ``("", problem)`` when the file cannot be read."""
    try:
        data = read_capped(resolve_within(root, rel), MAX_DEFINITION_BYTES)
        return data.decode("utf-8"), ""
    except DatasetError as exc:
        return "", f"{rel}: {exc}"
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        return "", f"{rel}: not valid UTF-8 (byte {byte:#04x} at offset {exc.start})"
    except OSError as exc:
        return "", unreadable(root, rel, exc)


def unreadable(root: Path, rel: str, exc: OSError) -> str:
    """The problem line of the dataset file ``rel`` that could not be read."""
    if isinstance(exc, NotRegular):
        # Described from the path as stored, so that a link says it is one.
        kind = file_kind(root / PurePosixPath(rel)) or "not a regular file"
        return (f"{rel}: is {kind}, not a regular file; enginetap reads only regular files "
                "(or links to them)")
    reason = str(exc) if exc.errno is None else (exc.strerror or os.strerror(exc.errno))
    return f"{rel}: cannot be read ({reason})"


def _parse(model: type[M], text: str, where: str) -> M | str:
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        return f"{where}: {describe(exc)}"


def describe(exc: ValidationError, limit: int = 3) -> str:
    """A one-line summary of a pydantic error: the first ``limit`` failures with locations."""
    text = describe_validation(exc, limit)
    return text if text.startswith("malformed JSON") else f"does not match the schema: {text}"
