"""The one console every command prints through: rich in a terminal, plain text in a pipe.

In a terminal, tables are rich tables fitted to the window and ``status`` shows a spinner.
Anywhere else (a pipe, a log file, a CI job) rich would lay everything out at 80 columns
and cut cells with an ellipsis: statuses become ``P…``, two candidates ``my_kernels.py:rms_…``
look alike, a printed command breaks in the middle. So when the output is not a terminal
and ``COLUMNS`` is unset, a :class:`CliConsole` prints

- a table as plain aligned columns, each as wide as its widest cell (nothing cut, no box
  characters, no colour), with its title above and its caption below;
- text without wrapping or cropping: one logical line stays one line;
- ``status(message)`` and ``rule(title)`` as one plain line each, so long work leaves a
  trace in the log instead of a spinner that never shows.

``COLUMNS`` set (a width asked for) or ``FORCE_TERMINAL`` keeps rich's layout.
"""

from __future__ import annotations

import os
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["CliConsole", "make_console", "plain_table"]

_GAP = "  "


class CliConsole(Console):
    """A rich :class:`Console` that prints plain full-width text when not in a terminal."""

    @property
    def plain(self) -> bool:
        """True when output goes to a pipe or file and no width was asked for."""
        return not self.is_terminal and not os.environ.get("COLUMNS")

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if not self.plain:
            super().print(*objects, **kwargs)
            return
        kwargs["soft_wrap"] = True  # never wrapped nor cropped at 80 columns
        shown = [Text(plain_table(self, o)) if isinstance(o, Table) else o for o in objects]
        super().print(*shown, **kwargs)

    def rule(self, title: Any = "", **kwargs: Any) -> None:  # type: ignore[override]
        if not self.plain:
            super().rule(title, **kwargs)
            return
        text = _plain(self, title)
        super().print(Text(f"== {text} ==" if text else "=="), soft_wrap=True)

    def status(self, status: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if not self.plain:
            return super().status(status, **kwargs)
        return _LineStatus(self, status)


class _LineStatus:
    """``Console.status`` outside a terminal: each message once, as a line."""

    def __init__(self, console: CliConsole, message: Any) -> None:
        self.console = console
        self.update(message)

    def update(self, status: Any = None, **_: Any) -> None:
        if status is not None:
            Console.print(self.console, Text(_plain(self.console, status) + " ..."),
                          soft_wrap=True)

    def __enter__(self) -> _LineStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def make_console(*, stderr: bool = False, **kwargs: Any) -> CliConsole:
    """A console for stdout (or stderr): rich in a terminal, plain full-width text elsewhere."""
    return CliConsole(stderr=stderr, **kwargs)


def plain_table(console: Console, table: Table) -> str:
    """``table`` as plain text: title, header, a dashed line, rows, caption.

    Columns are as wide as their widest cell and two spaces apart; right-justified columns
    stay right-justified; a cell holding several lines takes several lines. Markup in cells
    is read as rich would read it and dropped; nothing is ever cut.
    """
    columns = table.columns
    cells = [[_plain(console, c).split("\n") for c in column.cells] for column in columns]
    header = [_plain(console, c.header) for c in columns] if table.show_header else None
    widths = [max([cell_len(line) for cell in col for line in cell]
                  + [cell_len(header[i]) if header else 0]) for i, col in enumerate(cells)]
    lines = [_plain(console, table.title)] if table.title else []
    if header is not None:
        lines.append(_join(header, widths, columns))
        lines.append(_join(["-" * w for w in widths], widths, columns))
    for row in range(table.row_count):
        parts = [col[row] if row < len(col) else [""] for col in cells]
        for depth in range(max(len(p) for p in parts)):
            lines.append(_join([p[depth] if depth < len(p) else "" for p in parts],
                               widths, columns))
    if table.caption:
        lines.append(_plain(console, table.caption))
    return "\n".join(lines)


def _join(values: list[str], widths: list[int], columns: list[Any]) -> str:
    padded = []
    for value, width, column in zip(values, widths, columns):
        pad = " " * (width - cell_len(value))
        padded.append(pad + value if column.justify == "right" else value + pad)
    return _GAP.join(padded).rstrip()


def _plain(console: Console, renderable: Any) -> str:
    if isinstance(renderable, Text):
        return renderable.plain
    if isinstance(renderable, str):
        return console.render_str(renderable).plain
    return "" if renderable is None else str(renderable)
