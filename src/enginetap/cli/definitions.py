"""`enginetap definitions` commands."""

import typer

app = typer.Typer(help="definitions", no_args_is_help=True)
