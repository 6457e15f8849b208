"""Recorded tap runs and the CLI for the tap hostile tests (real built-in engines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["the cache holds every key", "kernels and caches", "the cache holds every key",
           "decode"]


def record_tap(out: Path, model: str = "llama", prompts: list[str] | None = None,
               max_new_tokens: int = 3, **tap: Any) -> Path:
    """A tap run of the built-in ``model`` (tiny random weights) recorded to ``out``."""
    from enginetap.jobs.tap import record_run

    record_run(f"builtin:{model}", prompts or PROMPTS, out, batch_size=8,
               max_new_tokens=max_new_tokens, tap=tap)
    return out


def enginetap(*args: str, cwd: Path | None = None, timeout: float = 300,
              preexec: Any = None) -> subprocess.CompletedProcess[str]:
    """The real command line in a child process (exit codes as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                               "COLUMNS": "200"}, preexec_fn=preexec)


def one_error_line(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, no traceback, one non-empty stderr line holding every needle; that line."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def tap_lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "tap-rank0.jsonl").read_text().splitlines()]


def write_tap(run: Path, records: list[Any]) -> Path:
    """A tap file of ``records`` (objects or raw strings, one per line) in ``run``."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / "tap-rank0.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path
