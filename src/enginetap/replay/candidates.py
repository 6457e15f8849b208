"""The candidates of one replay: each solution in its own child process.

A solution is a built-in name (:mod:`enginetap.replay.builtin`) or a user's
``module:function``. Each gets its own :class:`ChildFunction`, so that one that crashes, ends
its process or breaks its CUDA context costs its own workload an ERROR row and nothing else:
its process is started again for the next workload, and the other solutions never shared it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from enginetap.errors import ConfigError
from enginetap.replay.builtin import BuiltinSolution, builtin_named
from enginetap.replay.execution import ChildFunction
from enginetap.replay.fib import FibSolution, read_solution

if TYPE_CHECKING:
    from enginetap.dataset.schema import Definition

__all__ = ["Candidate", "close_candidates", "open_candidates"]


@dataclass
class Candidate:
    """One solution and the child process it runs in."""

    name: str
    run: ChildFunction
    builtin: BuiltinSolution | None = None
    fib: FibSolution | None = None
    """A flashinfer-bench Solution file's contents (``--solution x.json``)."""

    def skip_reason(self, definition: Definition, device: str) -> str | None:
        """Why it is not run on ``definition`` (a user's function never is skipped)."""
        if self.builtin is not None:
            return self.builtin.skip_reason(definition, device)
        return self.fib.skip_reason(definition) if self.fib is not None else None


def open_candidates(specs: Sequence[str], timeout: float | None = None) -> list[Candidate]:
    """Start a child per solution and load it there (importing it: ``timeout`` seconds at
    most).

    Raises:
        ConfigError: a name is given twice, a Solution file cannot be read, or a user's
            solution cannot be imported.
    """
    repeated = sorted({s for s in specs if list(specs).count(s) > 1})
    if repeated:
        raise ConfigError(f"solution {repeated[0]!r} given twice", "each runs once",
                          "pass every --solution once")
    opened: list[Candidate] = []
    try:
        for spec in specs:
            fib = read_solution(spec) if spec.endswith(".json") else None
            # A Solution file by its absolute path: the child may not share a relative one.
            load = str(Path(spec).resolve()) if fib is not None else spec
            opened.append(Candidate(spec, ChildFunction(solution=load), builtin_named(spec), fib))
            opened[-1].run.start(timeout)
    except BaseException:
        close_candidates(opened)
        raise
    return opened


def close_candidates(candidates: Sequence[Candidate]) -> None:
    """End every child (each one's temporary directory goes with it)."""
    for candidate in candidates:
        candidate.run.close()
