"""`enginetap demo`: the main job on the built-in engine and a built-in tiny model.

1. build (or reuse) a tiny random-weight model;
2. run a batch of requests through the built-in transformers engine, then a request that
   shares a prefix with one of them, and show the step context each step published;
3. write a FlashInfer-Trace dataset of the operator definitions this model runs (plus the
   seed-only families), with synthetic workloads; validate it; replay every definition's
   reference against the stored outputs.

Exit status 0 when the dataset validates and every replay check passes, else 1.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from enginetap.errors import ConfigError

__all__ = ["demo"]

console = Console()
MARKER = ".enginetap-demo"
PROMPTS = [
    "The scheduler batches requests so that the kernels stay busy",
    "A prefix cache",
    "Decode steps read the whole KV cache of every request in the batch",
]


def demo(
    out: Annotated[Path, typer.Option(help="Output directory (made by this command).")] = Path("demo-out"),
    model: Annotated[str, typer.Option(help="Built-in model name (`enginetap models list`).")] = "llama",
    workloads: Annotated[int, typer.Option(min=1, help="Synthetic workloads per definition.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 8,
) -> None:
    """Run the built-in engine on a tiny model, then build, validate and replay a dataset."""
    _fresh_output(out)
    model_dir = _build(model)
    _run_engine(model_dir, max_new_tokens)
    dataset = _write_dataset(out / "dataset", model_dir, workloads)
    sys.exit(0 if _validate_and_replay(dataset) else 1)


def _fresh_output(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise ConfigError(f"{out} exists and was not made by `enginetap demo`",
                              "the demo never deletes data it did not write",
                              "pass another --out, or remove the directory yourself")
        shutil.rmtree(out)  # our own previous demo output: datasets are never overwritten
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by enginetap demo\n")


def _build(model: str) -> Path:
    from enginetap.models import build_model

    with console.status(f"building built-in model {model!r} (cached after the first run)"):
        path = build_model(model)
    console.print(f"[bold]1. model[/] {model}: {path}")
    return path


def _run_engine(model_dir: Path, max_new_tokens: int) -> None:
    from enginetap.core.context import Step, subscribe, unsubscribe
    from enginetap.engines.hf import HFEngine, Request

    steps: list[Step] = []
    subscribe(on_begin=steps.append)
    try:
        engine = HFEngine(model_dir)
        batch = [Request(request_id=f"req-{i}", prompt=p, max_new_tokens=max_new_tokens)
                 for i, p in enumerate(PROMPTS)]
        done = engine.generate(batch)
        reuse = Request(request_id="req-prefix", prompt=PROMPTS[0] + " and the cache warm",
                        max_new_tokens=max_new_tokens)
        done += engine.generate([reuse])
    finally:
        unsubscribe(steps.append)
    console.print(f"[bold]2. built-in engine[/] {len(done)} requests, {len(steps)} steps")
    console.print(_steps_table(steps))
    for completion in done:
        console.print(f"  {completion.request_id}: {completion.text!r} ({completion.finish_reason})",
                      markup=False, highlight=False)


def _steps_table(steps: list) -> Table:
    table = Table("step", "mode", "rows", "requests", "positions (first request)",
                  "cached before", title="step context published per engine step")
    for step in steps:
        rows = step.rows
        first = rows.rows_of(rows.request_ids[0])
        positions = [rows.positions[i] for i in first]
        span = f"{positions[0]}..{positions[-1]}" if len(positions) > 1 else str(positions[0])
        table.add_row(str(step.step), step.mode, str(len(rows)),
                      ", ".join(dict.fromkeys(rows.request_ids)), span,
                      str(rows.computed_host[first[0]]))
    return table


def _write_dataset(root: Path, model_dir: Path, workloads: int) -> Path:
    from enginetap.dataset import Dataset
    from enginetap.definitions.catalog import instances_for_model
    from enginetap.definitions.registry import templates
    from enginetap.replay.synth import synthesize

    dataset = Dataset(root, create=True)
    wanted = [(i.template, dict(i.values))
              for i in instances_for_model(model_dir, engine="transformers")]
    # The seed-only families run on no engine here: their small examples show them too.
    wanted += [(t, dict(t.example)) for t in templates().values() if not t.engines]
    with console.status("writing synthetic workloads"):
        names = [synthesize(dataset, t, values, workloads=workloads, seed=i).name
                 for i, (t, values) in enumerate(wanted)]
    console.print(f"[bold]3. dataset[/] {root}: {len(names)} definitions × {workloads} workloads")
    return root


def _validate_and_replay(root: Path) -> bool:
    from enginetap.dataset import validate_dataset
    from enginetap.replay import replay_dataset
    from enginetap.replay.report import print_report, summary_line

    problems = validate_dataset(root)
    console.print(f"[bold]4. validate[/] {'ok' if not problems else f'{len(problems)} problem(s)'}")
    for line in problems:
        console.print(f"  {line}", markup=False, highlight=False)
    report = replay_dataset(root, progress=console.is_terminal)
    print_report(console, report)
    console.print(f"[bold]5. replay[/] {summary_line(report)}")
    return report.ok and not problems
