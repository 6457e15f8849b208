"""Damaged workload lines: one bad byte, a BOM or a schema error costs that line only, and
no blob a damaged line (or file) may need is ever called an orphan to delete."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from enginetap.dataset import Dataset, summarize_dataset, validate_dataset
from enginetap.dataset.scan import read_lines
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import copy_definition

JSONL = "workloads/tiny_copy/tiny_copy_float32_h4.jsonl"
RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")


def _build(tmp_path: Path) -> tuple[Dataset, list]:
    dataset = Dataset(tmp_path / "ds", create=True)
    lines = [dataset.add_workload(copy_definition(), {"x": torch.ones(rows, 4), "n": 1,
                                                      "alpha": 0.5, "flag": True},
                                  receipt=RECEIPT) for rows in (1, 2, 3)]
    return dataset, lines


def _bad_byte(data: list[bytes]) -> None:
    data[1] = data[1].replace(b'"manual"', b'"man\xffal"')


def _bom(data: list[bytes]) -> None:
    data[0] = b"\xef\xbb\xbf" + data[0]


def _schema_error(data: list[bytes]) -> None:
    data[2] = data[2].replace(b'"axes":{"batch":3}', b'"axes":{"batch":"three"}')


CASES: dict[str, tuple[Callable[[list[bytes]], None], int, str]] = {
    "invalid UTF-8": (_bad_byte, 2, "not valid UTF-8 (byte 0xff at column"),
    "byte-order mark": (_bom, 1, "starts with a UTF-8 byte-order mark"),
    "schema error": (_schema_error, 3, "does not match the schema: workload.axes.batch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_damaged_line_costs_only_that_line(tmp_path, case):
    damage, bad, message = CASES[case]
    dataset, lines = _build(tmp_path)
    path = dataset.root / JSONL
    data = path.read_bytes().split(b"\n")
    damage(data)
    path.write_bytes(b"\n".join(data))

    records, problems = read_lines(dataset.root, JSONL)
    good = [line for index, line in enumerate(lines, start=1) if index != bad]
    assert [r.line for r in records] == good  # the rest is still read
    assert len(problems) == 1 and problems[0].startswith(f"{JSONL}:{bad}: {message}")

    report = validate_dataset(dataset.root)
    blob = lines[bad - 1].workload.inputs["x"].path
    assert report == [problems[0], f"{blob}: referenced only by the unreadable line "
                      f"{JSONL}:{bad}; repair that line (do not delete the blob)"]
    assert not any("delete it" in p for p in report)
    assert summarize_dataset(dataset.root)[0].workloads == 2


def test_a_line_without_readable_paths_protects_every_unreferenced_blob(tmp_path):
    dataset, lines = _build(tmp_path)
    path = dataset.root / JSONL
    data = path.read_bytes().split(b"\n")
    data[0] = data[0][:30]  # torn before any path: which blob it needed is unknown
    path.write_bytes(b"\n".join(data))
    stray = dataset.root / "blob/workloads/tiny_copy/stray.safetensors"
    stray.write_bytes(b"left over")

    report = validate_dataset(dataset.root)
    orphans = [p for p in report if p.startswith("blob/")]
    assert sorted(p.split(":")[0] for p in orphans) == sorted(
        [lines[0].workload.inputs["x"].path, "blob/workloads/tiny_copy/stray.safetensors"])
    for line in orphans:
        assert "not safe to delete yet" in line and f"{JSONL}:1 cannot be read" in line
        assert "delete it" not in line


def test_without_damage_a_leftover_blob_is_still_an_orphan_to_delete(tmp_path):
    dataset, _ = _build(tmp_path)
    stray = dataset.root / "blob/workloads/tiny_copy/tiny_copy_float32_h4/x.safetensors"
    stray.write_bytes(b"left by an interrupted write")
    assert validate_dataset(dataset.root) == [
        "blob/workloads/tiny_copy/tiny_copy_float32_h4/x.safetensors: orphan blob (no "
        "workload line references it, e.g. left by an interrupted write); delete it"]
