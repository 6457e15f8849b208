"""Per-definition counts of a dataset, for ``enginetap dataset show``.

Summaries read leniently: a malformed file or line is left out of the counts (validation
is where it gets reported), so one bad line does not hide the rest of the dataset.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from enginetap.dataset.paths import resolve_within
from enginetap.dataset.scan import read_definitions, scan_workloads
from enginetap.dataset.schema import WorkloadLine
from enginetap.dataset.store import Dataset
from enginetap.errors import DatasetError

__all__ = ["DefinitionSummary", "summarize_dataset"]


@dataclass(frozen=True)
class DefinitionSummary:
    """What a dataset holds for one definition."""

    name: str
    op_type: str
    workloads: int
    """Workload lines that parse and name this definition."""
    bytes: int
    """Size on disk of its definition file, JSONL file and blob directory."""
    variants: int
    """Distinct tuples of var-axis values among its workloads."""
    with_outputs: int
    """Workloads that store the engine's outputs."""


def summarize_dataset(root: str | Path) -> list[DefinitionSummary]:
    """One summary per readable definition, sorted by op_type then name.

    Raises:
        DatasetError: ``root`` is not a dataset (empty, missing, or a directory holding
            none of ``definitions/``, ``workloads/``, ``blob/``).
    """
    base = Dataset(root).root
    files, _ = read_definitions(base)
    records, _ = scan_workloads(base)
    lines: dict[str, list[WorkloadLine]] = defaultdict(list)
    for record in records:
        lines[record.line.definition].append(record.line)
    out = []
    for found in files:
        d, mine = found.definition, lines.get(found.definition.name, [])
        out.append(DefinitionSummary(
            name=d.name, op_type=d.op_type, workloads=len(mine),
            bytes=_size(base, [found.rel, f"workloads/{d.op_type}/{d.name}.jsonl",
                               f"blob/workloads/{d.op_type}/{d.name}"]),
            variants=len({tuple(w.workload.axes.get(a) for a in d.var_axes) for w in mine}),
            with_outputs=sum(1 for w in mine if w.enginetap and w.enginetap.outputs.tensors),
        ))
    return sorted(out, key=lambda s: (s.op_type, s.name))


def _size(root: Path, rels: list[str]) -> int:
    total = 0
    for rel in rels:
        try:
            path = resolve_within(root, rel)
        except DatasetError:
            continue  # a name that cannot be a safe path owns nothing countable here
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return total
