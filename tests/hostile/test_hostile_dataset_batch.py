"""The batch write path (Dataset.add_workloads): one commit for many workloads of several
definitions, few syncs, no extra tensor copies, one writer thread per dataset."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from enginetap.dataset import ConcurrentWriterError, Dataset, WorkloadRecord, validate_dataset
from enginetap.dataset.blobs import host_tensors
from enginetap.dataset.schema import Receipt
from enginetap.errors import DatasetError, ProblemsError
from tests.dataset.dataset_helpers import copy_definition, files_under, same_bits

RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")


@pytest.fixture
def dataset(tmp_path) -> Dataset:
    return Dataset(tmp_path / "ds", create=True)


@pytest.fixture
def copy_inputs():
    return lambda rows=2: {"x": torch.randn(rows, 4), "n": 1, "alpha": 0.5, "flag": True}


def _record(definition, rows: int, **extra: Any) -> WorkloadRecord:
    dtype = getattr(torch, definition.inputs["x"].dtype)
    x = (torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) / 8).to(dtype)
    return WorkloadRecord(definition=definition, inputs={"x": x, "n": rows, "alpha": 0.5,
                                                         "flag": True},
                          outputs={"y": x * 2}, receipt=extra.pop("receipt", RECEIPT), **extra)


@pytest.fixture
def syncs(monkeypatch) -> dict[str, int]:
    """Counts of fsync and fdatasync calls (passed through to the real ones)."""
    counts = {"fsync": 0, "fdatasync": 0}
    for name in counts:
        real = getattr(os, name)

        def counted(fd: int, _real=real, _name=name) -> None:
            counts[_name] += 1
            _real(fd)
        monkeypatch.setattr(os, name, counted)
    return counts


def test_one_commit_for_several_definitions(dataset, syncs):
    f32, bf16 = copy_definition(), copy_definition("bfloat16")
    dataset.write_definition(f32)
    dataset.write_definition(bf16)
    records = [_record(f32, 1), _record(bf16, 2), _record(f32, 3), _record(bf16, 4),
               _record(f32, 5), _record(bf16, 6)]
    dataset.add_workloads([_record(f32, 1), _record(bf16, 1)])  # both JSONL files exist now
    syncs.update(fsync=0, fdatasync=0)

    lines = dataset.add_workloads(records)

    # Six blobs synced once each; one fsync per blob directory and per JSONL file.
    assert syncs == {"fdatasync": 6, "fsync": 2 + 2}
    assert [line.workload.axes["batch"] for line in lines] == [1, 2, 3, 4, 5, 6]
    for name, expected in ((f32.name, [1, 1, 3, 5]), (bf16.name, [1, 2, 4, 6])):
        assert [w.workload.axes["batch"] for w in dataset.workloads(name)] == expected
    for record, line in zip(records, lines):
        assert same_bits(dataset.load_inputs(line)["x"], record.inputs["x"])
        assert same_bits(dataset.load_outputs(line)["y"], record.outputs["y"])
    assert validate_dataset(dataset.root) == []


def test_a_single_add_workload_costs_three_syncs_at_most(dataset, syncs, copy_inputs):
    dataset.add_workload(copy_definition(), copy_inputs(), receipt=RECEIPT)
    syncs.update(fsync=0, fdatasync=0)
    dataset.add_workload(copy_definition(), copy_inputs(), receipt=RECEIPT)
    assert syncs == {"fdatasync": 1, "fsync": 2}


def test_new_and_identical_definitions_are_stored_once(dataset):
    f32 = copy_definition()
    again = copy_definition()  # equal, another object
    by_name = WorkloadRecord(definition=f32.name, inputs=_record(f32, 3).inputs,
                             receipt=RECEIPT)  # names it: new in this very batch
    lines = dataset.add_workloads([_record(f32, 1), _record(again, 2), by_name])
    assert [line.workload.axes["batch"] for line in lines] == [1, 2, 3]
    dataset.write_definition(copy_definition())  # identical: a no-op
    assert [f for f in files_under(dataset.root) if f.startswith("definitions/")] == [
        "definitions/tiny_copy/tiny_copy_float32_h4.json"]
    changed = f32.model_copy(update={"description": "edited"})
    with pytest.raises(DatasetError, match="different content"):
        dataset.add_workloads([_record(changed, 1)])


def test_a_refused_record_refuses_the_whole_batch(dataset):
    f32 = copy_definition()
    good, bad = _record(f32, 2), _record(f32, 2)
    bad = WorkloadRecord(definition=f32, inputs={**bad.inputs, "x": bad.inputs["x"].half()},
                         receipt=RECEIPT)
    unknown = WorkloadRecord(definition="nope", inputs={}, receipt=RECEIPT)
    with pytest.raises(ProblemsError) as info:
        dataset.add_workloads([good, bad, unknown, _record(f32, 1, uuid="u1"),
                               _record(f32, 1, uuid="u1")])
    text = "\n".join(info.value.problems)
    assert "record 1: input 'x': expected dtype float32, got float16" in text
    assert "record 2: unknown definition 'nope'" in text
    assert "record 4: uuid 'u1' is given twice" in text
    assert "refusing 3 of 5 workload records" in str(info.value)
    assert files_under(dataset.root) == []


def test_a_receipt_may_be_a_mapping_with_extra_provenance(dataset):
    record = _record(copy_definition(), 2, receipt={
        "source": "capture:hf", "step": 7, "layer": "L0.norm", "rank": 1,
        "request_keys": ["a", "b"]})
    (line,) = dataset.add_workloads([record])
    stored = dataset.workloads(line.definition)[0].enginetap.receipt
    assert stored.source == "capture:hf" and stored.step == 7 and stored.rank == 1
    assert stored.model_extra == {"request_keys": ["a", "b"]}
    assert stored.created_at.endswith("+00:00")
    with pytest.raises(DatasetError, match="invalid receipt.*source"):
        dataset.add_workloads([_record(copy_definition(), 2, receipt={"step": 1})])


def test_host_tensors_are_written_from_their_own_memory():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    ready = torch.ones(3, 4)
    named = {"ready": ready, "strided": base[:, ::2], "view": base[1],
             "again": base[2], "same": ready}
    host = host_tensors(named)
    assert host["ready"].data_ptr() == ready.data_ptr()  # no copy
    assert host["view"].data_ptr() == base[1].data_ptr()  # contiguous view: no copy
    assert host["strided"].is_contiguous() and host["strided"].data_ptr() != base.data_ptr()
    # Memory already used by an earlier tensor is copied: safetensors refuses sharing.
    assert host["again"].data_ptr() != base[2].data_ptr()
    assert host["same"].data_ptr() != ready.data_ptr()
    for name, tensor in named.items():
        assert torch.equal(host[name], tensor)


def test_outputs_may_alias_inputs(dataset):
    x = torch.ones(2, 4)
    (line,) = dataset.add_workloads([WorkloadRecord(
        definition=copy_definition(), inputs={"x": x, "n": 1, "alpha": 0.5, "flag": True},
        outputs={"y": x}, receipt=RECEIPT)])
    assert torch.equal(dataset.load_outputs(line)["y"], x)


class _Held(Mapping):
    """Inputs that keep the writer inside its checks until the test lets it go."""

    def __init__(self, data: dict, entered: threading.Event, release: threading.Event):
        self.data, self.entered, self.release = data, entered, release

    def __getitem__(self, key: str) -> Any:
        self.entered.set()
        assert self.release.wait(30)
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_a_second_writer_thread_is_refused_while_the_first_writes(dataset, copy_inputs):
    entered, release = threading.Event(), threading.Event()
    done: list = []
    held = _Held(copy_inputs(), entered, release)
    writer = threading.Thread(name="background-writer", target=lambda: done.append(
        dataset.add_workload(copy_definition(), held, receipt=RECEIPT)))
    writer.start()
    try:
        assert entered.wait(30)
        with pytest.raises(ConcurrentWriterError, match="one writer thread") as info:
            dataset.add_workload(copy_definition(), copy_inputs(), receipt=RECEIPT)
        assert "'background-writer'" in str(info.value)
        with pytest.raises(ConcurrentWriterError):  # another handle on the same root too
            Dataset(dataset.root).write_definition(copy_definition("int8"))
    finally:
        release.set()
        writer.join(30)
    assert len(done) == 1
    # Handing the dataset over, one thread after the other, is fine.
    dataset.add_workload(copy_definition(), copy_inputs(), receipt=RECEIPT)
    assert len(dataset.workloads("tiny_copy_float32_h4")) == 2


def test_a_refused_write_is_one_error_and_leaves_no_line(dataset):
    (dataset.root / "blob").write_bytes(b"a file where the blob directory belongs")
    with pytest.raises(DatasetError, match="cannot write to dataset") as info:
        dataset.add_workloads([_record(copy_definition(), 2), _record(copy_definition(), 3)])
    assert "Fix:" in str(info.value)
    assert not (dataset.root / "workloads").exists()  # no line without its blob
    (dataset.root / "blob").unlink()
    dataset.add_workloads([_record(copy_definition(), 2)])  # the same writer carries on
    assert validate_dataset(dataset.root) == []
