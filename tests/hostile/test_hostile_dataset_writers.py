"""Writers side by side: file modes follow the umask, parallel writers of one definition
all succeed, and links leading outside the dataset are never called orphans to delete."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import enginetap
from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import copy_definition, files_under

RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(Path(enginetap.__file__).resolve().parents[1]), str(REPO),
     os.environ.get("PYTHONPATH", "")])}


def _inputs(rows: int = 2) -> dict:
    return {"x": torch.ones(rows, 4), "n": 1, "alpha": 0.5, "flag": True}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_created_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        dataset = Dataset(tmp_path / "ds", create=True)
        dataset.add_workload(copy_definition(), _inputs(), outputs={"y": torch.ones(2, 4)},
                             receipt=RECEIPT)
    finally:
        os.umask(old)
    modes = {rel: stat.S_IMODE((dataset.root / rel).stat().st_mode)
             for rel in files_under(dataset.root)}
    assert len(modes) == 3  # definition, JSONL, blob
    assert set(modes.values()) == {0o666 & ~umask}, modes


WRITER = """
import sys
import torch
from enginetap.dataset import Dataset
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import copy_definition

dataset = Dataset(sys.argv[1], create=True)
print("ready", flush=True)
sys.stdin.readline()  # every writer starts at once
inputs = {"x": torch.ones(2, 4), "n": 1, "alpha": 0.5, "flag": True}
dataset.add_workload(copy_definition(), inputs,
                     receipt=Receipt(source="manual", created_at="2026-01-02T03:04:05Z"))
"""


def test_parallel_writers_of_one_definition_all_succeed(tmp_path):
    root = tmp_path / "ds"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=REPO, env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, errors
    dataset = Dataset(root)
    assert list(dataset.definitions()) == ["tiny_copy_float32_h4"]
    assert len(dataset.workloads("tiny_copy_float32_h4")) == 4
    assert validate_dataset(root) == []


def test_a_link_outside_the_dataset_is_not_an_orphan_to_delete(tmp_path):
    dataset = Dataset(tmp_path / "ds", create=True)
    line = dataset.add_workload(copy_definition(), _inputs(), receipt=RECEIPT)
    secret = tmp_path / "outside.safetensors"
    secret.write_bytes(b"not the dataset's")
    blob_dir = dataset.root / "blob/workloads/tiny_copy/tiny_copy_float32_h4"
    (blob_dir / "stray.safetensors").symlink_to(secret)
    # A line whose blob is replaced by a link leading outside: refused, and not an orphan.
    blob = dataset.root / line.workload.inputs["x"].path
    blob.unlink()
    blob.symlink_to(secret)

    problems = validate_dataset(dataset.root)
    stray = "blob/workloads/tiny_copy/tiny_copy_float32_h4/stray.safetensors"
    assert [p.split(": ")[0] for p in problems] == [
        "workloads/tiny_copy/tiny_copy_float32_h4.jsonl:1", stray]
    assert "refusing dataset path" in problems[0] and "outside the dataset root" in problems[0]
    assert problems[1] == (
        f"{stray}: a symlink leading outside the dataset (to {secret}); no workload line "
        "references it and enginetap never reads through it; it is not part of the dataset "
        "(removing the link leaves its target untouched)")
    assert not any("orphan" in p or "delete" in p for p in problems)
    assert secret.read_bytes() == b"not the dataset's"


def test_a_directory_or_fifo_in_the_blob_tree_is_named(tmp_path):
    dataset = Dataset(tmp_path / "ds", create=True)
    dataset.add_workload(copy_definition(), _inputs(), receipt=RECEIPT)
    base = dataset.root / "blob/workloads/tiny_copy/tiny_copy_float32_h4"
    os.mkfifo(base / "pipe.safetensors")
    assert validate_dataset(dataset.root) == [
        "blob/workloads/tiny_copy/tiny_copy_float32_h4/pipe.safetensors: a FIFO (named pipe), "
        "not a blob file, that no workload line references; remove it"]
