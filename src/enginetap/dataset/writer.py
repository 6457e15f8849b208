"""Batch writes: many workloads, of one or several definitions, in one commit.

Example (from a background writer thread, the only thread writing this dataset)::

    from enginetap.dataset import Dataset, WorkloadRecord
    from enginetap.definitions import get_template

    rmsnorm = get_template("rmsnorm")
    definition = rmsnorm.example_definition()  # rmsnorm_h128
    inputs = rmsnorm.synthetic_inputs(definition, {"batch_size": 4})
    output = ...  # what the engine produced for these inputs, a (4, 128) bf16 tensor
    dataset = Dataset("captures/run1", create=True)
    lines = dataset.add_workloads([
        WorkloadRecord(definition=definition, inputs=inputs, outputs={"output": output},
                       receipt={"source": "capture:hf", "step": 3, "layer": "L0.norm"}),
        # ... more records, of this or other definitions (or by stored name)
    ])
    lines[0].workload.uuid  # each line as stored, in record order

A commit checks every record first and writes nothing if any is refused. Then it writes
each new definition, then the blobs (each to a temporary file, flushed with one
``fdatasync``, renamed into place; one ``fsync`` per blob directory after all of them),
then per definition one append of all its lines in a single write and one ``fsync``. A
crash at any point leaves every workload whole or absent: a line is appended only after
its blob is durable, so the worst leftover is an unreferenced blob (``validate`` reports
it), never a torn line or a line without its data. Per workload this costs one sync
instead of three.

Tensors are written from the caller's memory when they are contiguous CPU tensors (no
copy); others are copied to the host once. They must not change until the call returns.

One writer thread per dataset: a commit holds the dataset (by root, process-wide) while it
runs, and a commit from another thread meanwhile raises :class:`ConcurrentWriterError`.
Other *processes* may write the same dataset at the same time (e.g. one per rank): writes
never overwrite, appends are single writes, and an identical definition is a no-op.
"""

from __future__ import annotations

import datetime
import os
import threading
import uuid as uuidlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from enginetap.dataset.atomic import (
    AlreadyExists, append_lines, fsync_dirs, write_new_bytes, write_new_file, write_new_text,
)
from enginetap.dataset.blobs import blob_chunks, host_tensors, save_blob
from enginetap.dataset.checks import CheckedWorkload, check_workload
from enginetap.dataset.index import DatasetIndex, conflict
from enginetap.dataset.paths import (
    OUTPUT_KEY_PREFIX, blob_relpath, definition_relpath, safe_component, workloads_relpath,
)
from enginetap.dataset.scan import DefinitionFile, describe
from enginetap.dataset.schema import (
    Definition, EngineOutputs, EnginetapExtra, Receipt, SafetensorsInput, ScalarInput,
    Workload, WorkloadLine,
)
from enginetap.errors import DatasetError, ProblemsError

__all__ = [
    "BatchProblems", "ConcurrentWriterError", "WorkloadRecord", "commit", "store_definition",
    "write_failed", "writer_slot",
]


@dataclass(frozen=True, kw_only=True)
class WorkloadRecord:
    """One workload to store with :meth:`Dataset.add_workloads`."""

    definition: Definition | str
    """A stored definition's name, or a Definition (stored first if new; equal: no-op)."""
    inputs: Mapping[str, Any]
    """Every input by name: a tensor, or a Python scalar for shape-None inputs. The var
    axes are read from the tensors' shapes."""
    outputs: Mapping[str, Any] = field(default_factory=dict)
    """What the engine produced, for some or all of the definition's outputs."""
    receipt: Receipt | Mapping[str, Any]
    """Provenance, stored under the line's ``enginetap.receipt``. A mapping is read as a
    :class:`Receipt` (``source`` required; ``created_at`` defaults to now, UTC); keys that
    are not Receipt fields are kept as they are."""
    uuid: str | None = None
    """Defaults to a fresh uuid4 hex."""


class ConcurrentWriterError(DatasetError):
    """Two threads of one process wrote the same dataset at the same time."""


@dataclass
class _Planned:
    definition: Definition
    checked: CheckedWorkload
    line: WorkloadLine
    blob: Path | None


_SLOTS_LOCK = threading.Lock()
_SLOTS: dict[Path, threading.Thread] = {}


