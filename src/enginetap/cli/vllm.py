"""`enginetap vllm`: serve a model with vLLM armed by enginetap; merge per-rank files."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape

from enginetap.cli.console import make_console

if TYPE_CHECKING:
    from enginetap.config import ArmConfig
    from enginetap.engines.vllm.server import VLLMServer

app = typer.Typer(help="vLLM: serve armed, merge per-rank outputs.", no_args_is_help=True)

out = make_console()
err = make_console(stderr=True)


@app.command("serve", context_settings={"allow_extra_args": True,
                                        "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model_dir: Path = typer.Argument(..., help="Model folder (or name) for vLLM's --model."),
    arm: str = typer.Option("step", "--arm", help="Comma list of capabilities to arm "
                            "(step, capture, tap, guard, sp_prefill), or 'none'."),
    out_dir: Path = typer.Option(Path("enginetap-out"), "--out", help="Directory for per-rank "
                                 "output files."),
    requests: str = typer.Option("", "--requests", help="Record only requests whose id "
                                 "contains this."),
    port: Optional[int] = typer.Option(None, "--port", help="Port on 127.0.0.1 (default: free)."),
    log: Optional[Path] = typer.Option(None, "--log", help="Server log file (default: temp)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for /health."),
) -> None:
    """Start vLLM's OpenAI server armed with enginetap; stop it with Ctrl-C or SIGTERM.

    Arguments after the model folder that this command does not know go to vLLM as they
    are, e.g. `enginetap vllm serve ./model --arm step -- --enforce-eager`.
    """
    from enginetap.engines.vllm.server import VLLMServer
    from enginetap.jobs.vllm import serve_arming, serve_until_stopped

    capabilities = [] if arm.strip().lower() == "none" else [
        c.strip() for c in arm.split(",") if c.strip()]
    config = serve_arming(capabilities, out_dir, requests)
    server = VLLMServer(model_dir, args=list(ctx.args), arm=config, port=port, log_path=log,
                        startup_timeout=timeout)
    if not serve_until_stopped(server, _ServePrinter(model_dir, config)):
        raise typer.Exit(1)


class _ServePrinter:
    """Prints what serving does (a :class:`~enginetap.jobs.vllm.ServeView`)."""

    def __init__(self, model_dir: Path, config: ArmConfig | None) -> None:
        self.model_dir, self.config = model_dir, config

    def starting(self, server: VLLMServer) -> AbstractContextManager[Any]:
        return err.status(escape(f"starting vLLM for {self.model_dir} (log: {server.log_path})"))

    def serving(self, server: VLLMServer) -> None:
        config = self.config
        err.print(f"[green]serving[/] {escape(str(self.model_dir))} at {escape(server.url)} "
                  f"({'armed: ' + ', '.join(config.capabilities) if config else 'disarmed'}); "
                  f"Ctrl-C stops it")
        out.print(server.url, highlight=False, markup=False)

    def exited(self, server: VLLMServer) -> None:
        err.print(f"[red]the server exited[/]; log tail:\n{escape(server.log_tail())}")

    def stopping(self) -> None:
        err.print("stopping the server")


@app.command("merge")
def merge(
    out_dir: Path = typer.Argument(..., help="Directory holding <name>-rank<r>.jsonl files."),
    name: str = typer.Option("steps.jsonl", "--name", help="Un-ranked file name to merge."),
    to: Optional[Path] = typer.Option(None, "--to", help="Merged file (default: OUT_DIR/NAME)."),
) -> None:
    """Merge per-rank JSONL files into one, ordered by (step, rank); print its path."""
    from enginetap.jobs.vllm import merge_ranks

    ranks, merged = merge_ranks(out_dir, name, to)
    err.print(f"[green]merged[/] ranks {', '.join(map(str, ranks))}")
    out.print(str(merged), highlight=False, soft_wrap=True, markup=False)
