"""`enginetap models`: list and build the built-in tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from enginetap.cli.console import make_console
from enginetap.errors import ConfigError

app = typer.Typer(help="Built-in tiny models (random weights, real architectures).",
                  no_args_is_help=True)

out = make_console()
err = make_console(stderr=True)


@app.command("list")
def list_models() -> None:
    """List the built-in models, their architecture and whether they are cached."""
    from enginetap.models import MODEL_NAMES, default_model_dir, model_config
    from enginetap.models.builder import is_complete

    table = Table("name", "architecture", "layers", "cached at")
    for name in MODEL_NAMES:
        config = model_config(name)
        folder = default_model_dir(name)
        cached = str(folder) if is_complete(folder, name, 0) else "-"
        table.add_row(name, config["architectures"][0], str(config["num_hidden_layers"]),
                      escape(cached))
    out.print(table)


@app.command("build")
def build(
    name: str = typer.Argument(..., help="Built-in model name (see `enginetap models list`)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Folder to build into "
                                           "(default: the cache under $ENGINETAP_CACHE)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the random weights."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a complete build exists."),
) -> None:
    """Build a model folder that transformers and vLLM load; print its path."""
    from safetensors import SafetensorError

    from enginetap.models import build_model

    with err.status(escape(f"building {name} (seed {seed})")) as status:
        try:
            path = build_model(name, out_dir=out_dir, seed=seed, force=force,
                               progress=lambda label: status.update(escape(f"{name}: {label}")))
        except (OSError, SafetensorError) as exc:  # safetensors reports a full disk itself
            # The builder works in a scratch folder it removes on failure: nothing is left.
            where = out_dir if out_dir is not None else "the model cache"
            why = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"cannot build {name} in {where}", why,
                              "pass --out a writable directory with room on its disk") from None
    err.print(f"[green]built[/] {escape(name)} (seed {seed})")
    out.print(str(path), highlight=False, soft_wrap=True, markup=False)
