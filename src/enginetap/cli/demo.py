"""`enginetap demo`: the main job — capture from a real engine, then replay.

1. build (or reuse) the built-in tiny models qwen3_next (gated delta rule + gated
   attention + MoE) and deepseek_v3 (MLA + grouped-sigmoid MoE);
2. drive the built-in transformers engine on each with traffic derived from the Mooncake
   conversation trace shipped with enginetap (context percentiles, a subagent, an
   auxiliary call, a fully reused prefix warmed by its predecessor, an overlapping group,
   arrivals replayed), capture every operator the probes cover into one FlashInfer-Trace
   dataset per model, and print what was captured;
3. validate each dataset and replay every captured workload against its definition's
   reference, printing one verdict per definition.

Exit status 0 when every dataset validates and every workload that carries engine outputs
replays PASS, else 1. Workloads captured with inputs only (the built-in engine computes
MLA un-absorbed, so it never produces the MLA definitions' output) are listed apart.

``--out`` is never followed when it is a link. The demo writes only ``OUT/dataset`` and a
marker file listing the files it wrote there; a re-run deletes exactly those (refusing if
anything else has appeared under ``OUT/dataset``) and leaves everything else in ``OUT``
alone. A non-empty directory without that marker is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from enginetap.cli.console import make_console
from enginetap.errors import ConfigError

__all__ = ["demo"]

console = make_console()
MARKER = ".enginetap-demo"


def demo(
    out: Annotated[Path, typer.Option(help="Output directory (made by this command).")] = Path("demo-out"),
    models: Annotated[str, typer.Option(help="Comma list of built-in models.")] = "qwen3_next,deepseek_v3",
    profile: Annotated[str, typer.Option(help="Traffic profile.")] = "builtin:mooncake-tiny",
    max_output_tokens: Annotated[int, typer.Option(min=1)] = 8,
) -> None:
    """Capture real operator workloads from the built-in engine under Mooncake traffic,
    then replay every one against its reference."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    _fresh_output(out)
    ok = True
    for index, name in enumerate(names, 1):
        root = out / "dataset" / name
        _capture(name, root, profile, max_output_tokens, index)
        ok = _validate_and_replay(root) and ok
        _write_marker(out, sorted(_tree(out / "dataset")[0]))
    console.print(f"[bold]demo {'ok' if ok else 'not ok'}[/]: next, "
                  + escape(_hint(out / "dataset" / names[0])), soft_wrap=True)
    sys.exit(0 if ok else 1)


def _hint(root: Path) -> str:
    """The command that replays a user's own kernel on one family of ``root``, with the
    signature that kernel needs (an rmsnorm if the dataset has one: the simplest)."""
    from enginetap.dataset import Dataset
    from enginetap.dataset.schema import Definition
    from enginetap.definitions.base import family_of

    first: dict[str, Definition] = {}
    for _, definition in sorted(Dataset(root).definitions().items()):
        first.setdefault(family_of(definition) or "", definition)
    family = min(first, key=lambda f: (f != "rmsnorm", "rmsnorm" not in f, f), default="")
    command = f"enginetap replay {shlex.quote(str(root))}"
    if not family:
        return f"replay your own kernel: {command} --solution my_kernels.py:fn"
    definition = first[family]
    signature = f"fn({', '.join(definition.inputs)}) returning {', '.join(definition.outputs)}"
    return (f"replay your own {family} kernel, {signature} (see `enginetap definitions show "
            f"{family}`, docs/replay.md):\n  {command} --family {family} "
            "--solution my_kernels.py:fn")


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


def _capture(name: str, root: Path, profile: str, max_output_tokens: int, index: int) -> None:
    from enginetap.cli.capture import print_capture
    from enginetap.jobs.capture import CaptureJob, run_capture

    console.rule(f"[bold]{index}. {escape(name)}[/]")
    with console.status(escape(f"building built-in model {name!r} (cached after the first run)")):
        from enginetap.models import build_model

        build_model(name)
    job = CaptureJob("builtin", f"builtin:{name}", profile, root, policy="default",
                     max_output_tokens=max_output_tokens,
                     progress=console.is_terminal or "lines")
    result = run_capture(job)
    console.print(f"captured {escape(name)} under {escape(profile)}: {result.receipts} requests "
                  f"sent, status {result.status}")
    print_capture(console, root)


def _validate_and_replay(root: Path) -> bool:
    from enginetap.dataset import validate_dataset
    from enginetap.replay import replay_dataset

    problems = validate_dataset(root)
    console.print(f"validate: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    for line in problems:
        console.print(f"  {line}", markup=False, highlight=False)
    report = replay_dataset(root, progress=console.is_terminal)
    table = Table(title=f"replay of {escape(str(root))} against the references")
    table.add_column("definition", overflow="fold")
    for column in ("workloads", "verdict", "worst max abs", "note"):
        table.add_column(column)
    ok = not problems
    for result in report.definitions:
        verdict, note, worst = _verdict(result)
        ok = ok and verdict in ("PASS", "INPUTS ONLY")
        style = {"PASS": "green", "INPUTS ONLY": "yellow"}.get(verdict, "red")
        table.add_row(escape(result.name), str(len(result.workloads)),
                      f"[{style}]{verdict}[/]", worst, escape(note))
    console.print(table)
    return ok


def _unexposed(checks) -> str:
    from enginetap.replay.results import NOT_EXPOSED

    names = dict.fromkeys(c.output for c in checks if c.message == NOT_EXPOSED)
    return f"{', '.join(names)}: not exposed by this engine" if names else ""


def _verdict(result) -> tuple[str, str, str]:
    """One verdict per definition: PASS, INPUTS ONLY (nothing stored to compare), or the
    worst status with the first reason."""
    checks = [c for w in result.workloads for c in w.checks]
    errors = [c.comparison.max_abs_error for c in checks
              if c.comparison is not None and c.comparison.max_abs_error is not None]
    worst = f"{max(errors):.3g}" if errors else "-"
    if result.status == "PASS":
        return "PASS", _unexposed(checks), worst
    reasons = [c.message or "" for c in checks if c.status != "PASS"] + [
        w.message or "" for w in result.workloads if w.status != "PASS" and not w.checks]
    if reasons and all(r.startswith("nothing compared") for r in reasons):
        return "INPUTS ONLY", "engine exposes no output", worst
    return result.status, next((r for r in reasons if r), result.message or ""), worst
