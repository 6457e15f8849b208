"""Engine runs of one test module, two at a time.

Most of a tiny model's vLLM run is vLLM's own import (about 7.5 s of single-threaded
Python per process; measured: two imports side by side take as long as one), so a module
that needs several independent engine children starts them :data:`PAIRWISE` at a time.
Two fit a CI machine's memory (vLLM's KV cache is capped at 1 GiB in the suite,
``tests/conftest.py``). TP=2 runs run alone: their workers already take both cores (four
sp_prefill runs two at a time took 103 s against about 104 s one after another).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["PAIRWISE", "side_by_side"]

T = TypeVar("T")

PAIRWISE = 2
"""Jobs running at once."""


def side_by_side(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``jobs`` (each blocking on its own child process) :data:`PAIRWISE` at a time;
    their results in order. The first failure is raised once all have ended."""
    with ThreadPoolExecutor(PAIRWISE) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [f.result() for f in futures]
