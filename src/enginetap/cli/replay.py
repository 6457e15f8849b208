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
    from enginetap.jobs.replay import select_definitions
    from enginetap.jobs.replay import write_solutions as jobs_write_solutions
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
    definition, left_out = select_definitions(dataset, definition, family)
    if write_solutions is not None:
        for name, count in jobs_write_solutions(write_solutions, dataset, solution or [],
                                                definition):
            out.print(f"{name}: {count} Solution file(s) under {write_solutions / 'solutions'}",
                      markup=False, highlight=False)
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


def _write_json(path: Path, text: str) -> None:
    from enginetap.dataset.atomic import replace_text

    try:
        replace_text(path, text)  # a failed write leaves no truncated report behind
    except OSError as exc:
        raise EnginetapError(f"cannot write the report to {path}", exc.strerror or str(exc),
                             "pass a --json path in a writable directory") from None
