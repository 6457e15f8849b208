"""`enginetap models list/build` through the real console entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from enginetap.models import MODEL_NAMES
from enginetap.models.builder import MARKER


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from enginetap.cli.main import main; main()"
    # One OpenMP thread: spin-waiting workers make tiny builds crawl on a shared 2-core box.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_list_names_every_model() -> None:
    result = run_cli("models", "list")
    assert result.returncode == 0, result.stderr
    for name in MODEL_NAMES:
        assert name in result.stdout


def test_build_prints_the_path(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from enginetap.cli.main import app

    # In process: a subprocess would spend its time importing transformers again.
    result = CliRunner().invoke(
        app, ["models", "build", "qwen3", "--out", str(tmp_path / "q"), "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert str(tmp_path / "q") in result.stdout.splitlines()
    assert (tmp_path / "q" / MARKER).is_file()


def test_unknown_name_is_one_clear_error(tmp_path: Path) -> None:
    result = run_cli("models", "build", "nope", "--out", str(tmp_path / "n"))
    assert result.returncode == 2
    assert "unknown built-in model 'nope'" in result.stderr and "qwen3_next" in result.stderr
    assert "Traceback" not in result.stderr
