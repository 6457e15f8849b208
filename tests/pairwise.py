"""Engine runs of one test module, two at a time.

Most of a tiny model's vLLM run is vLLM's own import (about 7.5 s of single-threaded
Python per process; measured: two imports side by side take as long as one), so a module
that needs several independent engine children starts them :data:`PAIRWISE` at a time.
Two fit a CI machine's memory (vLLM's KV cache is capped at 1 GiB in the suite,
``tests/conftest.py``). TP=2 runs run alone: their workers already take both cores (four
sp_prefill runs two at a time took 103 s against about 104 s one after another), and under
``make test`` (``tests/run_suite.py``, two pytest processes) they hold the CPU :func:`alone`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["PAIRWISE", "alone", "shared", "side_by_side"]

T = TypeVar("T")

PAIRWISE = 2
"""Jobs running at once."""


def side_by_side(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``jobs`` (each blocking on its own child process) :data:`PAIRWISE` at a time;
    their results in order. The first failure is raised once all have ended."""
    with ThreadPoolExecutor(PAIRWISE) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [f.result() for f in futures]


# The CPU lock of a ``make test`` run (tests/run_suite.py sets it for both pytest processes):
# a readers-writer lock of two flock files. The turnstile keeps a waiting writer from being
# starved by the reader's back-to-back tests.
_LOCK = "ETSUITE_CPU_LOCK"


@contextmanager
def _held(shared_lock: bool) -> Iterator[None]:
    path = os.environ.get(_LOCK)
    if not path:
        yield
        return
    with open(path + ".turn", "a") as turn, open(path, "a") as main:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_SH if shared_lock else fcntl.LOCK_EX)
        finally:
            if shared_lock:
                fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
            fcntl.flock(turn, fcntl.LOCK_UN)


def alone() -> contextlib.AbstractContextManager[None]:
    """Hold the suite's CPU for a run whose workers take every core (TP=2): the other pytest
    process's next test waits until it ends. Nothing outside ``make test``."""
    return _held(shared_lock=False)


def shared() -> contextlib.AbstractContextManager[None]:
    """Hold the suite's CPU lock shared (one test of the ``rest`` process)."""
    return _held(shared_lock=True)
