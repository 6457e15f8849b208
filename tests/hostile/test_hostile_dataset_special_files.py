"""Hostile files: FIFOs, links to FIFOs and directories where dataset files belong.

``validate``, ``show`` and ``replay`` must finish (a FIFO opened for reading would block
forever) and say what each such file is, never call it missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.schema import Receipt
from enginetap.errors import DatasetError
from tests.dataset.dataset_helpers import copy_definition

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")

RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")
F32 = "workloads/tiny_copy/tiny_copy_float32_h4.jsonl"
BF16 = "workloads/tiny_copy/tiny_copy_bfloat16_h4.jsonl"
FIFO = "a FIFO (named pipe), not a regular file"


def _add(dataset: Dataset, dtype: str, rows: int):
    x = torch.randn(rows, 4).to(getattr(torch, dtype))
    return dataset.add_workload(copy_definition(dtype), {"x": x, "n": 1, "alpha": 0.5,
                                                         "flag": True},
                                outputs={"y": x.clone()}, receipt=RECEIPT)


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, list]:
    """A dataset where a blob is a FIFO, another blob a directory, a definition file a
    FIFO, another a link to a FIFO, and one definition's JSONL file a FIFO."""
    dataset = Dataset(tmp_path / "ds", create=True)
    root = dataset.root
    lines = [_add(dataset, "float32", 2), _add(dataset, "float32", 3),
             _add(dataset, "float32", 4), _add(dataset, "bfloat16", 2)]
    fifo_blob, dir_blob = (root / lines[i].workload.inputs["x"].path for i in (0, 1))
    for path in (fifo_blob, dir_blob, root / BF16):
        path.unlink()
    os.mkfifo(fifo_blob)
    dir_blob.mkdir()
    os.mkfifo(root / BF16)
    os.mkfifo(root / "definitions/tiny_copy/pipe.json")
    os.mkfifo(root / "pipe")
    (root / "definitions/tiny_copy/link.json").symlink_to(root / "pipe")
    return root, lines


def _cli(*args: str) -> subprocess.CompletedProcess:
    # A hang here (the bug) fails the test through the timeout instead of blocking it.
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})


def test_validate_show_and_replay_finish_and_say_what_the_files_are(hostile):
    root, lines = hostile
    validate = _cli("dataset", "validate", str(root))
    assert validate.returncode == 1, validate.stderr
    assert "missing" not in validate.stdout
    show = _cli("dataset", "show", str(root))
    assert show.returncode == 0, show.stderr
    assert "tiny_copy_float32_h4" in show.stdout
    replay = _cli("replay", str(root), "--warmup", "0", "--repeats", "0")
    assert replay.returncode != 0 and "Traceback" not in replay.stderr
    assert "FIFO" in replay.stdout + replay.stderr


def test_each_special_file_is_named_for_what_it_is(hostile):
    root, lines = hostile
    problems = _cli("dataset", "validate", str(root)).stdout.splitlines()
    assert problems == validate_dataset(root)
    fifo_blob = lines[0].workload.inputs["x"].path
    dir_blob = lines[1].workload.inputs["x"].path
    expected = [
        "definitions/tiny_copy/link.json: is a symlink to a FIFO (named pipe), not a regular",
        f"definitions/tiny_copy/pipe.json: is {FIFO}",
        f"{BF16}: is {FIFO}",
        f"{F32}:1: input 'x': blob {fifo_blob} is {FIFO}",
        f"{F32}:1: engine output 'y': blob {fifo_blob} is {FIFO}",
        f"{F32}:2: input 'x': blob {dir_blob} is a directory, not a regular file",
        f"{F32}:2: engine output 'y': blob {dir_blob} is a directory, not a regular file",
    ]
    for fragment in expected:
        assert sum(p.startswith(fragment) for p in problems) == 1, (fragment, problems)
    # The bfloat16 blob is unreferenced only because its JSONL cannot be read: keep it.
    (kept,) = [p for p in problems if p.startswith(lines[3].workload.inputs["x"].path)]
    assert "not safe to delete yet" in kept and BF16 in kept and "delete it" not in kept
    assert len(problems) == len(expected) + 1, problems


@pytest.mark.timeout(60)  # the bug is a hang: fail fast instead
def test_loading_a_special_file_is_an_error_not_a_hang(hostile):
    root, lines = hostile
    dataset = Dataset(root)
    with pytest.raises(DatasetError, match="link.json: is a symlink to a FIFO"):
        dataset.definitions()
    (root / "definitions/tiny_copy/pipe.json").unlink()
    (root / "definitions/tiny_copy/link.json").unlink()
    for line, kind in ((lines[0], "FIFO"), (lines[1], "directory")):
        with pytest.raises(DatasetError, match=kind):
            dataset.load_inputs(line)
    assert dataset.load_inputs(lines[2])["x"].shape == (4, 4)
    with pytest.raises(DatasetError, match="FIFO"):
        dataset.workloads("tiny_copy_bfloat16_h4")
