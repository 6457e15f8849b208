"""Hostile guard locks: empty locks, targets that exit at import, writes that fail."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import enginetap

SRC = Path(enginetap.__file__).resolve().parents[1]


def _guard(*args: str, cwd: Path,
           file_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit_files() -> None:
        # A full disk, simulated: writes past file_limit bytes fail with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", "guard", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_files if file_limit else None)


@pytest.fixture
def engine(tmp_path: Path) -> tuple[str, Path]:
    name = f"hostile_guard_{uuid.uuid4().hex[:10]}"
    path = tmp_path / "mods" / f"{name}.py"
    path.parent.mkdir()
    path.write_text("def launch(x):\n    return x\n\ndef other(x):\n    return -x\n\n"
                    "class Kernel:\n    def run(self, x):\n        return x * 2\n")
    return name, path


def test_a_lock_with_no_entries_never_passes(tmp_path: Path) -> None:
    lock = tmp_path / "empty.lock"
    lock.write_text(json.dumps({"algorithm": "sha256", "entries": []}))
    done = _guard("check", str(lock), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not a valid guard lock" in done.stderr and "ok:" not in done.stdout


@pytest.mark.parametrize("top, says", [
    ("import sys\nsys.exit(3)\n", "importing it raised SystemExit: 3"),
    ("raise KeyboardInterrupt\n", "importing it raised KeyboardInterrupt"),
    ("import os\nos._exit(0)\n", "importing it failed: the process running it ended with exit "
                                 "code 0"),
])
def test_a_target_module_that_exits_at_import_is_reported(engine: tuple[str, Path],
                                                          tmp_path: Path, top: str,
                                                          says: str) -> None:
    name, path = engine
    lock = tmp_path / "guard.lock"
    mods = str(path.parent)
    assert _guard("pin", f"{name}:launch", f"{name}:Kernel.run", "-o", str(lock), "-p", mods,
                  cwd=tmp_path).returncode == 0
    path.write_text(top + path.read_text())
    done = _guard("check", str(lock), "-p", mods, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    drifts = [line for line in done.stdout.splitlines() if line.startswith("DRIFT")]
    assert len(drifts) == 2 and all(": unreadable (locked " in line and says in line
                                    for line in drifts), drifts
    assert "2 of 2 target(s) drifted" in done.stdout
    pinned = _guard("pin", f"{name}:launch", "-o", str(tmp_path / "new.lock"), "-p", mods,
                    cwd=tmp_path)
    assert pinned.returncode == 2 and "cannot pin every target" in pinned.stderr
    assert not (tmp_path / "new.lock").exists()


def test_pin_on_a_full_disk_leaves_the_old_lock_whole(engine: tuple[str, Path],
                                                      tmp_path: Path) -> None:
    name, path = engine
    lock = tmp_path / "guard.lock"
    mods = str(path.parent)
    assert _guard("pin", f"{name}:launch", "-o", str(lock), "-p", mods,
                  cwd=tmp_path).returncode == 0
    before = lock.read_bytes()
    done = _guard("pin", f"{name}:launch", f"{name}:other", f"{name}:Kernel.run", "-o",
                  str(lock), "-p", mods, cwd=tmp_path, file_limit=len(before) + 16)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: cannot write the guard lock" in done.stderr
    assert "Traceback" not in done.stderr
    assert lock.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["guard.lock", "mods"]


def test_pin_to_an_unwritable_path_is_one_line(engine: tuple[str, Path], tmp_path: Path) -> None:
    name, path = engine
    (tmp_path / "a-file").write_text("not a directory")
    for where in ("a-file/guard.lock", "x" * 300 + ".lock", "."):
        done = _guard("pin", f"{name}:launch", "-o", where, "-p", str(path.parent), cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith("error: cannot write the guard lock"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "mods"]
