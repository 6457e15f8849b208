"""The ``enginetap`` command line: one sub-command group per capability."""

from __future__ import annotations

import sys

import typer

from enginetap.cli import (capture, dataset, definitions, demo, guard, models, replay, tap,
                           traffic, vllm)
from enginetap.cli.console import make_console
from enginetap.errors import EnginetapError

app = typer.Typer(
    name="enginetap",
    help="See, capture and verify what really runs inside LLM inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(models.app, name="models")
app.add_typer(dataset.app, name="dataset")
app.add_typer(definitions.app, name="definitions")
app.add_typer(replay.app, name="replay")
app.add_typer(guard.app, name="guard")
app.add_typer(vllm.app, name="vllm")
app.add_typer(traffic.app, name="traffic")
app.add_typer(tap.app, name="tap")
app.command("demo")(demo.demo)
app.command("capture")(capture.capture)

err = make_console(stderr=True)


def main() -> None:
    """Console-script entry: boundary errors become one clear message and exit code 2."""
    try:
        # Non-standalone mode returns a command's exit code (typer.Exit) instead of raising.
        rc = app(standalone_mode=False)
    except EnginetapError as exc:
        # The message is plain text: no markup or emoji codes may be read into it.
        err.print("[bold red]error:[/] ", end="")
        err.print(str(exc), markup=False, emoji=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:
        # Usage errors arrive here in non-standalone mode. typer bundles its own copy of
        # click, so match click's exception interface rather than a class.
        if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
