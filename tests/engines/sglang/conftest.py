"""SGLang tests run in SGLang's own venv (``.venv-sglang``, ``make install-sglang``): its
pins cannot live beside vLLM CPU's. Elsewhere they skip (``make test`` deselects them in
the main venv and runs them in SGLang's, see tests/run_suite.py).

Each test module starts one engine per architecture in a child process (SGLang spawns its
scheduler and detokenizer; a crash there must not take pytest down) and checks what
the child wrote. Children get ``SGLANG_PYSPY_DUMP_BEFORE_CRASH=0`` and
``SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0`` (a crash otherwise waits 65 s for py-spy).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def have_sglang() -> bool:
    return importlib.util.find_spec("sglang") is not None


def pytest_collection_modifyitems(config, items):
    if have_sglang():
        return
    skip = pytest.mark.skip(reason="SGLang is not installed here (make install-sglang; "
                                   "make test runs these in .venv-sglang)")
    for item in items:
        if item.get_closest_marker("sglang") is not None:
            item.add_marker(skip)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINETAP")}
    env.update({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
                "SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_child(args: list[str], env: dict[str, str], log: Path, timeout: float = 420) -> str:
    """Run ``python ARGS`` (the same interpreter); fail with its log's tail if it fails."""
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, *args], env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # the child and the engine processes it spawned
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = -1
    text = log.read_text(errors="replace")
    if code != 0:
        pytest.fail(f"child {' '.join(args[:3])} exited {code}; log tail:\n{text[-4000:]}")
    return text
