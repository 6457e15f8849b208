"""What a dataset holds, as its writer and its readers look it up: the stored definitions
by name and the uuids each definition's workloads use, read from disk on demand and kept.

:class:`~enginetap.dataset.store.Dataset` is an index with reads and writes on top;
:mod:`enginetap.dataset.writer` checks a batch against the index before writing it.
"""

from __future__ import annotations

import os
from pathlib import Path

from enginetap.dataset.paths import definition_relpath, resolve_within, workloads_relpath
from enginetap.dataset.scan import DefinitionFile, read_definitions, read_lines
from enginetap.dataset.schema import Definition
from enginetap.errors import DatasetError

__all__ = ["VALIDATE_FIX", "DatasetIndex", "conflict", "raise_first"]

VALIDATE_FIX = "run `enginetap dataset validate ROOT` to list every problem"


class DatasetIndex:
    """The definitions and workload uuids stored under ``root`` (a resolved directory),
    cached; one writer thread per dataset keeps the cache right (see the writer)."""

    root: Path
    """The dataset root, resolved (absolute, symlinks followed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._known: dict[str, DefinitionFile] = {}
        self._uuids: dict[str, set[str]] = {}

    def resolve(self, relative: str) -> Path:
        """The real path of ``relative`` (a path stored in the dataset), inside the root.

        Raises:
            DatasetError: the path is absolute, has ``..`` components, or a symlink on the
                way leads outside the root.
        """
        return resolve_within(self.root, relative)

    def definitions(self) -> dict[str, Definition]:
        """Every stored definition by name, read from disk now.

        Raises:
            DatasetError: a definition file is malformed (the error names it) or two files
                hold the same name.
        """
        files, problems = read_definitions(self.root)
        raise_first(f"cannot read the definitions of {self.root}", problems)
        self._known = {f.definition.name: f for f in files}
        return {name: f.definition for name, f in self._known.items()}

    def definition(self, name: str) -> Definition:
        """The stored definition ``name``.

        Raises:
            DatasetError: no such definition (the message lists the known names), or the
                definitions cannot be read.
        """
        found = self.lookup(name)
        if found is None:
            raise DatasetError(f"unknown definition {name!r} in {self.root}",
                               f"known definitions: {sorted(self._known) or 'none'}",
                               "store it first with Dataset.write_definition")
        return found.definition

    def lookup(self, name: str, *, fresh: bool = False) -> DefinitionFile | None:
        """The stored file of definition ``name`` (None: not stored); ``fresh`` reads the
        definitions again first."""
        if fresh or name not in self._known:
            self.definitions()  # another writer may have added it since we last looked
        return self._known.get(name)

    def stored(self, definition: DefinitionFile) -> None:
        """Remember a definition file just written."""
        self._known[definition.definition.name] = definition

    def target(self, definition: Definition | str) -> tuple[Definition, bool]:
        """The definition a workload is for (by stored name, or given), and whether it is
        new to the dataset.

        Raises:
            DatasetError: an unknown name, a name that cannot be a file name, or a
                definition that differs from the stored one of its name.
        """
        if isinstance(definition, str):
            return self.definition(definition), False
        definition_relpath(definition.op_type, definition.name)  # refuse unusable names now
        existing = self.lookup(definition.name)
        if existing is None:
            return definition, True
        if existing.definition != definition:
            raise conflict(definition.name, existing.rel)
        return existing.definition, False

    def refuse_used_uuid(self, definition: Definition, uuid: str) -> None:
        """Raises: DatasetError: a stored workload of ``definition`` has ``uuid``."""
        if definition.name not in self._uuids:
            rel = workloads_relpath(definition.op_type, definition.name)
            exists = os.path.lexists(self.resolve(rel))
            records = read_lines(self.root, rel)[0] if exists else []
            self._uuids[definition.name] = {r.line.workload.uuid for r in records}
        if uuid in self._uuids[definition.name]:
            raise DatasetError(f"uuid {uuid!r} is already used by a workload of "
                               f"{definition.name!r}", "uuids identify workloads",
                               "leave uuid unset to get a fresh one")

    def used_uuid(self, name: str, uuid: str) -> None:
        """Remember that a workload of definition ``name`` was written with ``uuid`` (after
        :meth:`refuse_used_uuid` looked that definition's uuids up)."""
        self._uuids[name].add(uuid)


def conflict(name: str, where: str) -> DatasetError:
    """The error for a definition that differs from the one of that name in ``where``."""
    return DatasetError(f"definition {name!r} already exists in {where} with different content",
                        "stored definitions are never overwritten",
                        "give the new definition another name, or use another dataset root")


def raise_first(what: str, problems: list[str]) -> None:
    """Raises: DatasetError: the first of ``problems`` (counting the rest), if any."""
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise DatasetError(what, problems[0] + more, VALIDATE_FIX)
