"""The CLI's console: plain full-width text outside a terminal, rich inside one."""

from __future__ import annotations

import io

import pytest
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from enginetap.cli.console import make_console

LONG = "work/my_kernels.py:rms_good_with_a_name_longer_than_any_terminal_is_wide" * 2


def _table() -> Table:
    table = Table(title=f"[bold]replay of[/] {escape('[exp1]/ds')}", caption="2 pair(s) not shown")
    table.add_column("solution")
    table.add_column("status")
    table.add_column("max abs", justify="right")
    table.add_column("note")
    table.add_row(escape(LONG), "[green]PASS[/]", "0", Text("rms[/]norm"))
    table.add_row("torch:flex", "[red]FAIL[/]", "0.0469", "two\nlines")
    return table


@pytest.fixture
def piped(monkeypatch: pytest.MonkeyPatch) -> tuple[object, io.StringIO]:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("FORCE_TERMINAL", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    buffer = io.StringIO()
    return make_console(file=buffer), buffer


def test_a_table_in_a_pipe_is_plain_aligned_and_whole(piped) -> None:
    console, buffer = piped
    console.print(_table())
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "replay of [exp1]/ds"  # markup read as rich reads it, escapes kept
    header, dashes, first, second, third, caption = lines[1:]
    width = len(LONG)
    assert header == f"{'solution'.ljust(width)}  status  max abs  note"
    assert dashes == f"{'-' * width}  ------  -------  ----------"
    assert first == f"{LONG}  PASS          0  rms[/]norm"
    assert second == f"{'torch:flex'.ljust(width)}  FAIL     0.0469  two"
    assert third == f"{' ' * width}                   lines"
    assert caption == "2 pair(s) not shown"
    assert "…" not in buffer.getvalue() and "\x1b" not in buffer.getvalue()


def test_text_status_and_rule_in_a_pipe_are_single_plain_lines(piped) -> None:
    console, buffer = piped
    command = f"enginetap replay {LONG} --family rmsnorm --solution my_kernels.py:fn"
    console.print(f"[bold]demo ok[/]: next, {escape(command)}")
    with console.status("building [b]llama[/]") as status:
        status.update("training tokenizer")
    console.rule("[bold]1. llama[/]")
    assert buffer.getvalue().splitlines() == [
        f"demo ok: next, {command}", "building llama ...", "training tokenizer ...",
        "== 1. llama =="]


def test_a_terminal_or_a_width_asked_for_keeps_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    buffer = io.StringIO()
    make_console(file=buffer).print(_table())
    assert "┃" in buffer.getvalue() or "│" in buffer.getvalue()
    monkeypatch.delenv("COLUMNS")
    buffer = io.StringIO()
    make_console(file=buffer, force_terminal=True, width=60).print(_table())
    assert "…" in buffer.getvalue() or "│" in buffer.getvalue()  # rich's own layout
