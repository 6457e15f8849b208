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
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginetap.dataset.atomic import append_line, write_new_file, write_new_text
from enginetap.dataset.checks import CheckedWorkload, check_workload
from enginetap.dataset.dtypes import name_of, torch_dtype
from enginetap.dataset.paths import (
    OUTPUT_KEY_PREFIX, blob_relpath, definition_relpath, resolve_within, safe_component,
    workloads_relpath,
)
from enginetap.dataset.scan import DefinitionFile, read_definitions, read_lines
from enginetap.dataset.schema import (
    Definition, EngineOutputs, EnginetapExtra, Receipt, SafetensorsInput, ScalarInput,
    TensorSpec, Workload, WorkloadLine,
)
from enginetap.errors import DatasetError

if TYPE_CHECKING:
    import torch

__all__ = ["Dataset"]

_VALIDATE_FIX = "run `enginetap dataset validate ROOT` to list every problem"


class Dataset:
    """One dataset root. Reads are strict (bad data raises); writes are atomic, append-only."""

    root: Path
    """The dataset root, resolved (absolute, symlinks followed)."""

    def __init__(self, root: str | Path, *, create: bool = False) -> None:
        """Open the dataset at ``root``; with ``create``, make the directory if missing.

        Raises:
            DatasetError: ``root`` does not exist (and not ``create``) or is not a directory.
        """
        path = Path(root).expanduser()
        if not path.exists() and create:
            path.mkdir(parents=True)
        if not path.is_dir():
            why = "it is not a directory" if path.exists() else "the directory does not exist"
            raise DatasetError(f"no dataset at {path}", why,
                               "give the path of an existing dataset root (the directory "
                               "that holds definitions/ and workloads/)")
        self.root = path.resolve()
        self._known: dict[str, DefinitionFile] = {}
        self._uuids: dict[str, set[str]] = {}

    def __repr__(self) -> str:
        return f"Dataset({str(self.root)!r})"

    def resolve(self, relative: str) -> Path:
        """The real path of ``relative`` (a path stored in the dataset), inside the root.

        Raises:
            DatasetError: the path is absolute, has ``..`` components, or a symlink on the
                way leads outside the root.
        """
        return resolve_within(self.root, relative)

    # ----------------------------------------------------------------- definitions

    def write_definition(self, definition: Definition) -> Path:
        """Store ``definition`` at ``definitions/<op_type>/<name>.json``; return its path.

        Storing a definition equal to the stored one of that name does nothing.

        Raises:
            DatasetError: a different definition of that name exists (never overwritten),
                the name or op_type cannot be a file name, or the dataset's definitions
                cannot be read.
        """
        existing = self._lookup(definition.name)
        if existing is not None:
            if existing.definition != definition:
                raise _conflict(definition.name, existing.rel)
            return self.resolve(existing.rel)
        rel = definition_relpath(definition.op_type, definition.name)
        path = self.resolve(rel)
        write_new_text(path, definition.model_dump_json(indent=2) + "\n")
        self._known[definition.name] = DefinitionFile(rel, definition)
        return path

    def definitions(self) -> dict[str, Definition]:
        """Every stored definition by name, read from disk now.

        Raises:
            DatasetError: a definition file is malformed (the error names it) or two files
                hold the same name.
        """
        files, problems = read_definitions(self.root)
        _raise_first(f"cannot read the definitions of {self.root}", problems)
        self._known = {f.definition.name: f for f in files}
        return {name: f.definition for name, f in self._known.items()}

    def definition(self, name: str) -> Definition:
        """The stored definition ``name``.

        Raises:
            DatasetError: no such definition (the message lists the known names), or the
                definitions cannot be read.
        """
        found = self._lookup(name)
        if found is None:
            raise DatasetError(f"unknown definition {name!r} in {self.root}",
                               f"known definitions: {sorted(self._known) or 'none'}",
                               "store it first with Dataset.write_definition")
        return found.definition

    def _lookup(self, name: str) -> DefinitionFile | None:
        if name not in self._known:
            self.definitions()  # another writer may have added it since we last looked
        return self._known.get(name)

    # ------------------------------------------------------------------- workloads

    def add_workload(self, definition: Definition | str, inputs: Mapping[str, Any], *,
                     outputs: Mapping[str, torch.Tensor] | None = None, receipt: Receipt,
                     uuid: str | None = None) -> WorkloadLine:
        """Check and store one workload; return its line.

        ``definition`` is a stored definition's name, or a Definition (stored first if new).
        ``inputs`` maps every input name to a tensor, or to a Python scalar for shape-None
        inputs; ``outputs`` optionally maps some of the definition's outputs to what the
        engine produced. Tensors are copied to contiguous CPU tensors and saved in one
        safetensors blob. ``uuid`` defaults to a fresh uuid4 hex.

        Raises:
            DatasetError: the workload does not fit the definition (a ProblemsError
                listing every problem), the definition conflicts with the stored one or is
                unknown, or the uuid is already used. Nothing is written in these cases.
        """
        definition, is_new = self._target(definition)
        checked = check_workload(definition, inputs, outputs)
        uuid = safe_component("uuid", uuid if uuid is not None else uuidlib.uuid4().hex)
        self._refuse_used_uuid(definition, uuid)
        blob_rel = blob_relpath(definition.op_type, definition.name, uuid)
        blob = self.resolve(blob_rel) if checked.tensors or checked.outputs else None
        if blob is not None and (blob.exists() or blob.is_symlink()):
            raise DatasetError(f"refusing to overwrite {blob_rel}", "the blob already exists",
                               "use a new uuid; delete the file if it is an orphan")
        line = _line(definition, checked, receipt, uuid, blob_rel)
        jsonl = self.resolve(workloads_relpath(definition.op_type, definition.name))
        text = line.model_dump_json()
        if is_new:
            self.write_definition(definition)
        if blob is not None:
            write_new_file(blob, partial(_save_blob, checked))
        append_line(jsonl, text)
        self._uuids[definition.name].add(uuid)
        return line

    def _target(self, definition: Definition | str) -> tuple[Definition, bool]:
        if isinstance(definition, str):
            return self.definition(definition), False
        definition_relpath(definition.op_type, definition.name)  # refuse unusable names now
        existing = self._lookup(definition.name)
        if existing is None:
            return definition, True
        if existing.definition != definition:
            raise _conflict(definition.name, existing.rel)
        return existing.definition, False

    def _refuse_used_uuid(self, definition: Definition, uuid: str) -> None:
        if definition.name not in self._uuids:
            rel = workloads_relpath(definition.op_type, definition.name)
            records = read_lines(self.root, rel)[0] if self.resolve(rel).exists() else []
            self._uuids[definition.name] = {r.line.workload.uuid for r in records}
        if uuid in self._uuids[definition.name]:
            raise DatasetError(f"uuid {uuid!r} is already used by a workload of "
                               f"{definition.name!r}", "uuids identify workloads",
                               "leave uuid unset to get a fresh one")

    def workloads(self, name: str) -> list[WorkloadLine]:
        """Every workload line of definition ``name``, in file order.

        Raises:
            DatasetError: unknown definition, or a malformed line (named ``file:line``) or a
                line naming another definition.
        """
        definition = self.definition(name)
        rel = workloads_relpath(definition.op_type, name)
        if not self.resolve(rel).exists():
            return []
        records, problems = read_lines(self.root, rel)
        problems += [f"{r.where}: line is for definition {r.line.definition!r}, not {name!r}"
                     for r in records if r.line.definition != name]
        _raise_first(f"cannot read the workloads of {name!r}", problems)
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
                               f"{list(definition.outputs)}", _VALIDATE_FIX)
        tensors = self._read_tensors(line, definition, definition.outputs, refs, device)
        return {name: tensors[name] for name in definition.outputs if name in tensors}

    def _read_tensors(self, line: WorkloadLine, definition: Definition,
                      specs: Mapping[str, TensorSpec], refs: Mapping[str, SafetensorsInput],
                      device: str) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        out: dict[str, torch.Tensor] = {}
        for rel in dict.fromkeys(ref.path for ref in refs.values()):
            names = [name for name, ref in refs.items() if ref.path == rel]
            try:
                with safe_open(str(self.resolve(rel)), framework="pt", device="cpu") as f:
                    for name in names:
                        out[name] = f.get_tensor(refs[name].tensor_key)
            except (OSError, SafetensorError) as exc:
                raise DatasetError(f"cannot load {rel} for workload {line.workload.uuid}",
                                   str(exc), _VALIDATE_FIX) from None
        for name, tensor in out.items():
            _check_loaded(line, definition, name, specs[name], tensor)
        return {name: tensor.to(device) for name, tensor in out.items()}


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


