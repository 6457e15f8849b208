"""A FlashInfer-Trace dataset on disk: definitions, workload lines and tensor blobs.

Layout under the root (flashinfer-bench's, so ``TraceSet.from_path`` loads it)::

    definitions/<op_type>/<name>.json
    workloads/<op_type>/<name>.jsonl                      one WorkloadLine per line
    blob/workloads/<op_type>/<name>/<name>_<uuid>.safetensors

A workload's tensor inputs live in its blob under their input name; the engine's captured
outputs live in the same blob under ``enginetap_output:<output name>``. Datasets are
append-only: nothing is overwritten, every write is atomic, and a workload is checked in
full before its first byte is written. A crash between a blob and its line leaves an
orphan blob, which ``validate_dataset`` reports for deletion.

Writes go through :meth:`Dataset.add_workloads` (a batch, one commit; see
:mod:`enginetap.dataset.writer`), from one thread per dataset at a time. A directory is a
dataset when it holds ``definitions/``, ``workloads/`` or ``blob/``; opening anything else
for reading is refused, so that validating a wrong path never reports success.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginetap.dataset.blobs import load_tensors
from enginetap.dataset.dtypes import name_of, torch_dtype
from enginetap.dataset.index import VALIDATE_FIX, DatasetIndex, raise_first
from enginetap.dataset.paths import workloads_relpath
from enginetap.dataset.scan import read_lines
from enginetap.dataset.schema import (
    Definition, Receipt, SafetensorsInput, ScalarInput, TensorSpec, WorkloadLine,
)
from enginetap.dataset.writer import WorkloadRecord, commit, store_definition
from enginetap.errors import DatasetError

if TYPE_CHECKING:
    import torch

__all__ = ["DATASET_DIRS", "Dataset"]

DATASET_DIRS = ("definitions", "workloads", "blob")
"""A directory holding at least one of these is a dataset root."""


class Dataset(DatasetIndex):
    """One dataset root. Reads are strict (bad data raises); writes are atomic, append-only.

    Writes come from one thread at a time per dataset (a write from a second thread while
    one runs raises :class:`~enginetap.dataset.writer.ConcurrentWriterError`); several
    processes may write one dataset at once. Definitions are read through the
    :class:`~enginetap.dataset.index.DatasetIndex` it is (``definitions()``,
    ``definition(name)``, ``resolve(relative)``).
    """

    def __init__(self, root: str | Path, *, create: bool = False) -> None:
        """Open the dataset at ``root``; with ``create``, make it (and ``definitions/``) if
        missing, which is safe when several processes do it at once.

        Raises:
            DatasetError: ``root`` is empty, does not exist (and not ``create``), is not a
                directory, cannot be created, or (without ``create``) is a directory that
                holds none of ``definitions/``, ``workloads/``, ``blob/``.
        """
        if str(root) == "":
            raise DatasetError("no dataset path given", "the path is empty",
                               "give the dataset root directory")
        path = Path(root).expanduser()
        if create:
            _create(path)
        if not path.is_dir():
            why = "it is not a directory" if path.exists() else "the directory does not exist"
            raise DatasetError(f"no dataset at {path}", why,
                               "give the root directory of an existing dataset")
        if not create and not any((path / d).is_dir() for d in DATASET_DIRS):
            raise _not_a_dataset(path)
        super().__init__(path.resolve())

    def __repr__(self) -> str:
        return f"Dataset({str(self.root)!r})"

    # ----------------------------------------------------------------- definitions

    def write_definition(self, definition: Definition) -> Path:
        """Store ``definition`` at ``definitions/<op_type>/<name>.json``; return its path.

        Storing a definition equal to the stored one of that name does nothing, also when
        another process stores it at the same moment.

        Raises:
            DatasetError: a different definition of that name exists (never overwritten),
                the name or op_type cannot be a file name, the dataset's definitions
                cannot be read, another thread is writing this dataset, or the file
                system refused the write.
        """
        return store_definition(self, definition)

    # ------------------------------------------------------------------- workloads

    def add_workload(self, definition: Definition | str, inputs: Mapping[str, Any], *,
                     outputs: Mapping[str, torch.Tensor] | None = None,
                     receipt: Receipt | Mapping[str, Any], uuid: str | None = None
                     ) -> WorkloadLine:
        """Check and store one workload; return its line (a batch of one, see
        :meth:`add_workloads` for the arguments and guarantees).

        Raises:
            DatasetError: the workload does not fit the definition (a ProblemsError
                listing every problem), the definition conflicts with the stored one or is
                unknown, or the uuid is already used. Nothing is written in these cases.
        """
        record = WorkloadRecord(definition=definition, inputs=inputs, outputs=outputs or {},
                                receipt=receipt, uuid=uuid)
        return self.add_workloads([record])[0]

    def add_workloads(self, records: Sequence[WorkloadRecord]) -> list[WorkloadLine]:
        """Check and store many workloads (of any definitions) in one commit; return their
        lines, in order.

        Every record is checked before anything is written; new definitions are stored
        first (an equal stored one is a no-op). Then blobs, each synced once, then one
        append and one fsync per definition's JSONL file. Contiguous CPU tensors are
        written from their own memory (no copy): they must not change until this returns.
        Call it from one thread per dataset. Details: :mod:`enginetap.dataset.writer`.

        Raises:
            DatasetError: a record is refused (nothing is written; with several records a
                ProblemsError names each refused record and every problem), another thread
                is writing this dataset (:class:`~enginetap.dataset.writer.ConcurrentWriterError`),
                or the disk refused a write.
        """
        return commit(self, records)

    def workloads(self, name: str) -> list[WorkloadLine]:
        """Every workload line of definition ``name``, in file order.

        Raises:
            DatasetError: unknown definition, or a malformed line (named ``file:line``) or a
                line naming another definition.
        """
        definition = self.definition(name)
        rel = workloads_relpath(definition.op_type, name)
        if not os.path.lexists(self.resolve(rel)):
            return []
        records, problems = read_lines(self.root, rel)
        problems += [f"{r.where}: line is for definition {r.line.definition!r}, not {name!r}"
                     for r in records if r.line.definition != name]
        raise_first(f"cannot read the workloads of {name!r}", problems)
        return [r.line for r in records]

    # --------------------------------------------------------------------- tensors

    def load_inputs(self, line: WorkloadLine, device: str = "cpu") -> dict[str, Any]:
        """The workload's inputs in definition order: tensors on ``device``, scalars as values.

        Raises:
            DatasetError: an input is missing, random (not stored), of the wrong kind, or
                its blob is missing, unreadable or disagrees with the definition.
        """
        definition = self.definition(line.definition)
        refs: dict[str, SafetensorsInput] = {}
        values: dict[str, Any] = {}
        for name, spec in definition.inputs.items():
            stored = line.workload.inputs.get(name)
            if spec.shape is None and isinstance(stored, ScalarInput):
                values[name] = stored.value
            elif spec.shape is not None and isinstance(stored, SafetensorsInput):
                refs[name] = stored
            else:
                raise _unloadable(line, name, spec, stored)
        values.update(self._read_tensors(line, definition, definition.inputs, refs, device))
        return {name: values[name] for name in definition.inputs}

    def load_outputs(self, line: WorkloadLine, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The engine's stored outputs in definition order; ``{}`` when none were stored.

        Raises:
            DatasetError: an output name is not in the definition, or its blob is missing,
                unreadable or disagrees with the definition.
        """
        refs = dict(line.enginetap.outputs.tensors) if line.enginetap else {}
        if not refs:
            return {}
        definition = self.definition(line.definition)
        unknown = sorted(set(refs) - set(definition.outputs))
        if unknown:
            raise DatasetError(f"workload {line.workload.uuid} stores unknown outputs {unknown}",
                               f"the outputs of {definition.name!r} are "
                               f"{list(definition.outputs)}", VALIDATE_FIX)
        tensors = self._read_tensors(line, definition, definition.outputs, refs, device)
        return {name: tensors[name] for name in definition.outputs if name in tensors}

    def _read_tensors(self, line: WorkloadLine, definition: Definition,
                      specs: Mapping[str, TensorSpec], refs: Mapping[str, SafetensorsInput],
                      device: str) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError

        out: dict[str, torch.Tensor] = {}
        for rel in dict.fromkeys(ref.path for ref in refs.values()):
            names = [name for name, ref in refs.items() if ref.path == rel]
            try:
                loaded = load_tensors(self.resolve(rel), [refs[n].tensor_key for n in names])
                out |= {name: loaded[refs[name].tensor_key] for name in names}
            except (OSError, SafetensorError) as exc:
                raise DatasetError(f"cannot load {rel} for workload {line.workload.uuid}",
                                   str(exc), VALIDATE_FIX) from None
        for name, tensor in out.items():
            _check_loaded(line, definition, name, specs[name], tensor)
        return {name: tensor.to(device) for name, tensor in out.items()}


