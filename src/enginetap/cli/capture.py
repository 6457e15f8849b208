"""``enginetap capture``: real operator workloads from an engine under a traffic profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from enginetap.cli.console import CliConsole, make_console

__all__ = ["capture", "print_capture"]

console = make_console()

DEFAULT_DTYPE = {"builtin": "bfloat16", "vllm": "auto", "sglang": "auto"}


def capture(
    out: Annotated[Path, typer.Option("--out", help="Dataset directory to write.")],
    model: Annotated[str, typer.Option(help="Model directory or builtin:NAME.")] = "builtin:qwen3_next",
    profile: Annotated[str, typer.Option(
        help="Traffic: builtin:NAME (mooncake-tiny, chat-short, agentic-long), mooncake:FILE, "
             "agentx:FILE or a saved profile FILE; `enginetap traffic list` says what each is.")
    ] = "builtin:mooncake-tiny",
    engine: Annotated[str, typer.Option(help="builtin (transformers), vllm or sglang.")
                      ] = "builtin",
    definitions: Annotated[Optional[list[str]], typer.Option(
        "--definitions", help="Families or definition names to capture (repeatable).")] = None,
    policy: Annotated[str, typer.Option(help="Selection policy name.")] = "default",
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size (vLLM).")] = 1,
    max_output_tokens: Annotated[int, typer.Option(min=1)] = 32,
    seed: Annotated[Optional[int], typer.Option(help="Prompt seed (default: the profile's).")] = None,
    append: Annotated[bool, typer.Option(
        "--append", help="--out is an existing dataset: add this run's workloads to it (the "
        "previous run's records move to enginetap/previous/run-N/).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="--out is an existing dataset: start it afresh (its definitions, "
        "workloads, blobs and run records are removed; nothing else).")] = False,
    device: Annotated[Optional[str], typer.Option(
        help="Built-in engine: cpu (default), cuda or cuda:N. vLLM runs where its build does.")
    ] = None,
    dtype: Annotated[Optional[str], typer.Option(
        help="Built-in engine: bfloat16 (default), float32 or float16; "
             "vLLM: auto (default), float32, bfloat16 or float16.")] = None,
) -> None:
    """Drive an engine with traffic while capture is armed; print what was captured."""
    from enginetap.capture.options import POLICIES
    from enginetap.errors import ConfigError
    from enginetap.jobs.capture import CaptureJob, run_capture
    from enginetap.jobs.device import check_device, check_dtype

    if engine not in ("builtin", "vllm", "sglang"):
        raise ConfigError(f"unknown engine {engine!r}", "engines are builtin, vllm and sglang",
                          "pass --engine builtin, vllm or sglang")
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", f"policies are {', '.join(POLICIES)}",
                          "pass one of them with --policy")
    if tp > 1 and engine != "vllm":
        raise ConfigError("--tp needs --engine vllm", "the built-in engine runs one rank",
                          "drop --tp or capture from vLLM")
    if append and force:
        raise ConfigError("--append and --force together", "--append adds to the dataset, "
                          "--force starts it afresh", "pass one of them")
    job = CaptureJob(engine, model, profile, out, list(definitions or []), policy, tp,
                     max_output_tokens, seed, progress=console.is_terminal or "lines",
                     existing="append" if append else "replace" if force else "refuse",
                     device=check_device(device, engine),
                     dtype=check_dtype(dtype, engine, DEFAULT_DTYPE[engine]))
    result = run_capture(job)
    ok = print_capture(console, result.dataset)
    console.print(f"next: enginetap replay {escape(str(result.dataset))}")
    raise typer.Exit(0 if ok and result.status == "complete" else 1)


def print_capture(out: CliConsole, root: Path) -> bool:
    """Print one table per dataset: definitions, workloads, variants, bytes, plus what
    each rank dropped or failed. Returns False when something was lost or failed."""
    import json

    from enginetap.capture.summary import CaptureSummary
    from enginetap.dataset import Dataset

    dataset = Dataset(root)
    table = Table(title=f"captured into {escape(str(root))}")
    table.add_column("definition", overflow="fold")
    for column in ("workloads", "variants", "layers", "bytes"):
        table.add_column(column, justify="right")
    for name in sorted(dataset.definitions()):
        lines = dataset.workloads(name)
        receipts = [l.enginetap.receipt for l in lines if l.enginetap is not None]
        variants = {json.dumps(r.notes.get("variant"), sort_keys=True) for r in receipts}
        layers = {r.layer for r in receipts if r.layer}
        size = sum(dataset.resolve(i.path).stat().st_size for l in lines[:1]
                   for i in l.workload.inputs.values() if getattr(i, "path", None))
        table.add_row(escape(name), str(len(lines)), str(len(variants)), str(len(layers)),
                      f"~{size * len(lines):,}")
    out.print(table)
    ok = True
    for path in sorted((root / "enginetap").glob("capture-summary-rank*.json")):
        summary = CaptureSummary.read(path)
        lost = summary.model_dump(include={"dropped_budget_full", "dropped_after_write_error"})
        for problem in [*(f"{k}: {v}" for k, v in lost.items() if v),
                        *(f"probe {k} disabled: {v}" for k, v in summary.disabled_probes.items()),
                        *([f"write error: {summary.write_error}"] if summary.write_error else [])]:
            ok = False
            out.print(f"[yellow]rank {summary.rank}:[/] {escape(problem)}")
    return ok
