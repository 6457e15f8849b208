"""The replay job's choices beyond :func:`enginetap.replay.replay_dataset`: which of a
dataset's definitions to replay (by name or family, the others listed SKIPPED), and
writing built-in solutions as flashinfer-bench Solution files for a dataset."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from enginetap.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    from enginetap.replay.results import DefinitionResult

__all__ = ["select_definitions", "write_solutions"]


def select_definitions(dataset: Path, names: list[str] | None, families: list[str] | None
                       ) -> tuple[list[str] | None, list[DefinitionResult]]:
    """The definitions to replay (None: all), and those ``families`` leaves out as
    SKIPPED results (listed only when no ``names`` narrow the replay itself).

    Raises:
        ConfigError: a name or family matches nothing in the dataset (the message lists
            what it could have been, closest first), or no definition is both named and
            of a family.
    """
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of
    from enginetap.replay.results import DefinitionResult

    if not names and not families:
        return names, []
    try:
        available = Dataset(dataset).definitions()
    except DatasetError:
        return names, []  # not readable as a dataset: the replay itself reports why
    of = {name: family_of(d) or "(none)" for name, d in available.items()}
    for name in names or []:
        if name not in available:
            raise ConfigError(f"-d {name}: no such definition in {dataset}",
                              f"it could have been {_closest(name, list(available))}",
                              "pass -d with one of those names, or --family FAMILY")
    for wanted in families or []:
        if wanted not in of.values():
            raise ConfigError(f"--family {wanted}: no definition of that family in {dataset}",
                              f"its families are {_closest(wanted, list(of.values()))}",
                              "pass --family with one of those")
    chosen = [n for n in sorted(available)
              if (not names or n in names) and (not families or of[n] in families)]
    if not chosen:
        raise ConfigError("no definition is both named by -d and of a --family",
                          f"-d {' '.join(names or [])} are of families "
                          f"{', '.join(sorted({of[n] for n in names or []}))}",
                          "drop -d or --family, or make them agree")
    skipped = [] if names else [
        DefinitionResult(name=n, status="SKIPPED", message=f"not replayed: its family {of[n]} "
                         f"is not in --family {' '.join(families or [])}")
        for n in sorted(available) if n not in chosen]
    return chosen, skipped


def _closest(wanted: str, names: list[str], shown: int = 12) -> str:
    """``names`` (each once), the most similar to ``wanted`` first: those holding it or held
    in it, then by similarity; the first ``shown`` and a count of the rest."""

    def distance(name: str) -> tuple[bool, float, str]:
        related = wanted.lower() in name.lower() or name.lower() in wanted.lower()
        return (not related, -difflib.SequenceMatcher(None, wanted, name).ratio(), name)

    ordered = sorted(dict.fromkeys(names), key=distance)
    if not ordered:
        return "nothing: the dataset holds no definitions"
    more = f" (+{len(ordered) - shown} more)" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + more


def write_solutions(root: Path, dataset: Path, names: list[str], only: list[str] | None
                    ) -> Iterator[tuple[str, int]]:
    """Write each built-in solution ``names`` as Solution files under ``root/solutions/``
    for the definitions of ``dataset`` it covers (``only``: just those definitions);
    yields each solution's name and how many files it wrote, as it goes.

    Raises:
        ConfigError: no names, or a name that is not a built-in solution (before anything is
            written); a file cannot be written.
    """
    from enginetap.dataset import Dataset
    from enginetap.replay.builtin import builtin_named
    from enginetap.replay.fib import write_builtin_solutions

    builtins = [builtin_named(n) for n in names]
    if not names or None in builtins:
        raise ConfigError("--write-solutions needs built-in --solution names",
                          f"given: {', '.join(names) or 'none'}",
                          "pass e.g. --solution fla:gdn (see --list-solutions)")
    definitions = [d for name, d in sorted(Dataset(dataset).definitions().items())
                   if not only or name in only]
    for builtin in builtins:
        assert builtin is not None  # checked above
        try:
            written = write_builtin_solutions(root, builtin, definitions)
        except OSError as exc:
            raise ConfigError(f"cannot write solutions under {root}", exc.strerror or str(exc),
                              "pass a writable --write-solutions directory") from None
        yield builtin.name, len(written)
