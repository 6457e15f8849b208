"""`enginetap guard` commands: pin engine sources into a lock file, check them for drift.

Targets are imported and read in a child process (:class:`enginetap.guard.lock.IsolatedReader`):
a module that exits while imported is reported as unreadable, never ends the command with
its own exit code. Everything printed is plain text (no rich markup read from paths or names).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from enginetap.cli.console import make_console

app = typer.Typer(help="Pin the engine code a patch relies on and check it for drift.",
                  no_args_is_help=True)

out = make_console(highlight=False, emoji=False, soft_wrap=True)

PathOption = Annotated[Path, typer.Option("--output", "-o", help="Lock file to write.")]
SysPath = Annotated[list[Path], typer.Option(
    "--path", "-p", help="Directory to put on sys.path before importing targets (repeatable).")]


def _extend_sys_path(paths: list[Path]) -> None:
    for path in reversed(paths):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


@app.command()
def pin(
    targets: Annotated[list[str], typer.Argument(
        help="Targets 'package.module:Qualname' (function, method, class, property, triton JIT).")],
    output: PathOption = Path("guard.lock"),
    path: SysPath = [],  # noqa: B006 (typer reads the default, never mutates it)
) -> None:
    """Hash each target's source and record its package version in a lock file."""
    from enginetap.guard.lock import IsolatedReader
    from enginetap.guard.lock import pin as pin_targets

    _extend_sys_path(path)
    with IsolatedReader() as reader:
        lock = pin_targets(targets, read=reader)
    lock.save(output)
    for entry in lock.entries:
        where = f"{entry.distribution} {entry.version}" if entry.distribution else "no distribution"
        out.print(f"pinned {entry.target} ({entry.kind}) {entry.digest[:16]} ({where})",
                  markup=False)
    out.print(f"wrote {output} ({len(lock.entries)} target(s), {lock.algorithm})", markup=False)


@app.command()
def check(
    lock: Annotated[Path, typer.Argument(help="Lock file written by 'enginetap guard pin'.")],
    path: SysPath = [],  # noqa: B006
) -> None:
    """Exit 1 listing every target that changed, vanished or cannot be read."""
    from enginetap.guard.lock import GuardLock, IsolatedReader, diff_lock

    _extend_sys_path(path)
    loaded = GuardLock.load(lock)
    with IsolatedReader() as reader:
        drifts = diff_lock(loaded, read=reader)
    for drift in drifts:
        out.print(f"DRIFT {drift}", style="red", markup=False)
    if drifts:
        out.print(f"{len(drifts)} of {len(loaded.entries)} target(s) drifted from {lock}",
                  markup=False)
        raise typer.Exit(1)
    out.print(f"ok: {len(loaded.entries)} target(s) match {lock}", markup=False)