def _save_blob(checked: CheckedWorkload, path: Path) -> None:
    import safetensors.torch
    import torch

    # Own contiguous CPU copies: the caller's tensors may live on a device, be views of
    # one buffer (safetensors refuses shared storage) or change after we return.
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)

    tensors = {name: copy(t) for name, t in checked.tensors.items()}
    tensors |= {OUTPUT_KEY_PREFIX + name: copy(t) for name, t in checked.outputs.items()}
    safetensors.torch.save_file(tensors, str(path))


def _check_loaded(line: WorkloadLine, definition: Definition, name: str, spec: TensorSpec,
                  tensor: torch.Tensor) -> None:
    try:
        expected = definition.shape_of(spec, line.workload.axes) or ()
    except KeyError as exc:
        raise DatasetError(f"workload {line.workload.uuid} lacks var axis {exc}",
                           f"{name!r} has axes {spec.shape}", _VALIDATE_FIX) from None
    if tuple(tensor.shape) != expected or tensor.dtype != torch_dtype(spec.dtype):
        raise DatasetError(
            f"stored {name!r} of workload {line.workload.uuid} does not fit {definition.name!r}",
            f"expected shape {list(expected)} {spec.dtype}, found {list(tensor.shape)} "
            f"{name_of(tensor.dtype)}", _VALIDATE_FIX)


def _unloadable(line: WorkloadLine, name: str, spec: TensorSpec, stored: Any) -> DatasetError:
    kind = "missing" if stored is None else f"stored as {stored.type!r}"
    wanted = "a scalar" if spec.shape is None else "a safetensors tensor"
    return DatasetError(f"cannot load input {name!r} of workload {line.workload.uuid}",
                        f"it is {kind}, but the definition needs {wanted}",
                        "enginetap replays stored inputs only: capture the workload again")


def _conflict(name: str, rel: str) -> DatasetError:
    return DatasetError(f"definition {name!r} already exists in {rel} with different content",
                        "stored definitions are never overwritten",
                        "give the new definition another name, or use another dataset root")


def _raise_first(what: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise DatasetError(what, problems[0] + more, _VALIDATE_FIX)
