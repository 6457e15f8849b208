"""`enginetap dataset` commands: validate a FlashInfer-Trace dataset, show what it holds.

Everything printed comes from data (names, paths): it is printed as plain text, never read
as rich markup, so a name like ``rms[/]norm`` or a root like ``runs/[exp1]/ds`` shows as is,
and with terminal control characters escaped (:func:`~enginetap.dataset.printable.printable`).
"""

from __future__ import annotations

import sys

import typer
from rich.table import Table
from rich.text import Text

from enginetap.cli.console import make_console
from enginetap.dataset import summarize_dataset, validate_dataset
from enginetap.dataset.printable import printable

app = typer.Typer(help="Validate and inspect FlashInfer-Trace datasets.", no_args_is_help=True)

# A str, not a Path: Path("") would silently become the current directory.
_PATH = typer.Argument(..., help="Dataset root (holds definitions/, workloads/, blob/).")


@app.command("validate")
def validate(path: str = _PATH) -> None:
    """Check every definition, workload line and blob; list each problem on its own line.

    Exits 0 when the dataset is valid, 1 when it has problems, 2 when PATH is not a dataset
    (empty, missing, or a directory holding none of definitions/, workloads/, blob/).
    """
    problems = validate_dataset(path)
    if problems:
        for problem in problems:
            typer.echo(printable(problem))  # plain echo: one line per problem, never wrapped
        typer.echo(f"{len(problems)} problem(s) in {printable(path)}", err=True)
        # sys.exit rather than typer.Exit: the console entry runs the app in non-standalone
        # mode, where typer.Exit becomes a return value and the exit code would be lost.
        sys.exit(1)
    summaries = summarize_dataset(path)
    workloads = sum(s.workloads for s in summaries)
    with_outputs = sum(s.with_outputs for s in summaries)
    typer.echo(f"OK {printable(path)}: {len(summaries)} definition(s), {workloads} workload(s), "
               f"{with_outputs} with engine outputs")


@app.command("show")
def show(path: str = _PATH) -> None:
    """Show, per definition, its workloads, size on disk, variants and engine outputs.

    Exits 2 when PATH is not a dataset.
    """
    summaries = summarize_dataset(path)
    console = make_console()
    if not summaries:
        console.print(f"no definitions in {printable(path)}", markup=False, highlight=False)
        return
    table = Table(title=Text(printable(path)))
    for column in ("definition", "op_type"):
        table.add_column(column, overflow="fold")  # names must stay whole to be usable
    for column in ("workloads", "size", "variants", "with outputs"):
        table.add_column(column, justify="right")
    for s in summaries:
        table.add_row(Text(printable(s.name)), Text(printable(s.op_type)), str(s.workloads),
                      human_bytes(s.bytes), str(s.variants), str(s.with_outputs))
    console.print(table)


def human_bytes(count: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; counts below 1 KiB are shown exactly."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, index = float(count), 0
    while size >= 1024 and index < len(units) - 1:
        size, index = size / 1024, index + 1
    return f"{count} B" if index == 0 else f"{size:.1f} {units[index]}"
