"""A tap ``vector_control`` file that is a FIFO, a device or a giant file: the engine
never blocks on it nor reads it whole; it logs why and serves on, with the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = r"""
import json, sys
from pathlib import Path
from enginetap.jobs.tap import record_run

control, out = sys.argv[1], Path(sys.argv[2])
prompts = ["the cache holds every key", "kernels and caches", "the cache holds every key"]
runs = {}
for name, path in (("hostile", control), ("missing", str(out / "no-such-control.json"))):
    runs[name] = record_run("builtin:llama", prompts, out / name, max_new_tokens=3,
                            tap={"vectors": "control", "vector_control": path})
print(json.dumps(runs))
"""


def _control(tmp_path: Path, kind: str) -> Path:
    if kind == "fifo":
        path = tmp_path / "control.json"
        os.mkfifo(path)
        return path
    if kind == "dev-zero":
        return Path("/dev/zero")
    path = tmp_path / "control.json"  # a valid object padded past the size bound
    path.write_text('{"steps": [0, 9]}' + " " * (2 << 20))
    return path


@pytest.mark.parametrize("kind,said", [("fifo", "FIFO (named pipe)"),
                                       ("dev-zero", "character device"),
                                       ("giant", "byte limit")])
def test_the_engine_serves_on_past_a_hostile_control_file(tmp_path: Path, kind: str,
                                                          said: str) -> None:
    control = _control(tmp_path, kind)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(control), str(tmp_path)],
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine hung on a vector control file that is {kind}")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout.splitlines()[-1])
    assert runs["hostile"] == runs["missing"] and all(runs["hostile"])
    warnings = [line for line in done.stderr.splitlines() if "vector control file" in line]
    assert len(warnings) == 1 and said in warnings[0], done.stderr  # logged once, not per step
    assert not (tmp_path / "hostile" / "tap-vectors-rank0").exists()
