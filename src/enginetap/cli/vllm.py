"""`enginetap vllm`: serve a model with vLLM armed by enginetap; merge per-rank files."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from enginetap.cli.console import make_console
from enginetap.config import capability_names
from enginetap.errors import ConfigError

app = typer.Typer(help="vLLM: serve armed, merge per-rank outputs.", no_args_is_help=True)

out = make_console()
err = make_console(stderr=True)



def _arming(arm: str, out_dir: Path, requests: str):
    from enginetap.config import ArmConfig
    from enginetap.errors import ConfigError

    capabilities = [c.strip() for c in arm.split(",") if c.strip()]
    unknown = sorted(set(capabilities) - set(capability_names()))
    if unknown:
        raise ConfigError(f"unknown capability {', '.join(unknown)}",
                          f"the capabilities are {', '.join(capability_names())}",
                          "pass --arm as a comma list of those, or --arm none")
    if not capabilities:
        return None
    return ArmConfig(enabled=True, capabilities=capabilities, out_dir=out_dir.resolve(),
                     request_filter=requests)


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

    # The server runs in a session of its own: a SIGTERM to us must still stop it.
    signal.signal(signal.SIGTERM, _interrupt)
    config = _arming("" if arm.strip().lower() == "none" else arm, out_dir, requests)
    server = VLLMServer(model_dir, args=list(ctx.args), arm=config, port=port, log_path=log,
                        startup_timeout=timeout)
    with err.status(escape(f"starting vLLM for {model_dir} (log: {server.log_path})")):
        server.start()
    err.print(f"[green]serving[/] {escape(str(model_dir))} at {escape(server.url)} "
              f"({'armed: ' + ', '.join(config.capabilities) if config else 'disarmed'}); "
              f"Ctrl-C stops it")
    out.print(server.url, highlight=False, markup=False)
    try:
        while server.process is not None and server.process.poll() is None:
            time.sleep(1.0)
        err.print(f"[red]the server exited[/]; log tail:\n{escape(server.log_tail())}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("stopping the server")
    finally:
        server.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command("merge")
def merge(
    out_dir: Path = typer.Argument(..., help="Directory holding <name>-rank<r>.jsonl files."),
    name: str = typer.Option("steps.jsonl", "--name", help="Un-ranked file name to merge."),
    to: Optional[Path] = typer.Option(None, "--to", help="Merged file (default: OUT_DIR/NAME)."),
) -> None:
    """Merge per-rank JSONL files into one, ordered by (step, rank); print its path."""
    from enginetap.core.ranks import merge_rank_files, rank_files

    files = rank_files(out_dir / name)
    target = to if to is not None else out_dir / name
    try:
        _refuse_target(target, list(files.values()))
        merged = merge_rank_files(out_dir / name, to)
    except OSError as exc:
        raise ConfigError(f"cannot write the merged file {target}", exc.strerror or str(exc),
                          "pass --to a writable file path with room on its disk") from None
    err.print(f"[green]merged[/] ranks {', '.join(map(str, sorted(files)))}")
    out.print(str(merged), highlight=False, soft_wrap=True, markup=False)


def _refuse_target(target: Path, inputs: list[Path]) -> None:
    """The merged file must not replace one of its inputs, nor a directory."""
    if target.is_dir():
        raise ConfigError(f"--to {target} is a directory", "the merged file is one file",
                          "pass a file path, e.g. --to merged.jsonl")
    for source in inputs:
        if target.resolve() == source.resolve() or (target.exists() and target.samefile(source)):
            raise ConfigError(f"--to {target} is one of the files being merged",
                              "writing it would destroy that rank's records",
                              "pass another --to path")
