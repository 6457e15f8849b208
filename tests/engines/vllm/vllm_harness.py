"""Running vLLM for tests: always in child processes, with an explicit arming.

vLLM's spawned workers re-import ``__main__``, so vLLM never starts inside pytest itself.
Children get a clean arming environment: every ``ENGINETAP*`` variable of ours is dropped
and the test's own arming is added.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from enginetap.config import ARMING_VARS

HERE = Path(__file__).parent
OFFLINE = HERE / "offline_run.py"


def child_env(extra: Mapping[str, str] = ()) -> dict[str, str]:
    """Our environment without arming, with this folder importable (probe patches)."""
    env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_script(args: list[str], env: Mapping[str, str], log: Path, timeout: float = 400) -> str:
    """Run ``python args...`` with its output in ``log``; the log text. Fails with its tail."""
    with log.open("wb") as sink:
        proc = subprocess.run([sys.executable, *args], env=dict(env), stdout=sink,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{text[-4000:]}"
    return text
