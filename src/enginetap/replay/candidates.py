"""The candidates of one replay: each solution in its own child process.

A solution is a built-in name (:mod:`enginetap.replay.builtin`) or a user's
``module:function``. Each gets its own :class:`ChildFunction`, so that one that crashes, ends
its process or breaks its CUDA context costs its own workload an ERROR row and nothing else:
its process is started again for the next workload, and the other solutions never shared it.

A user's function runs only on the definitions it says it implements
(:func:`enginetap.replay.solution.declared_claim`): every other one is SKIPPED with that
reason, as a built-in's uncovered families are. One that says nothing runs on every
replayed definition, which is only allowed when they are all of one family:
:func:`check_claims` refuses the replay otherwise, before any workload runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from enginetap.definitions.base import family_of
from enginetap.errors import ConfigError
from enginetap.replay.builtin import BuiltinSolution, builtin_named
from enginetap.replay.execution import ChildFunction
from enginetap.replay.fib import FibSolution, read_solution
from enginetap.replay.solution import MODULE_CLAIM

if TYPE_CHECKING:
    from enginetap.dataset.schema import Definition

__all__ = ["Candidate", "check_claims", "close_candidates", "open_candidates"]


@dataclass
class Candidate:
    """One solution and the child process it runs in."""

    name: str
    run: ChildFunction
    builtin: BuiltinSolution | None = None
    fib: FibSolution | None = None
    """A flashinfer-bench Solution file's contents (``--solution x.json``)."""

    @property
    def claim(self) -> tuple[list[str], str] | None:
        """A user's function: the families or definitions it implements, and where it says
        so (None: it does not say, or this is a built-in or a Solution file)."""
        found = self.run.loaded.get("claim")
        return (list(found[0]), str(found[1])) if found else None

    def skip_reason(self, definition: Definition, device: str) -> str | None:
        """Why it is not run on ``definition``: a built-in's family, device or library, a
        Solution file's definition, a user's function's claim."""
        if self.builtin is not None:
            return self.builtin.skip_reason(definition, device)
        if self.fib is not None:
            return self.fib.skip_reason(definition)
        claim = self.claim
        if claim is None or _claimed(claim[0], definition):
            return None
        return (f"{self.name} implements {', '.join(claim[0])} ({claim[1]}), not "
                f"{family_of(definition) or 'a definition without a family'}")


def _claimed(names: list[str], definition: Definition) -> bool:
    return definition.name in names or family_of(definition) in names


def check_claims(candidates: Sequence[Candidate], definitions: Sequence[Definition]) -> None:
    """Refuse user functions that would run on nothing, or on definitions of several
    families without saying which they implement.

    Raises:
        ConfigError: a function claims none of ``definitions``, or claims nothing while
            they span more than one family.
    """
    families = sorted({family_of(d) or "(none)" for d in definitions})
    for c in candidates:
        if c.builtin is not None or c.fib is not None or not definitions:
            continue
        claim = c.claim
        if claim is not None and not any(_claimed(claim[0], d) for d in definitions):
            raise ConfigError(f"{c.name} implements {', '.join(claim[0])} ({claim[1]}), "
                              "which no replayed definition is",
                              f"the families here are {', '.join(families)}",
                              "name one of them (or a definition) in the claim, or replay "
                              "a dataset that holds what the function implements")
        if claim is None and len(families) > 1:
            raise ConfigError(f"{c.name} does not say which definitions it implements",
                              f"this replay covers {len(definitions)} definitions of "
                              f"{len(families)} families ({', '.join(families)}); run on "
                              "the others it could only fail",
                              f"pass --family FAMILY (e.g. --family {families[0]}) or "
                              f"-d DEFINITION, or put {MODULE_CLAIM} = \"FAMILY\" in its "
                              "file (docs/replay.md)")


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
