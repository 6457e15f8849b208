"""Atomic, append-only writes, and what a crash can leave behind."""

from __future__ import annotations

import pytest

from enginetap.dataset import validate_dataset
from enginetap.dataset.atomic import append_line, write_new_file, write_new_text
from enginetap.dataset.scan import read_lines
from enginetap.errors import DatasetError
from tests.dataset.dataset_helpers import copy_definition, files_under

JSONL = "workloads/tiny_copy/tiny_copy_float32_h4.jsonl"


def test_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "sub" / "blob.bin"

    def fill(tmp):
        tmp.write_bytes(b"half written")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_new_file(target, fill)
    assert files_under(tmp_path) == []


def test_existing_files_are_never_replaced(tmp_path):
    target = tmp_path / "a.json"
    write_new_text(target, "first\n")
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        write_new_text(target, "second\n")
    assert target.read_text() == "first\n"
    assert files_under(tmp_path) == ["a.json"]


def test_append_closes_a_torn_last_line(tmp_path):
    path = tmp_path / "w.jsonl"
    append_line(path, '{"a": 1}')
    with open(path, "a") as f:
        f.write('{"b": ')  # a crash in the middle of an append
    append_line(path, '{"c": 3}')
    assert path.read_text() == '{"a": 1}\n{"b": \n{"c": 3}\n'
    with pytest.raises(ValueError, match="newline"):
        append_line(path, '{"d":\n4}')


def test_after_a_torn_line_later_workloads_stay_readable(dataset, receipt, copy_inputs):
    definition = copy_definition()
    first = dataset.add_workload(definition, copy_inputs(), receipt=receipt)
    with open(dataset.root / JSONL, "a") as f:
        f.write(first.model_dump_json()[:40])
    second = dataset.add_workload(definition, copy_inputs(batch=6), receipt=receipt)

    records, problems = read_lines(dataset.root, JSONL)
    assert [r.line for r in records] == [first, second]
    assert [p.split(": ")[0] for p in problems] == [f"{JSONL}:2"]
    assert validate_dataset(dataset.root) == problems
    with pytest.raises(DatasetError, match=f"{JSONL}:2: malformed JSON"):
        dataset.workloads(definition.name)


def test_malformed_definition_files_are_named(dataset):
    broken = dataset.root / "definitions/tiny_copy/broken.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{ not json")
    with pytest.raises(DatasetError, match="definitions/tiny_copy/broken.json: malformed JSON"):
        dataset.definitions()
    broken.write_text('{"name": "x"}')
    with pytest.raises(DatasetError, match="broken.json: does not match the schema: op_type"):
        dataset.definition("x")


def test_new_bytes_resume_after_short_writes(tmp_path, monkeypatch):
    """writev may write less than asked (a signal, the 2 GiB per-call limit): the rest is
    written from where it stopped, across and inside buffers."""
    import os

    from enginetap.dataset import atomic

    real = os.writev
    calls = []

    def short(fd, buffers):
        calls.append(len(buffers))
        first = bytes(buffers[0])[:3]  # at most 3 bytes per call
        return real(fd, [first])

    monkeypatch.setattr(atomic.os, "writev", short)
    chunks = [b"header--", memoryview(bytearray(b"0123456789")), b"", b"tail"]
    target = tmp_path / "d" / "blob.bin"
    atomic.write_new_bytes(target, chunks)
    assert target.read_bytes() == b"header--0123456789tail"
    assert len(calls) == 9  # 3 + 4 + 2: at most 3 bytes, and only from the first buffer
    assert files_under(tmp_path) == ["d/blob.bin"]
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        atomic.write_new_bytes(target, [b"other"])
    assert target.read_bytes() == b"header--0123456789tail"


def test_new_bytes_failure_leaves_nothing(tmp_path, monkeypatch):
    from enginetap.dataset import atomic

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "writev", full)
    with pytest.raises(OSError, match="No space"):
        atomic.write_new_bytes(tmp_path / "blob.bin", [b"data"])
    assert files_under(tmp_path) == []
