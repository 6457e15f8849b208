"""`enginetap traffic`: show and derive traffic profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from enginetap.cli.console import make_console

app = typer.Typer(help="Traffic profiles: real traces, derived requests, rebuilt prompts "
                  "(`enginetap traffic list`: what is built in).",
                  no_args_is_help=True)

out = make_console()
err = make_console(stderr=True)

SPEC_HELP = ("builtin:NAME, mooncake:FILE, agentx:FILE or a saved profile FILE "
             "(`enginetap traffic list` lists the built-ins).")


def _row(table: Table, name: str, req) -> None:
    pred = req.cache_predecessor
    table.add_row(name, str(req.input_tokens), str(req.output_tokens), str(req.block_size),
                  str(len(req.hash_ids)), str(pred.input_tokens) if pred else "-",
                  "-" if req.arrival_s is None else f"{req.arrival_s:.3f}", req.source or "-")


def _print_profile(profile) -> None:
    out.print(f"[bold]{profile.name}[/]  source {profile.source}", highlight=False,
              soft_wrap=True)
    out.print(f"seed {profile.seed}  scale {profile.scale:.6g}", highlight=False)
    table = Table("label", "input", "output", "block", "blocks", "warm", "arrival s",
                  "source")
    for req in profile.requests:
        _row(table, req.label, req)
    for unit in [*profile.overlap_groups, *profile.replays]:
        for member in unit.members:
            _row(table, f"{unit.label}/{member.label}", member)
    out.print(table)
    for note in profile.notes:
        out.print(f"- {note}", highlight=False, markup=False, soft_wrap=True)


@app.command("show")
def show(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", min=2, help="Fit the profile to this many positions."),
    max_output: int = typer.Option(128, "--max-output", min=1,
                                   help="Output-token cap when fitting."),
) -> None:
    """Print a profile's requests, groups and replays."""
    from enginetap.traffic import resolve_profile

    _print_profile(resolve_profile(spec, max_context=max_context, max_output_tokens=max_output))


@app.command("derive")
def derive(
    spec: str = typer.Argument(..., help=SPEC_HELP),
    out_path: Path = typer.Option(..., "--out", help="Profile JSON file to write."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", min=2, help="Fit the profile to this many positions "
        "(e.g. 2048 for the built-in models)."),
    max_output: int = typer.Option(128, "--max-output", min=1,
                                   help="Output-token cap when fitting."),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help="Seed of the prompt "
                                       "rebuilding (default: the profile's own, 0 if derived)."),
) -> None:
    """Derive a profile (percentiles, subagent, auxiliary, reuse, overlap, arrivals); save it."""
    from enginetap.traffic import resolve_profile, save_profile

    _refuse_own_input(spec, out_path)
    profile = resolve_profile(spec, max_context=max_context, max_output_tokens=max_output,
                              seed=seed)
    path = save_profile(profile, out_path)
    err.print(f"[green]wrote[/] {profile.name}: {len(profile.requests)} requests, "
              f"{len(profile.overlap_groups)} overlap groups, {len(profile.replays)} replays, "
              f"scale {profile.scale:.6g}", highlight=False)
    out.print(str(path), highlight=False, soft_wrap=True)


def _refuse_own_input(spec: str, out_path: Path) -> None:
    """``--out`` may not be the file the profile is derived from (by any name)."""
    from enginetap.core.files import same_file
    from enginetap.errors import TrafficError

    kind, _, rest = spec.partition(":")
    if kind == "builtin" and rest:
        return
    source = Path(rest if kind in ("mooncake", "agentx") and rest else spec)
    if same_file(out_path, source):
        raise TrafficError(f"--out {out_path} is the input {source}",
                           "writing the profile there would replace the trace it is derived from",
                           "pass another --out file")


@app.command("list")
def list_builtins() -> None:
    """Built-in traffic profiles, trace formats, the shipped Mooncake sample, and the
    prompt sets and prompt-file format of `enginetap tap run --prompts`."""
    from enginetap.jobs.tap import BUILTIN_PROMPTS, PROMPT_FILES, PROMPTS_ABOUT
    from enginetap.traffic.sources import BUILTIN_PROFILES, PROFILE_ABOUT, packaged_trace_path

    lines = ["built-in traffic profiles (capture --profile builtin:NAME; "
             "`enginetap traffic show builtin:NAME` prints one):"]
    width = max(map(len, [*BUILTIN_PROFILES, *BUILTIN_PROMPTS]))
    lines += [f"  {name:<{width}}  {PROFILE_ABOUT[name]}" for name in BUILTIN_PROFILES]
    lines += ["traces (capture --profile, traffic show/derive):",
              "  mooncake:FILE  a Mooncake JSONL trace: timestamp (ms), input_length, "
              "output_length, hash_ids (512-token blocks) per line",
              "  agentx:FILE    an AgentX shapes JSON file (dataset, revision, profiles, "
              "overlap_profiles)",
              "  FILE           a profile saved by `enginetap traffic derive`",
              f"shipped Mooncake sample (60 lines of the Mooncake FAST'25 conversation trace, "
              f"Apache-2.0): {packaged_trace_path()}",
              "built-in prompt sets (tap run --prompts builtin:NAME):"]
    lines += [f"  {name:<{width}}  {PROMPTS_ABOUT[name]}" for name in BUILTIN_PROMPTS]
    lines += [f"prompt files (tap run --prompts FILE): {PROMPT_FILES}"]
    for line in lines:
        typer.echo(line)
