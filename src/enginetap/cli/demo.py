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
replays PASS, else 1. Workloads captured with inputs only are listed apart. The job, and
what it writes under ``--out``, is :mod:`enginetap.jobs.demo`.
"""

from __future__ import annotations

import shlex
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from enginetap.cli.console import make_console

if TYPE_CHECKING:
    from enginetap.jobs.capture import CaptureResult
    from enginetap.jobs.demo import DemoResult, ModelReplay

__all__ = ["demo"]

console = make_console()


def demo(
    out: Annotated[Path, typer.Option(help="Output directory (made by this command).")] = Path("demo-out"),
    models: Annotated[str, typer.Option(help="Comma list of built-in models.")] = "qwen3_next,deepseek_v3",
    profile: Annotated[str, typer.Option(help="Traffic profile.")] = "builtin:mooncake-tiny",
    max_output_tokens: Annotated[int, typer.Option(min=1)] = 8,
) -> None:
    """Capture real operator workloads from the built-in engine under Mooncake traffic,
    then replay every one against its reference."""
    from enginetap.jobs.demo import DemoJob, run_demo

    names = [m.strip() for m in models.split(",") if m.strip()]
    job = DemoJob(out, names, profile, max_output_tokens,
                  capture_progress=console.is_terminal or "lines",
                  replay_progress=console.is_terminal)
    result = run_demo(job, _Printer(profile))
    console.print(f"[bold]demo {'ok' if result.ok else 'not ok'}[/]: next, "
                  + escape(_hint(result)), soft_wrap=True)
    sys.exit(0 if result.ok else 1)


class _Printer:
    """Prints each step of the demo as it happens (a :class:`~enginetap.jobs.demo.DemoView`)."""

    def __init__(self, profile: str) -> None:
        self.profile = profile

    def building(self, index: int, name: str) -> AbstractContextManager[Any]:
        console.rule(f"[bold]{index}. {escape(name)}[/]")
        return console.status(escape(f"building built-in model {name!r} "
                                     "(cached after the first run)"))

    def captured(self, name: str, root: Path, result: CaptureResult) -> None:
        from enginetap.cli.capture import print_capture

        console.print(f"captured {escape(name)} under {escape(self.profile)}: "
                      f"{result.receipts} requests sent, status {result.status}")
        print_capture(console, root)

    def validated(self, root: Path, problems: list[str]) -> None:
        console.print(f"validate: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        for line in problems:
            console.print(f"  {line}", markup=False, highlight=False)

    def replayed(self, replay: ModelReplay) -> None:
        table = Table(title=f"replay of {escape(str(replay.root))} against the references")
        table.add_column("definition", overflow="fold")
        for column in ("workloads", "verdict", "worst max abs", "note"):
            table.add_column(column)
        for v in replay.verdicts:
            style = {"PASS": "green", "INPUTS ONLY": "yellow"}.get(v.verdict, "red")
            table.add_row(escape(v.name), str(v.workloads), f"[{style}]{v.verdict}[/]",
                          v.worst, escape(v.note))
        console.print(table)


def _hint(result: DemoResult) -> str:
    """The command that replays a user's own kernel on one family of the first dataset,
    with the signature that kernel needs."""
    from enginetap.definitions.base import family_of

    command = f"enginetap replay {shlex.quote(str(result.next_root))}"
    definition = result.next_definition
    if definition is None:
        return f"replay your own kernel: {command} --solution my_kernels.py:fn"
    family = family_of(definition) or ""
    signature = f"fn({', '.join(definition.inputs)}) returning {', '.join(definition.outputs)}"
    return (f"replay your own {family} kernel, {signature} (see `enginetap definitions show "
            f"{family}`, docs/replay.md):\n  {command} --family {family} "
            "--solution my_kernels.py:fn")
