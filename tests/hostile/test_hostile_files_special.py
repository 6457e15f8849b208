"""Special files where `traffic show` and `guard check` expect a trace, a profile or a lock.

A FIFO blocked `open()` forever and `/dev/zero` was read until MemoryError: only regular
files are read, with a size bound, and anything else is one error line and exit 2.
Each command runs in a child with a time limit and an address-space cap, so a regression
fails the test instead of hanging the suite or eating the machine's memory.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import enginetap

SRC = Path(enginetap.__file__).resolve().parents[1]
MEMORY_CAP = 3 << 30


def _enginetap(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    try:
        return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=30,
                              preexec_fn=cap_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"enginetap {' '.join(args)} hung for 30 s")


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("prefix", ["", "mooncake:", "agentx:"])
def test_traffic_show_refuses_a_fifo(tmp_path: Path, fifo: Path, prefix: str) -> None:
    _refused(_enginetap("traffic", "show", f"{prefix}{fifo}", cwd=tmp_path), "FIFO")


@pytest.mark.parametrize("prefix", ["", "mooncake:", "agentx:"])
def test_traffic_show_refuses_dev_zero(tmp_path: Path, prefix: str) -> None:
    _refused(_enginetap("traffic", "show", f"{prefix}/dev/zero", cwd=tmp_path),
             "character device")


def test_traffic_show_refuses_a_link_to_a_fifo(tmp_path: Path, fifo: Path) -> None:
    (tmp_path / "trace.jsonl").symlink_to(fifo)
    _refused(_enginetap("traffic", "show", "mooncake:trace.jsonl", cwd=tmp_path), "FIFO")


def test_traffic_show_refuses_a_trace_over_the_size_bound(tmp_path: Path) -> None:
    from enginetap.traffic.loaders import MAX_TRACE_BYTES

    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:  # sparse: costs no disk
        f.truncate(MAX_TRACE_BYTES + 1)
    _refused(_enginetap("traffic", "show", f"mooncake:{big}", cwd=tmp_path), "limit")


def test_guard_check_refuses_a_fifo_and_dev_zero(tmp_path: Path, fifo: Path) -> None:
    _refused(_enginetap("guard", "check", str(fifo), cwd=tmp_path), "FIFO")
    _refused(_enginetap("guard", "check", "/dev/zero", cwd=tmp_path), "character device")
    big = tmp_path / "big.lock"
    with big.open("wb") as f:
        f.truncate(1 << 30)
    _refused(_enginetap("guard", "check", str(big), cwd=tmp_path), "limit")


def test_tap_run_refuses_a_prompt_file_that_is_a_fifo_or_a_device(tmp_path: Path,
                                                                    fifo: Path) -> None:
    for prompts in (str(fifo), "/dev/zero"):
        _refused(_enginetap("tap", "run", "--model", "builtin:llama", "--prompts", prompts,
                            "--out", "run", cwd=tmp_path), "cannot read prompts")
    assert not (tmp_path / "run").exists()


def test_outputs_never_replace_a_special_file(tmp_path: Path, fifo: Path) -> None:
    """`guard pin -o` and `traffic derive --out` wrote a temporary file and renamed it over
    the target: a FIFO (or, run as root, /dev/null) was replaced by a regular file."""
    import stat

    _refused(_enginetap("guard", "pin", "enginetap.errors:describe_validation", "-o",
                        str(fifo), cwd=tmp_path), "FIFO")
    _refused(_enginetap("traffic", "derive", "builtin:mooncake-tiny", "--out", str(fifo),
                        cwd=tmp_path), "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_outputs_write_through_a_symlink_to_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    done = _enginetap("traffic", "derive", "builtin:mooncake-tiny", "--out", "link.json",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "link.json").is_symlink()
    assert '"mooncake-tiny"' in (tmp_path / "real.json").read_text()
