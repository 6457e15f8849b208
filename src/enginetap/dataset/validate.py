"""Validate a dataset: every problem, one line each, with its location.

Checked: definition files parse and sit at ``definitions/<op_type>/<name>.json``; every
workload line parses, names a known definition and sits in that definition's JSONL file;
its axes are exactly the definition's var axes and satisfy its constraints; its inputs are
exactly the definition's, scalars as scalars and tensors in blobs that exist, open, hold
the key, and agree in shape and dtype; the engine outputs likewise; uuids are unique.

Blobs are checked through their safetensors header (which safetensors verifies against
the file size), not by reading tensor data; only regular files are opened, and a FIFO,
directory or device where a blob belongs is named as such. A blob no line references is
a problem too: it is what a crash between writing a blob and appending its line leaves
behind, and the fix is to delete it -- unless some workload line or file cannot be read:
then the blob may be what that line needs, and the advice is to repair the line first.
A symlink leading outside the root is never called a blob of the dataset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from enginetap.dataset.blobs import Header, read_header
from enginetap.dataset.checks import coerce_scalar
from enginetap.dataset.constraints import violations
from enginetap.dataset.files import file_kind
from enginetap.dataset.paths import definition_relpath, resolve_within, workloads_relpath
from enginetap.dataset.scan import (
    DamagedLine, DefinitionFile, LineRecord, read_definitions, scan_all,
)
from enginetap.dataset.schema import (
    Definition, RandomInput, SafetensorsInput, ScalarInput, TensorSpec, WorkloadLine,
)
from enginetap.dataset.store import Dataset
from enginetap.errors import DatasetError

__all__ = ["validate_dataset"]


def validate_dataset(root: str | Path) -> list[str]:
    """Every problem of the dataset at ``root``, one line each; ``[]`` when it is valid.

    Bad data never raises; it becomes a problem line.

    Raises:
        DatasetError: ``root`` is not a dataset (an empty path, a missing directory, or
            one holding none of ``definitions/``, ``workloads/``, ``blob/``).
    """
    base = Dataset(root).root
    files, problems = read_definitions(base)
    unreadable = len(problems)
    problems += [p for f in files for p in _misplaced_definition(f)]
    by_name = {f.definition.name: f.definition for f in files}
    scan = scan_all(base)
    problems += scan.problems
    blobs = _Blobs(base)
    first_seen: dict[str, str] = {}
    unknown: dict[tuple[str, str], list[int]] = {}
    for record in scan.records:
        blobs.mark(record.line)
        problems += _check_record(record, by_name, blobs, first_seen)
        if record.line.definition not in by_name:
            unknown.setdefault((record.rel, record.line.definition), []).append(record.lineno)
    problems += _unknown_definitions(unknown, sorted(by_name), unreadable)
    return problems + blobs.orphans(scan.damaged) + _capture_run(base)


CAPTURE_RUN = "enginetap/capture-run.json"
"""Where ``enginetap capture`` records whether the run that wrote the dataset completed."""


def _capture_run(root: Path) -> list[str]:
    """A problem when the last capture into ``root`` did not complete (failed, interrupted,
    killed while ``running``): its workloads may be a partial set."""
    import json

    from enginetap.dataset.files import read_capped

    path = root / CAPTURE_RUN
    if not os.path.lexists(path):
        return []
    try:
        record = json.loads(read_capped(path, 1 << 20))
        status, reason = record["status"], record.get("reason") or ""
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        why = str(exc) if isinstance(exc, OSError) else "it is not a capture status record"
        return [f"{CAPTURE_RUN}: cannot read the capture's status ({why}); whether the "
                "capture completed is unknown: capture again, or delete the file to accept "
                "the workloads as they are"]
    if status == "complete":
        return []
    said = f" ({str(reason)[:300]})" if reason else ""
    state = ("still running, or killed before it ended" if status == "running"
             else f"status {str(status)[:40]!r}{said}")
    return [f"{CAPTURE_RUN}: the capture that wrote this dataset did not complete ({state}); "
            "its workloads may be partial: capture again, or delete that file to accept "
            "them as they are"]


def _unknown_definitions(unknown: Mapping[tuple[str, str], list[int]], known: list[str],
                         unreadable: int) -> list[str]:
    """One line per file and unknown name: a refused definition file must not bury its
    own problem line under one line per workload of it."""
    out = []
    for (rel, name), linenos in unknown.items():
        more = f"; so do {len(linenos) - 1} more line(s) of this file" if len(linenos) > 1 else ""
        hint = (f"; {unreadable} definition file(s) cannot be read, see their lines"
                if unreadable else "")
        out.append(f"{rel}:{linenos[0]}: unknown definition {name!r} (no readable definition "
                   f"file holds it; known: {known or 'none'}){more}{hint}")
    return out


def _misplaced_definition(found: DefinitionFile) -> list[str]:
    d = found.definition
    expected = _layout_path(definition_relpath, d.op_type, d.name)
    if found.rel == expected:
        return []
    return [f"{found.rel}: definition {d.name!r} of op_type {d.op_type!r} belongs at {expected}"]


def _layout_path(layout: Callable[[str, str], str], op_type: str, name: str) -> str:
    try:
        return layout(op_type, name)
    except DatasetError as exc:
        return f"<none: {exc.what}>"


def _check_record(record: LineRecord, by_name: Mapping[str, Definition], blobs: _Blobs,
                  first_seen: dict[str, str]) -> list[str]:
    where, line = record.where, record.line
    problems = []
    uuid = line.workload.uuid
    if uuid in first_seen:
        problems.append(f"{where}: duplicate uuid {uuid!r} (first at {first_seen[uuid]})")
    first_seen.setdefault(uuid, where)
    definition = by_name.get(line.definition)
    if definition is None:
        return problems  # reported once per file by _unknown_definitions
    expected = _layout_path(workloads_relpath, definition.op_type, definition.name)
    if record.rel != expected:
        problems.append(f"{where}: line for {definition.name!r} belongs in {expected}")
    axes_ok = _check_axes(where, definition, line.workload.axes, problems)
    axes = line.workload.axes if axes_ok else None
    _check_inputs(where, definition, line, axes, blobs, problems)
    _check_outputs(where, definition, line, axes, blobs, problems)
    return problems


def _check_axes(where: str, definition: Definition, axes: Mapping[str, int],
                problems: list[str]) -> bool:
    var = definition.var_axes
    missing = [a for a in var if a not in axes]
    extra = [a for a in axes if a not in var]
    if missing:
        problems.append(f"{where}: axes lack the definition's var axes {missing}")
    if extra:
        problems.append(f"{where}: axes {extra} are not var axes of {definition.name!r} "
                        f"(its var axes: {var})")
    if missing or extra:
        return False
    problems += [f"{where}: {v}" for v in violations(definition.constraints,
                                                      {**definition.const_axes, **axes})]
    return True


def _check_inputs(where: str, definition: Definition, line: WorkloadLine,
                  axes: Mapping[str, int] | None, blobs: _Blobs, problems: list[str]) -> None:
    stored = line.workload.inputs
    missing = [n for n in definition.inputs if n not in stored]
    extra = [n for n in stored if n not in definition.inputs]
    if missing:
        problems.append(f"{where}: inputs {missing} are missing")
    if extra:
        problems.append(f"{where}: inputs {extra} are not inputs of {definition.name!r}")
    for name, spec in definition.inputs.items():
        value = stored.get(name)
        label = f"{where}: input {name!r}"
        if value is None or isinstance(value, RandomInput):
            continue  # missing: reported above; random: valid FlashInfer-Trace, nothing stored
        if spec.shape is None:
            problems += _check_scalar(label, spec, value)
        elif isinstance(value, ScalarInput):
            problems.append(f"{label}: is a tensor {spec.shape} but stored as a scalar")
        else:
            problems += blobs.check(label, value, _shape(definition, spec, axes), spec.dtype)


def _check_scalar(label: str, spec: TensorSpec, value: SafetensorsInput | ScalarInput) -> list[str]:
    if not isinstance(value, ScalarInput):
        return [f"{label}: is a scalar but stored as {value.type!r}"]
    _, why = coerce_scalar(spec.dtype, value.value)
    return [f"{label}: {value.value!r} is not a scalar of dtype {spec.dtype} ({why})"] if why else []


def _check_outputs(where: str, definition: Definition, line: WorkloadLine,
                   axes: Mapping[str, int] | None, blobs: _Blobs, problems: list[str]) -> None:
    stored = line.enginetap.outputs.tensors if line.enginetap else {}
    for name, ref in stored.items():
        spec = definition.outputs.get(name)
        if spec is None:
            problems.append(f"{where}: engine output {name!r} is not an output of "
                            f"{definition.name!r} (its outputs: {list(definition.outputs)})")
        else:
            problems += blobs.check(f"{where}: engine output {name!r}", ref,
                                    _shape(definition, spec, axes), spec.dtype)


def _shape(definition: Definition, spec: TensorSpec,
           axes: Mapping[str, int] | None) -> tuple[int, ...] | None:
    """Expected shape, or None when the line's axes are broken (already reported)."""
    return None if axes is None else definition.shape_of(spec, dict(axes)) or ()


