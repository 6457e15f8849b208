"""`enginetap demo`: the main job on the built-in engine and a built-in tiny model.

1. build (or reuse) a tiny random-weight model;
2. run a batch of requests through the built-in transformers engine, then a request that
   shares a prefix with one of them, and show the step context each step published;
3. write a FlashInfer-Trace dataset of the operator definitions this model runs (plus the
   seed-only families), with synthetic workloads; validate it; replay every definition's
   reference against the stored outputs.

Exit status 0 when the dataset validates and every replay check passes, else 1.

``--out`` is never followed when it is a link. The demo writes only ``OUT/dataset`` and a
marker file listing the files it wrote there; a re-run deletes exactly those (refusing if
anything else has appeared under ``OUT/dataset``) and leaves everything else in ``OUT``
alone. A non-empty directory without that marker is refused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
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
    _write_marker(out, sorted(_tree(dataset)[0]))
    sys.exit(0 if _validate_and_replay(dataset) else 1)


def _fresh_output(out: Path) -> None:
    """Make ``out`` ready: new, empty, or a previous demo output whose own files are removed.

    Raises:
        ConfigError: ``out`` is a link or not a directory, holds data the demo did not write
            (or cannot tell), or cannot be written.
    """
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link", "the demo never writes or deletes "
                          "through a link", "pass the directory it points to, or another --out")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a directory", "", "pass a directory path")
    if out.exists() and any(out.iterdir()):
        _remove_previous(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --out {out}", exc.strerror or str(exc),
                          "pass a writable directory path") from None
    _write_marker(out, None)  # before anything else: a re-run after a crash recognises it


def _write_marker(out: Path, files: list[str] | None) -> None:
    from enginetap.dataset.atomic import replace_text

    text = json.dumps({"made_by": "enginetap demo", "dataset_files": files}, indent=1) + "\n"
    try:
        replace_text(out / MARKER, text)
    except OSError as exc:
        raise ConfigError(f"cannot write {out / MARKER}", exc.strerror or str(exc),
                          "pass a writable --out directory") from None


def _remove_previous(out: Path) -> None:
    """Delete the files a previous demo listed in its marker, and then its empty folders."""
    listed = _listed_files(out)
    dataset = out / "dataset"
    if not dataset.exists() and not dataset.is_symlink():
        return
    files, others = _tree(dataset)
    foreign = sorted(others + [f for f in files if f not in set(listed or [])])
    if listed is None:
        why = f"{dataset} is from a demo run that did not finish (its files are unlisted)"
    elif foreign:
        why = f"{dataset} holds {foreign[0]!r}, which the demo did not write"
    if listed is None or foreign:
        raise ConfigError(f"{out} is not only the demo's own output", why,
                          "move that data elsewhere or pass another --out")
    try:
        for rel in files:
            (dataset / rel).unlink()
        for folder, _, _ in sorted(os.walk(dataset), key=lambda w: -len(w[0])):
            Path(folder).rmdir()
    except OSError as exc:
        raise ConfigError(f"cannot remove the previous demo output in {dataset}",
                          exc.strerror or str(exc), "remove it yourself") from None


def _listed_files(out: Path) -> list[str] | None:
    """The dataset files the marker lists (``None``: not listed); refuses a non-demo folder."""
    marker = out / MARKER
    if marker.is_symlink() or not marker.is_file():
        raise ConfigError(f"{out} exists and was not made by `enginetap demo`",
                          "the demo never deletes data it did not write",
                          "pass another --out, or remove the directory yourself")
    try:
        files = json.loads(marker.read_bytes()).get("dataset_files")
    except (ValueError, AttributeError, OSError):
        return None  # an older demo's marker: it listed nothing
    return files if isinstance(files, list) else None


def _tree(root: Path) -> tuple[list[str], list[str]]:
    """Regular files under ``root`` and everything else (links, FIFOs...), relative; links
    are never followed."""
    if root.is_symlink() or not root.is_dir():
        return [], ["."]
    files, others = [], []
    for folder, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            (files if path.is_file() and not path.is_symlink() else others).append(rel)
    return files, others


def _build(model: str) -> Path:
    from enginetap.models import build_model

    with console.status(escape(f"building built-in model {model!r} (cached after the first run)")):
        path = build_model(model)
    console.print(f"[bold]1. model[/] {escape(model)}: {escape(str(path))}")
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
    console.print(f"[bold]3. dataset[/] {escape(str(root))}: {len(names)} definitions × "
                  f"{workloads} workloads")
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
