"""`enginetap definitions`: list operator families, show one instantiated, synthesize data."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from enginetap.cli.console import make_console
from enginetap.errors import ConfigError, EnginetapError

__all__ = ["app"]

app = typer.Typer(help="Operator-definition families (templates).", no_args_is_help=True)
out = make_console()
err = make_console(stderr=True)

SetOption = Annotated[list[str] | None, typer.Option(
    "--set", help="Const axis or param of the family, as name=value (repeatable).")]


def _pairs(items: list[str] | None) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad --set {item!r}", "expected name=value",
                              "pass e.g. --set hidden_size=256")
        pairs[key.strip()] = value.strip()
    return pairs


@app.command("list")
def list_families() -> None:
    """Every registered family: op type, the engines it describes, its example's name."""
    from enginetap.definitions.registry import templates

    table = Table()
    # Names are identifiers to copy: show them whole (folded), never cut with an ellipsis.
    for col in ("family", "op_type", "engines", "example"):
        table.add_column(col, overflow="fold", no_wrap=col in ("family", "op_type"))
    for family, template in sorted(templates().items()):
        try:
            example = template.example_definition().name
        except EnginetapError as exc:
            example = f"(invalid example: {exc})"
        table.add_row(family, template.op_type, ", ".join(template.engines) or "-", example)
    out.print(table)


@app.command()
def show(family: Annotated[str, typer.Argument(help="Family name (see `list`).")],
         set_: SetOption = None) -> None:
    """Print the family's definition JSON: its example, with --set overrides."""
    from enginetap.definitions.registry import get_template
    from enginetap.replay.synth import coerce_values

    template = get_template(family)
    values = {**template.example, **coerce_values(template, _pairs(set_))}
    typer.echo(template.instantiate(**values).model_dump_json(indent=2))


@app.command()
def synth(
    dataset: Annotated[Path, typer.Argument(help="Dataset root (created if missing).")],
    family: Annotated[list[str] | None, typer.Option(
        "--family", "-f", help="Family to synthesize (repeatable).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every registered family.")] = False,
    set_: SetOption = None,
    workloads: Annotated[int, typer.Option(help="Workloads per definition.", min=1)] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the first workload (+1 per workload).")] = 0,
) -> None:
    """Write each family's definition and synthetic workloads (reference outputs as the
    engine's) into DATASET. --set values are checked against each family (types, allowed
    values, constraints, a size budget). A family that fails is reported in one line, leaves
    nothing behind, and the others still run."""
    from enginetap.definitions.registry import templates
    from enginetap.jobs.synth import synthesize_families

    if bool(family) == all_:
        raise ConfigError("say which families", "pass --family F (repeatable) or --all, not both",
                          "see `enginetap definitions list`")
    chosen = sorted(templates()) if all_ else list(dict.fromkeys(family or []))
    failed = 0
    for done in synthesize_families(dataset, chosen, _pairs(set_), workloads=workloads,
                                    seed=seed):
        if done.error is not None:
            failed += 1
            err.print(f"error: {done.family}: {done.error}", markup=False, highlight=False)
        else:
            out.print(f"{done.family}: wrote {done.definition} with {workloads} workload(s)",
                      markup=False, highlight=False)
    sys.exit(1 if failed else 0)
