"""Write failures in `models build` and `vllm merge`: one clear line, nothing left half-done.

A full disk is simulated with RLIMIT_FSIZE (writes past the limit fail with EFBIG); the
other failures are real paths: under a file, a name too long, a directory, an input file.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def _enginetap(*args: str, cwd: Path, file_limit: int | None = None
               ) -> subprocess.CompletedProcess[str]:
    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                               "COLUMNS": "200"},
                          preexec_fn=limit_files if file_limit else None)


def _one_error_line(done: subprocess.CompletedProcess[str], starts: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(starts), done.stderr


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_models_build_write_failures(workdir: Path) -> None:
    before = _listing(workdir)
    for out in ("a-file/model", "m" * 300):
        _one_error_line(_enginetap("models", "build", "llama", "--out", out, cwd=workdir),
                        "error: cannot build llama in")
    _one_error_line(_enginetap("models", "build", "llama", "--out", "model", cwd=workdir,
                               file_limit=4096), "error: cannot build llama in")
    assert _listing(workdir) == before


@pytest.fixture
def ranks(workdir: Path) -> Path:
    out = workdir / "out"
    out.mkdir()
    for rank in (0, 1):
        lines = [json.dumps({"step": step, "rank": rank, "pad": "x" * 200}) for step in range(8)]
        (out / f"steps-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def test_merge_never_overwrites_an_input(ranks: Path, workdir: Path) -> None:
    rank0 = ranks / "steps-rank0.jsonl"
    before = rank0.read_bytes()
    _one_error_line(_enginetap("vllm", "merge", "out", "--to", "out/steps-rank0.jsonl",
                               cwd=workdir), "error: --to out/steps-rank0.jsonl is one of")
    os.link(rank0, workdir / "hardlink.jsonl")
    _one_error_line(_enginetap("vllm", "merge", "out", "--to", "hardlink.jsonl", cwd=workdir),
                    "error: --to hardlink.jsonl is one of")
    assert rank0.read_bytes() == before


def test_failed_merges_leave_nothing_behind(ranks: Path, workdir: Path) -> None:
    (workdir / "a-dir").mkdir()
    before = _listing(workdir)
    for to in ("a-dir", "a-file/merged.jsonl", "n" * 300 + ".jsonl"):
        done = _enginetap("vllm", "merge", "out", "--to", to, cwd=workdir)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    _one_error_line(_enginetap("vllm", "merge", "out", "--to", "merged.jsonl", cwd=workdir,
                               file_limit=1024), "error: cannot write the merged file")
    assert _listing(workdir) == before
