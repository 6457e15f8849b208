"""`enginetap replay` commands."""

import typer

app = typer.Typer(help="replay", no_args_is_help=True)
