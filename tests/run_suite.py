"""``make test``: the whole suite as two pytest processes side by side.

Most of the suite's time is vLLM CPU engines in child processes (tests marked ``vllm``);
the rest is single-threaded (one torch thread per test process, ``tests/conftest.py``), so
on a 2-core machine one core sat idle through it. Here the two halves run at once:

- ``engines``: ``pytest -m vllm``, its output streamed live, its TP=2 modules last (their
  workers take both cores; by then the other half has usually finished);
- ``rest``: ``pytest -m "not vllm"``, its output kept in a log that is printed when it ends;
- ``sglang``: where ``ENGINETAP_SGLANG_PYTHON`` names SGLang's venv's python (``make test``
  sets it: SGLang's pins cannot live beside vLLM CPU's), ``pytest -m sglang`` in that
  venv, after the engines half (in the main venv those tests are deselected).

Measured on a 2-core machine (README): about half a minute to a minute less than one
process — the machine is nearly CPU-bound either way (vLLM's import in every engine child).

Extra arguments go to both pytest calls (e.g. a test folder). The exit status is 0 when
both passed (or one of them had nothing to run).
``python -m pytest`` still runs everything in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLE = "ETSUITE_ROLE"


def main(argv: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="enginetap-suite-"))
    sglang_python = os.environ.get("ENGINETAP_SGLANG_PYTHON", "")

    def pytest(role: str, marker: str, python: str = sys.executable) -> list[str]:
        return [python, "-m", "pytest", "-m", marker, "--basetemp",
                str(work / role), "-p", "no:cacheprovider", *argv]

    def env(role: str) -> dict[str, str]:
        return {**os.environ, ROLE: role}

    log_path = work / "rest.log"
    with log_path.open("wb") as log:
        rest = subprocess.Popen(pytest("rest", "not vllm and not sglang"), cwd=ROOT,
                                env=env("rest"), stdout=log, stderr=subprocess.STDOUT)
        try:
            print("== engines (pytest -m vllm); the other tests run beside it, "
                  f"their output follows (log: {log_path})", flush=True)
            engines = subprocess.run(pytest("engines", "vllm and not sglang"), cwd=ROOT,
                                     env=env("engines"), check=False).returncode
            sglang = 5
            if sglang_python:
                print("== sglang (pytest -m sglang, in SGLang's venv)", flush=True)
                sglang = subprocess.run(pytest("sglang", "sglang", sglang_python), cwd=ROOT,
                                        env=env("sglang"), check=False).returncode
        except BaseException:  # interrupted: take the other half down with us
            rest.kill()
            raise
        rest_code = rest.wait()
    print(f"\n== rest (pytest -m 'not vllm and not sglang'): {log_path}", flush=True)
    sys.stdout.write(log_path.read_text(errors="replace"))
    print(f"\n== suite: engines exited {engines}, rest exited {rest_code}, sglang exited "
          f"{sglang if sglang_python else 'not run (no ENGINETAP_SGLANG_PYTHON)'}", flush=True)
    # 5 is pytest's "no tests collected": fine for one part of a selection, not for all
    codes = {engines, rest_code, sglang}
    return 0 if codes <= {0, 5} and codes != {5} else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
