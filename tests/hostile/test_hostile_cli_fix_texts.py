"""Errors the command line prints suggest command-line fixes, never Python keywords."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_PYTHON_KEYWORD = re.compile(r"\b[a-z_]+=(True|False|None)\b")


@pytest.mark.parametrize("args", [
    ["replay", "{missing}"],
    ["replay", "{missing}", "--solution", "x.py:f"],
    ["guard", "check", "{missing}"],
])
def test_cli_errors_name_no_python_keyword(tmp_path: Path, args: list[str]) -> None:
    argv = [a.format(missing=tmp_path / "nonexistent") for a in args]
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", *argv],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
                               "COLUMNS": "400"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and "Fix: " in done.stderr
    assert not _PYTHON_KEYWORD.search(done.stderr), done.stderr