class _Blobs:
    """Blob headers read once each, and which blob files some line references."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.headers: dict[Path, Header | str] = {}
        self.referenced: set[Path] = set()

    def mark(self, line: WorkloadLine) -> None:
        refs = [v for v in line.workload.inputs.values() if isinstance(v, SafetensorsInput)]
        refs += line.enginetap.outputs.tensors.values() if line.enginetap else []
        for ref in refs:
            self.referenced |= _names_of(self.root, ref.path)

    def check(self, label: str, ref: SafetensorsInput, shape: tuple[int, ...] | None,
              dtype: str) -> list[str]:
        try:
            header = self._header(resolve_within(self.root, ref.path))
        except DatasetError as exc:
            return [f"{label}: {exc}"]
        if isinstance(header, str):
            return [f"{label}: blob {ref.path} {header}"]
        if ref.tensor_key not in header:
            return [f"{label}: blob {ref.path} has no tensor {ref.tensor_key!r}"]
        got_dtype, got_shape = header[ref.tensor_key]
        problems = []
        if shape is not None and got_shape != shape:
            problems.append(f"{label}: expected shape {list(shape)}, blob {ref.path} holds "
                            f"{list(got_shape)}")
        if got_dtype != dtype:
            problems.append(f"{label}: expected dtype {dtype}, blob {ref.path} holds {got_dtype}")
        return problems

    def _header(self, path: Path) -> Header | str:
        if path not in self.headers:
            self.headers[path] = read_header(path)
        return self.headers[path]

    def orphans(self, damaged: list[DamagedLine]) -> list[str]:
        """A line for each entry under ``blob/`` that no readable line references."""
        base = self.root / "blob"
        if base.is_symlink() and not base.resolve().is_relative_to(self.root):
            # Never walked: its files are not the dataset's to judge (or to advise deleting).
            return [f"blob: a symlink leading outside the dataset (to {base.resolve()}); "
                    "enginetap never reads blobs through it, so every blob it should hold is "
                    "missing: replace the link by a directory inside the dataset"]
        if not base.is_dir():
            return []
        named = {p: d.where for d in reversed(damaged) for path in d.paths
                 for p in _names_of(self.root, path)}
        out = []
        for entry in sorted(base.rglob("*")):
            if entry.is_dir() and not entry.is_symlink():
                continue  # the layout's own directories
            lexical = Path(os.path.abspath(entry))
            if lexical in self.referenced or entry.resolve() in self.referenced:
                continue
            rel = entry.relative_to(self.root).as_posix()
            out.append(_unreferenced(self.root, entry, rel, named.get(lexical), damaged))
        return out


def _names_of(root: Path, stored: str) -> set[Path]:
    """The paths a stored path may name: as written (links not followed) and resolved."""
    try:
        real = resolve_within(root, stored)
    except DatasetError:
        real = None  # unsafe: reported where the line is checked; still names its link
    if PurePosixPath(stored).is_absolute() or "\\" in stored:
        return {real} if real else set()
    lexical = Path(os.path.abspath(root / PurePosixPath(stored)))
    return {lexical, real} if real else {lexical}


def _unreferenced(root: Path, entry: Path, rel: str, named_by: str | None,
                  damaged: list[DamagedLine]) -> str:
    if named_by is not None:
        return (f"{rel}: referenced only by the unreadable line {named_by}; repair that "
                "line (do not delete the blob)")
    outside = entry.is_symlink() and not entry.resolve().is_relative_to(root)
    if outside:
        return (f"{rel}: a symlink leading outside the dataset (to {entry.resolve()}); no "
                "workload line references it and enginetap never reads through it; it is "
                "not part of the dataset (removing the link leaves its target untouched)")
    kind = file_kind(entry)
    if kind:
        subject = f"{rel}: {kind}, not a blob file, that no workload line references"
    else:
        subject = f"{rel}: orphan blob (no workload line references it)"
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        return (f"{subject}; not safe to delete yet: {damaged[0].where}{more} cannot be "
                "read and may reference it, repair that first")
    if kind:
        return f"{subject}; remove it"
    return (f"{rel}: orphan blob (no workload line references it, e.g. left by an "
            "interrupted write); delete it")
