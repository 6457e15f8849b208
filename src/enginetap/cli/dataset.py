"""`enginetap dataset` commands."""

import typer

app = typer.Typer(help="dataset", no_args_is_help=True)
