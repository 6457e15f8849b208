"""Running vLLM for tests: always in child processes, with an explicit arming.

vLLM's spawned workers re-import ``__main__``, so vLLM never starts inside pytest itself.
Children get a clean arming environment: every ``ENGINETAP*`` variable of ours is dropped
and the test's own arming is added.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from enginetap.config import ARMING_VARS

HERE = Path(__file__).parent
OFFLINE = HERE / "offline_run.py"

T = TypeVar("T")

PAIRWISE = 2
"""TP=1 engine runs a fixture starts at once. Most of a tiny model's run is vLLM's import
(about 7.5 s of Python, one core); two at a time use both cores of a CI machine (measured:
two imports side by side take as long as one) and fit its memory (a 1 GiB KV cache each,
``tests/conftest.py``). TP=2 runs, whose workers already take both cores, run alone."""


def side_by_side(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``jobs`` (each blocking on its own vLLM child) :data:`PAIRWISE` at a time; their
    results in order. The first failure is raised once all have ended."""
    with ThreadPoolExecutor(PAIRWISE) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [f.result() for f in futures]


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