@contextmanager
def writer_slot(root: Path) -> Iterator[None]:
    """Hold ``root`` for the calling thread while writing (re-entrant in that thread).

    Raises:
        ConcurrentWriterError: another thread of this process is writing ``root`` now.
    """
    me = threading.current_thread()
    with _SLOTS_LOCK:
        holder = _SLOTS.get(root)
        if holder is not None and holder is not me:
            raise ConcurrentWriterError(
                f"dataset {root} is being written by thread {holder.name!r}; thread "
                f"{me.name!r} tried to write it at the same time",
                "a dataset takes one writer thread: its caches of definitions and uuids "
                "are not shared between threads",
                "send every write to one thread (e.g. a queue feeding one background "
                "writer that calls Dataset.add_workloads)")
        _SLOTS[root] = me
    try:
        yield
    finally:
        if holder is None:
            with _SLOTS_LOCK:
                del _SLOTS[root]


def store_definition(dataset: DatasetIndex, definition: Definition) -> Path:
    """Store ``definition`` unless an equal one is stored; return its file's path (see
    :meth:`Dataset.write_definition <enginetap.dataset.store.Dataset.write_definition>`).

    Raises:
        DatasetError: a different definition of that name is stored, the name or op_type
            cannot be a file name, the definitions cannot be read, another thread is
            writing this dataset, or the file system refused the write.
    """
    with writer_slot(dataset.root):
        existing = dataset.lookup(definition.name)
        if existing is None:
            rel = definition_relpath(definition.op_type, definition.name)
            try:
                write_new_text(dataset.resolve(rel), definition.model_dump_json(indent=2) + "\n")
                dataset.stored(DefinitionFile(rel, definition))
                return dataset.resolve(rel)
            except AlreadyExists:
                # Another writer stored it between our look and our write: compare.
                existing = dataset.lookup(definition.name, fresh=True)
            except OSError as exc:
                raise write_failed(dataset.root, exc) from None
        if existing is None or existing.definition != definition:
            raise conflict(definition.name, existing.rel if existing else "this dataset")
        return dataset.resolve(existing.rel)


def commit(dataset: DatasetIndex, records: Sequence[WorkloadRecord]) -> list[WorkloadLine]:
    """Check every record, then write them all; see the module docstring.

    Raises:
        DatasetError: a record is refused (nothing is written; a ProblemsError lists
            every problem of every record when there are several records), or the disk
            refused a write (the blobs of lines not appended are removed).
    """
    with writer_slot(dataset.root):
        planned, new = _plan(dataset, records)
        for definition in new:
            store_definition(dataset, definition)
        _write(dataset, planned)
        for item in planned:
            dataset.used_uuid(item.definition.name, item.line.workload.uuid)
        return [item.line for item in planned]


def _plan(dataset: DatasetIndex, records: Sequence[WorkloadRecord]
          ) -> tuple[list[_Planned], list[Definition]]:
    planned: list[_Planned] = []
    new: dict[str, Definition] = {}
    taken: set[tuple[str, str]] = set()
    dirs: dict[str, Path] = {}
    failures: list[tuple[int, DatasetError]] = []
    for index, record in enumerate(records):
        try:
            item, is_new = _plan_one(dataset, record, new, taken, dirs)
        except DatasetError as exc:
            failures.append((index, exc))
            continue
        planned.append(item)
        if is_new:
            new[item.definition.name] = item.definition
    if failures:
        _refuse(failures, len(records))
    return planned, list(new.values())


def _plan_one(dataset: DatasetIndex, record: WorkloadRecord, new: Mapping[str, Definition],
              taken: set[tuple[str, str]], dirs: dict[str, Path]) -> tuple[_Planned, bool]:
    definition, is_new = _definition(dataset, record.definition, new)
    checked = check_workload(definition, record.inputs, record.outputs)
    uuid = safe_component("uuid", record.uuid if record.uuid is not None
                          else uuidlib.uuid4().hex)
    if (definition.name, uuid) in taken:
        raise DatasetError(f"uuid {uuid!r} is given twice for {definition.name!r} in this "
                           "batch", "uuids identify workloads", "leave uuid unset")
    dataset.refuse_used_uuid(definition, uuid)
    taken.add((definition.name, uuid))
    blob_rel = blob_relpath(definition.op_type, definition.name, uuid)
    blob = None
    if checked.tensors or checked.outputs:
        # the directory resolved (symlinks followed, kept inside the root) once per commit;
        # the file name is a fresh uuid, checked below
        parent, _, file_name = blob_rel.rpartition("/")
        if parent not in dirs:
            dirs[parent] = dataset.resolve(parent)
        blob = dirs[parent] / file_name
    if blob is not None and os.path.lexists(blob):
        raise DatasetError(f"refusing to overwrite {blob_rel}", "the blob already exists",
                           "use a new uuid; delete the file if it is an orphan")
    line = _line(definition, checked, _receipt(record.receipt), uuid, blob_rel)
    return _Planned(definition, checked, line, blob), is_new


