"""`enginetap replay DATASET`: check stored engine outputs (and a candidate) against references.

Exit status: 0 when every check passed, 1 when anything failed, errored or was refused or
the dataset has problems, 2 (from ``enginetap.cli.main``) when the options are unusable.
The status is set with ``sys.exit``: under ``standalone_mode=False`` (how
``enginetap.cli.main`` runs the app) click returns a ``typer.Exit`` code instead of exiting.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from enginetap.cli.console import make_console
from enginetap.errors import EnginetapError

__all__ = ["app"]


class _CommandGroup(TyperGroup):
    """A group that is really one command: options may follow the argument, no COMMAND."""

    allow_interspersed_args = True

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [piece for piece in super().collect_usage_pieces(ctx)
                if piece != self.subcommand_metavar]


app = typer.Typer(cls=_CommandGroup, invoke_without_command=True, no_args_is_help=True)

out = make_console()
err = make_console(stderr=True)


@app.callback()
def replay(
    dataset: Annotated[Path | None, typer.Argument(
        metavar="DATASET", help="Dataset root directory.", show_default=False)] = None,
    definition: Annotated[list[str] | None, typer.Option(
        "--definition", "-d", help="Replay only this definition (repeatable).")] = None,
    family: Annotated[list[str] | None, typer.Option(
        "--family", "-f", help="Replay only this family's definitions (repeatable); the "
        "others are listed SKIPPED. What a --solution function implements.")] = None,
    solution: Annotated[list[str] | None, typer.Option(
        help="Candidate to check and time (repeatable): a built-in name (see "
             "--list-solutions), module:function or path/file.py:function.")] = None,
    list_solutions: Annotated[bool, typer.Option(
        "--list-solutions", help="List the built-in solutions and exit.")] = False,
    write_solutions: Annotated[Path | None, typer.Option(
        help="Write each built-in --solution as flashinfer-bench Solution files for the "
             "dataset's definitions it covers, under DIR/solutions/, and exit.")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write the full report (JSON) here.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    warmup: Annotated[int, typer.Option(help="Untimed runs before timing.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed runs; the median is reported.")] = 3,
    timeout: Annotated[float, typer.Option(
        help="Seconds importing, and then one call of, a --solution or reference may "
             "take, warm-up and timed runs included, before its process is killed and the "
             "workload reported as an ERROR; 0: no limit.")] = 600.0,
    memory_limit: Annotated[float | None, typer.Option(
        help="GiB one call of a --solution or reference may allocate, and a workload may "
             "expand to (its tensors plus the pages it gathers); default: half of this "
             "machine's memory; 0: no limit.", show_default=False)] = None,
    trust_dataset_code: Annotated[bool, typer.Option(
        "--trust-dataset-code",
        help="Also run references enginetap did not generate (executes dataset code).")] = False,
) -> None:
    """Run each definition's reference on the stored inputs and compare with the engine's
    outputs (and with --solution's); exit 1 if anything does not pass."""
    from enginetap.replay import replay_dataset
    from enginetap.replay.render import (
        print_report, render_summary, summary_line, summary_notes,
    )

    if list_solutions:
        out.print(_solutions_table())
        sys.exit(0)
    if dataset is None:
        raise EnginetapError("no dataset given", "replay needs a dataset root",
                             "pass DATASET, or --list-solutions to see the built-in solutions")
    definition, left_out = _select(dataset, definition, family)
    if write_solutions is not None:
        _write_solutions(write_solutions, dataset, solution or [], definition)
        sys.exit(0)
    report = replay_dataset(dataset, definitions=definition, solution=solution,
                            trust_dataset_code=trust_dataset_code, device=device,
                            warmup=warmup, repeats=repeats,
                            timeout=timeout if timeout != 0 else None,
                            memory_limit=_memory_limit(memory_limit),
                            progress=err.is_terminal)
    report.definitions += left_out
    shown = _printable(report)  # dataset names may hold terminal escape sequences
    print_report(out, shown)
    summary = render_summary(shown)
    if summary is not None:
        out.print(summary)
    for note in summary_notes(shown):
        out.print(note, markup=False, highlight=False, soft_wrap=True)
    out.print(summary_line(shown), markup=False, highlight=False)
    if json_path is not None:
        _write_json(json_path, report.model_dump_json(indent=2) + "\n")
    sys.exit(0 if report.ok else 1)


def _select(dataset: Path, names: list[str] | None, families: list[str] | None
            ) -> tuple[list[str] | None, list[Any]]:
    """The definitions to replay (None: all), and those ``--family`` leaves out as
    SKIPPED results (listed only when no ``-d`` narrows the replay itself).

    Raises:
        ConfigError: a ``-d`` name or ``--family`` matches nothing in the dataset (the
            message lists what it could have been, closest first).
    """
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of
    from enginetap.errors import ConfigError, DatasetError
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
    import difflib

    def distance(name: str) -> tuple[bool, float, str]:
        related = wanted.lower() in name.lower() or name.lower() in wanted.lower()
        return (not related, -difflib.SequenceMatcher(None, wanted, name).ratio(), name)

    ordered = sorted(dict.fromkeys(names), key=distance)
    if not ordered:
        return "nothing: the dataset holds no definitions"
    more = f" (+{len(ordered) - shown} more)" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + more


def _printable(report: Any) -> Any:
    """A copy of ``report`` for the terminal: every string with its control characters
    escaped (the ``--json`` report keeps them exact; JSON escapes them itself)."""
    from enginetap.dataset.printable import printable

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return printable(value)
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        return value

    return type(report).model_validate(clean(report.model_dump()))


def _memory_limit(gib: float | None) -> int | None | str:
    if gib is None:
        return "auto"
    if gib < 0:
        raise EnginetapError(f"bad --memory-limit {gib:g}", "it is a size in GiB",
                             "pass e.g. --memory-limit 8, or 0 for no limit")
    return int(gib * 2**30) if gib else None


def _solutions_table() -> Any:
    from rich.table import Table

    from enginetap.replay.builtin import BUILTINS

    table = Table(title="built-in solutions (--solution NAME)", title_justify="left")
    for col in ("name", "families", "devices", "installed", "library"):
        table.add_column(col)
    for b in BUILTINS:
        missing = [m for m in b.modules if importlib.util.find_spec(m) is None]
        table.add_row(b.name, "\n".join(b.adapters), "/".join(b.devices),
                      "yes" if not missing else f"no ({', '.join(missing)})",
                      f"{b.library}: {b.summary}")
    return table


def _write_solutions(root: Path, dataset: Path, names: list[str],
                     only: list[str] | None) -> None:
    from enginetap.dataset import Dataset
    from enginetap.errors import ConfigError
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
        out.print(f"{builtin.name}: {len(written)} Solution file(s) under {root / 'solutions'}",
                  markup=False, highlight=False)


def _write_json(path: Path, text: str) -> None:
    from enginetap.dataset.atomic import replace_text

    try:
        replace_text(path, text)  # a failed write leaves no truncated report behind
    except OSError as exc:
        raise EnginetapError(f"cannot write the report to {path}", exc.strerror or str(exc),
                             "pass a --json path in a writable directory") from None
