"""Read a dataset's definition files and workload lines, turning bad data into problems.

Readers here never raise on bad content: they return what parsed and one problem line per
file or line that did not, with its location (``path`` or ``path:line``, relative to the
root). Strict callers (the :class:`~enginetap.dataset.store.Dataset` loaders) raise on the
first problem; validation reports them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from enginetap.dataset.paths import resolve_within
from enginetap.dataset.schema import Definition, WorkloadLine
from enginetap.errors import DatasetError

__all__ = [
    "DefinitionFile", "LineRecord", "describe", "read_definitions", "read_lines", "scan_workloads",
]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class DefinitionFile:
    rel: str
    definition: Definition


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
        definition = _parse(Definition, text, rel) if text is not None else problem
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
    text, problem = _read(root, rel)
    if text is None:
        return [], [problem]
    records: list[LineRecord] = []
    problems: list[str] = []
    # Split on "\n" only: str.splitlines would also split on separators (U+2028, ...) that
    # JSON allows unescaped inside strings.
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        parsed = _parse(WorkloadLine, raw, f"{rel}:{lineno}")
        if isinstance(parsed, str):
            problems.append(parsed)
        else:
            records.append(LineRecord(rel, lineno, parsed))
    return records, problems


def scan_workloads(root: Path) -> tuple[list[LineRecord], list[str]]:
    """Every line of every ``workloads/**/*.jsonl`` file."""
    records: list[LineRecord] = []
    problems: list[str] = []
    for rel in _files(root, "workloads", ".jsonl"):
        found, bad = read_lines(root, rel)
        records += found
        problems += bad
    return records, problems


def _files(root: Path, top: str, suffix: str) -> list[str]:
    base = root / top
    if not base.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in base.rglob(f"*{suffix}")
                  if p.is_file() or p.is_symlink())


def _read(root: Path, rel: str) -> tuple[str | None, str]:
    try:
        return resolve_within(root, rel).read_text(encoding="utf-8"), ""
    except DatasetError as exc:
        return None, f"{rel}: {exc}"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{rel}: cannot be read ({exc})"


def _parse(model: type[M], text: str, where: str) -> M | str:
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        return f"{where}: {describe(exc)}"


def describe(exc: ValidationError, limit: int = 3) -> str:
    """A one-line summary of a pydantic error: the first ``limit`` failures with locations."""
    errors = exc.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return f"malformed JSON ({errors[0]['msg']})"
    parts = [f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in errors[:limit]]
    more = f" (+{len(errors) - limit} more)" if len(errors) > limit else ""
    return f"does not match the schema: {'; '.join(parts)}{more}"