def _definition(dataset: DatasetIndex, given: Definition | str,
                new: Mapping[str, Definition]) -> tuple[Definition, bool]:
    name = given if isinstance(given, str) else given.name
    if name in new:  # new in this batch: every record must carry the same one
        if not isinstance(given, str) and given != new[name]:
            raise conflict(name, "this batch")
        return new[name], False
    return dataset.target(given)


def _receipt(given: Receipt | Mapping[str, Any]) -> Receipt:
    if isinstance(given, Receipt):
        return given
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    try:
        return Receipt.model_validate({"created_at": now, **given})
    except ValidationError as exc:
        raise DatasetError("invalid receipt", describe(exc),
                           "give a Receipt, or a mapping with at least 'source'") from None


def _refuse(failures: list[tuple[int, DatasetError]], total: int) -> None:
    if total == 1:
        raise failures[0][1]
    problems = []
    for index, exc in failures:
        found = exc.problems if isinstance(exc, ProblemsError) else [str(exc)]
        problems += [f"record {index}: {p}" for p in found]
    raise BatchProblems(f"refusing {len(failures)} of {total} workload records", problems,
                         "fix or drop the records named; nothing was written")


class BatchProblems(ProblemsError, DatasetError):
    """Every problem of every refused record of a batch (nothing of it was written)."""


def _write(dataset: DatasetIndex, planned: list[_Planned]) -> None:
    written: list[Path] = []
    try:
        for item in planned:
            if item.blob is not None:
                # uuid-named: no other writer wants this name, a checked rename will do
                tensors = _blob_tensors(item.checked)
                chunks = blob_chunks(tensors)
                if chunks is not None:
                    write_new_bytes(item.blob, chunks, sync_dir=False, race_free=False)
                else:
                    write_new_file(item.blob, partial(save_blob, tensors=tensors),
                                   sync_dir=False, race_free=False)
                written.append(item.blob)
        fsync_dirs(path.parent for path in written)
    except OSError as exc:
        _remove(written)
        raise write_failed(dataset.root, exc) from None
    groups: dict[str, list[_Planned]] = {}
    for item in planned:
        groups.setdefault(item.definition.name, []).append(item)
    for position, (name, items) in enumerate(groups.items()):
        definition = items[0].definition
        jsonl = dataset.resolve(workloads_relpath(definition.op_type, name))
        try:
            append_lines(jsonl, [item.line.model_dump_json() for item in items])
        except OSError as exc:
            # Lines of later definitions were never written: their blobs are removed. This
            # definition's append may have reached the disk in part, so its blobs stay.
            later = [i.blob for _, rest in list(groups.items())[position + 1:] for i in rest]
            _remove([b for b in later if b is not None])
            raise write_failed(dataset.root, exc) from None


def _blob_tensors(checked: CheckedWorkload) -> dict[str, Any]:
    named = dict(checked.tensors)
    named |= {OUTPUT_KEY_PREFIX + name: t for name, t in checked.outputs.items()}
    return host_tensors(named)


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            continue  # left as an orphan blob, which validate reports


def write_failed(root: Path, exc: OSError) -> DatasetError:
    """The error for a write the file system refused (full disk, read-only, not a dir...)."""
    where = f" ({exc.filename})" if exc.filename else ""
    return DatasetError(f"cannot write to dataset {root}{where}", exc.strerror or str(exc),
                        "free disk space or fix the path or its permissions, then write "
                        "again; workloads not written have no line and no blob")


def _line(definition: Definition, checked: CheckedWorkload, receipt: Receipt, uuid: str,
          blob_rel: str) -> WorkloadLine:
    inputs: dict[str, SafetensorsInput | ScalarInput] = {}
    for name in definition.inputs:
        if name in checked.scalars:
            inputs[name] = ScalarInput(value=checked.scalars[name])
        else:
            inputs[name] = SafetensorsInput(path=blob_rel, tensor_key=name)
    outputs = {name: SafetensorsInput(path=blob_rel, tensor_key=OUTPUT_KEY_PREFIX + name)
               for name in checked.outputs}
    return WorkloadLine(
        definition=definition.name,
        workload=Workload(axes=checked.axes, inputs=inputs, uuid=uuid),
        enginetap=EnginetapExtra(outputs=EngineOutputs(tensors=outputs), receipt=receipt),
    )
