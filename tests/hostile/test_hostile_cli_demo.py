"""`enginetap demo --out`: never deletes what it did not write, never follows a link.

These cases are refused before the engine runs; a full re-run over a real previous output
is covered by tests/cli/test_demo_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MARKER = ".enginetap-demo"


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", "demo", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def _previous_output(out: Path, files: list[str] | None) -> None:
    """What a previous demo run leaves: its dataset files and the marker listing them."""
    for rel in files or ["definitions/rmsnorm/rmsnorm_h128.json"]:
        (out / "dataset" / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / "dataset" / rel).write_text("{}")
    (out / MARKER).write_text(json.dumps({"made_by": "enginetap demo", "dataset_files": files}))


def test_a_symlinked_out_is_refused_with_one_line(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    _previous_output(real, ["definitions/a.json"])
    (tmp_path / "link").symlink_to(real)
    done = _demo("--out", str(tmp_path / "link"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert (real / "dataset" / "definitions" / "a.json").exists()


def test_files_the_demo_did_not_write_are_never_deleted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _previous_output(out, ["definitions/a.json"])
    (out / "dataset" / "mine.txt").write_text("keep me")
    done = _demo("--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'mine.txt', which the demo did not write" in " ".join(done.stderr.split())
    assert (out / "dataset" / "mine.txt").read_text() == "keep me"
    assert (out / "dataset" / "definitions" / "a.json").exists()


def test_an_unfinished_or_unlisted_previous_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _previous_output(out, None)
    done = _demo("--out", str(out))
    assert done.returncode == 2 and "did not finish" in done.stderr, done.stderr
    assert (out / "dataset" / "definitions" / "rmsnorm" / "rmsnorm_h128.json").exists()
    (tmp_path / "a-file").write_text("x")
    done = _demo("--out", str(tmp_path / "a-file" / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
