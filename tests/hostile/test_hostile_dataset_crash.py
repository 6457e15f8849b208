"""A batch writer killed with SIGKILL at every step of a commit leaves nothing torn.

One subprocess imports everything once, then forks a writer per kill point; each forked
writer SIGKILLs itself just before its k-th file-system step (sync, link, rename, write)
of one ``add_workloads`` commit, until a writer runs to the end. Every leftover dataset
must validate with at most unreferenced blobs (what the design allows), and every line in
it must load whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import enginetap
from enginetap.dataset import Dataset, validate_dataset
from enginetap.dataset.scan import scan_workloads

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(Path(enginetap.__file__).resolve().parents[1]), str(REPO),
     os.environ.get("PYTHONPATH", "")])}

CHILD = r"""
import json, os, signal, sys
import torch
from enginetap.dataset import Dataset, WorkloadRecord
from enginetap.dataset.schema import Receipt
from tests.dataset.dataset_helpers import copy_definition

torch.set_num_threads(1)
RECEIPT = Receipt(source="manual", created_at="2026-01-02T03:04:05Z")
STEPS = ("fsync", "fdatasync", "link", "replace", "write")


def record(definition, rows):
    x = torch.full((rows, 4), float(rows)).to(getattr(torch, definition.inputs["x"].dtype))
    return WorkloadRecord(definition=definition, receipt=RECEIPT, outputs={"y": x * 2},
                          inputs={"x": x, "n": rows, "alpha": 0.5, "flag": True})


def writer(root, kill_at):
    f32, bf16 = copy_definition(), copy_definition("bfloat16")
    dataset = Dataset(root, create=True)
    dataset.add_workloads([record(f32, 1)])  # data from before the crash
    count = [0]
    for name in STEPS:
        real = getattr(os, name)

        def step(*args, _real=real):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args)
        setattr(os, name, step)
    # A new definition and an existing one, three workloads: every kind of step.
    dataset.add_workloads([record(bf16, 2), record(f32, 3), record(bf16, 4)])


outcomes = {}
for kill_at in range(1, 200):
    root = os.path.join(sys.argv[1], f"kill{kill_at:03d}")
    pid = os.fork()
    if pid == 0:
        try:
            writer(root, kill_at)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    outcomes[root] = "killed" if killed else "completed"
    if not killed:
        break
print(json.dumps(outcomes))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_batch_writer_killed_anywhere_leaves_nothing_torn(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outcomes: dict[str, str] = json.loads(done.stdout)
    assert list(outcomes.values()).count("completed") == 1
    assert len(outcomes) >= 12  # a kill before each step of the commit
    counts = set()
    for root, outcome in outcomes.items():
        records, torn = scan_workloads(Path(root))
        assert torn == [], (root, torn)  # every line parses
        problems = validate_dataset(root)
        assert all(": orphan blob (no workload line references it" in p
                   for p in problems), (root, problems)
        dataset = Dataset(root)
        for record in records:  # every line's data is whole
            line = record.line
            inputs, outputs = dataset.load_inputs(line), dataset.load_outputs(line)
            rows = line.workload.axes["batch"]
            assert float(inputs["x"][0, 0]) == rows and float(outputs["y"][0, 0]) == 2 * rows
        counts.add(len(records))
        if outcome == "completed":
            assert problems == [] and len(records) == 4
    assert counts == {1, 3, 4}  # before the commit, after the bfloat16 append, after all
