"""A capture killed at any point leaves a dataset that validates with no torn record;
SIGTERM and SIGINT flush what was captured before the process ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enginetap.dataset import Dataset, validate_dataset

LOOP = Path(__file__).with_name("capture_loop.py")


def _start(out: Path, rounds: int = 10_000, writer: str = "thread",
           *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    # SIGINT at its default in the child: a background job (CI started with `&`) inherits
    # it ignored, and an ignored SIGINT is rightly ignored by capture too
    return subprocess.Popen([sys.executable, str(LOOP), str(out), str(rounds), writer, *extra],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(proc: subprocess.Popen, line: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            raise AssertionError(f"capture loop ended early: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {line!r} within {timeout}s")


def _readable_lines(root: Path) -> int:
    dataset = Dataset(root)
    count = 0
    for name in dataset.definitions():
        for line in dataset.workloads(name):
            dataset.load_inputs(line)
            count += 1
    return count


def _wait_for_a_line(root: Path, timeout: float = 60) -> None:
    """The writer is a background thread: "round N" says the engine stepped, not that a
    record reached disk. Wait for the first workload line (the loop keeps capturing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(f.stat().st_size > 0 for f in root.glob("workloads/**/*.jsonl")):
            return
        time.sleep(0.02)
    raise AssertionError(f"no workload line under {root} within {timeout}s")


def _writer_pid(proc: subprocess.Popen, timeout: float = 240) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if got.startswith("writer pid "):
            return int(got.split()[-1])
        if not got and proc.poll() is not None:
            raise AssertionError(f"capture loop ended early: {proc.stderr.read()[-3000:]}")
    raise AssertionError("the capture loop did not name its writer process")


def _wait_gone(pid: int, timeout: float = 120) -> None:
    """Wait for a process that is not our child (the killed loop's writer) to exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"writer process {pid} still running {timeout}s after its engine died")


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_sigkill_at_several_points_leaves_no_torn_record(tmp_path, writer):
    # with the process writer the engine's process dies and its writer, left alone,
    # writes what it received and exits
    for point, (after_round, extra_s) in enumerate([(0, 0.0), (1, 0.15), (2, 0.4)]):
        out = tmp_path / f"kill{point}"
        proc = _start(out, writer=writer)
        child = _writer_pid(proc) if writer == "process" else None
        _wait_for(proc, f"round {after_round}")
        _wait_for_a_line(out / "ds")
        time.sleep(extra_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if child is not None:
            _wait_gone(child)
        problems = validate_dataset(out / "ds")
        # a kill between a blob and its line can leave an orphan blob (reported, never a
        # torn line); everything a line names is complete and loads
        assert all("orphan" in p for p in problems), problems
        assert _readable_lines(out / "ds") > 0


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_flush_the_writer(tmp_path, signum, writer):
    proc = _start(tmp_path, writer=writer)
    _wait_for(proc, "round 1")
    proc.send_signal(signum)
    try:
        # read both pipes to the end: KeyboardInterrupt prints a traceback, and a child
        # blocked writing into a full, unread stderr pipe would never exit
        proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # say where every thread is, then fail
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"no exit after {signum!r}:\n{err[-6000:]}") from None
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["written"] == _readable_lines(tmp_path / "ds") > 0
    assert validate_dataset(tmp_path / "ds") == []


@pytest.mark.slow
def test_sigterm_flushes_the_capture_writer_and_a_record_sink_alike(tmp_path):
    """Both hold records the exit flushes (:mod:`enginetap.core.shutdown`): the capture
    writer and a deferred record sink (the tap's, the step recorder's), in one process."""
    proc = _start(tmp_path, 10_000, "thread", "sink")
    _wait_for(proc, "round 1")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    summary = json.loads((tmp_path / "run" / "capture-summary-rank0.json").read_text())
    assert summary["written"] == _readable_lines(tmp_path / "ds") > 0
    assert validate_dataset(tmp_path / "ds") == []
    rounds = [json.loads(line)["round"] for line in
              (tmp_path / "sink-rank0.jsonl").read_text().splitlines()]
    printed = sum(line.startswith("round ") for line in out.splitlines())
    # every round submitted a record before saying so (the signal may come between)
    assert rounds == list(range(len(rounds))) and len(rounds) >= printed + 2
