"""A child process started by enginetap (a candidate, a trusted reference) never outlives
the process that started it: a replay killed with SIGKILL cannot close its pipes, so the
child is killed by the kernel (Linux's parent-death signal), even while it hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_hanging_child_dies_with_its_killed_parent(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text("import time\n\ndef handle(message):\n"
                                      "    time.sleep(600)\n    return {}\n")
    parent = textwrap.dedent(f"""
        import sys
        from enginetap.core.isolated import Child
        child = Child("hang:handle", sys_path=[{str(tmp_path)!r}, *sys.path])
        child._start()
        print(child._process.pid, flush=True)
        child.request({{"x": 1}})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        pid = int(proc.stdout.readline())
        time.sleep(1.0)  # the child is in its hanging request
        assert _alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the child outlived its SIGKILLed parent"
    finally:
        proc.kill()
        if 'pid' in locals() and _alive(pid):
            os.kill(pid, signal.SIGKILL)
