"""`enginetap guard` commands."""

import typer

app = typer.Typer(help="guard", no_args_is_help=True)
