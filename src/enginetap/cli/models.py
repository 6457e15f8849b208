"""`enginetap models` commands."""

import typer

app = typer.Typer(help="models", no_args_is_help=True)