def _check_loaded(line: WorkloadLine, definition: Definition, name: str, spec: TensorSpec,
                  tensor: torch.Tensor) -> None:
    try:
        expected = definition.shape_of(spec, line.workload.axes) or ()
    except KeyError as exc:
        raise DatasetError(f"workload {line.workload.uuid} lacks var axis {exc}",
                           f"{name!r} has axes {spec.shape}", VALIDATE_FIX) from None
    if tuple(tensor.shape) != expected or tensor.dtype != torch_dtype(spec.dtype):
        raise DatasetError(
            f"stored {name!r} of workload {line.workload.uuid} does not fit {definition.name!r}",
            f"expected shape {list(expected)} {spec.dtype}, found {list(tensor.shape)} "
            f"{name_of(tensor.dtype)}", VALIDATE_FIX)


def _unloadable(line: WorkloadLine, name: str, spec: TensorSpec, stored: Any) -> DatasetError:
    kind = "missing" if stored is None else f"stored as {stored.type!r}"
    wanted = "a scalar" if spec.shape is None else "a safetensors tensor"
    return DatasetError(f"cannot load input {name!r} of workload {line.workload.uuid}",
                        f"it is {kind}, but the definition needs {wanted}",
                        "enginetap replays stored inputs only: capture the workload again")


def _create(path: Path) -> None:
    try:
        (path / "definitions").mkdir(parents=True, exist_ok=True)  # parallel-safe
    except FileExistsError:
        return  # a file where a directory belongs: reported by the caller's checks
    except OSError as exc:
        raise DatasetError(f"cannot create a dataset at {path}", exc.strerror or str(exc),
                           "choose a writable directory that is not under a file") from None


def _not_a_dataset(path: Path) -> DatasetError:
    parent = path.parent
    if path.name in DATASET_DIRS and any((parent / d).is_dir() for d in DATASET_DIRS):
        fix = f"give the dataset root {parent}, not its {path.name}/ directory"
    else:
        fix = "give the root directory of a dataset (the one holding definitions/)"
    return DatasetError(f"{path} is not a dataset",
                        f"it holds none of {', '.join(d + '/' for d in DATASET_DIRS)}", fix)
