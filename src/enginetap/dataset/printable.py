"""Dataset strings made safe to print on a terminal.

Names, uuids and paths in a dataset are untrusted: a name holding ``ESC ]0;...`` or
``ESC [2J`` would retitle or clear the user's terminal when printed, a bidi override
(``U+202E``) would show text other than what is there, and a newline would split a
one-line message. :func:`printable` writes every such character as its Python escape
(``\\x1b``, ``\\u202e``, ``\\n``), visibly and reversibly; everything else is kept as is.
"""

from __future__ import annotations

import unicodedata

__all__ = ["printable"]

# Cc: C0/C1 controls (ESC, BEL, CR, NL...); Cf: format characters (bidi overrides,
# zero-width joiners); Zl/Zp: line and paragraph separators; Cs/Co/Cn: surrogates, private
# use and unassigned code points, which terminals render unpredictably.
_HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


def printable(text: str) -> str:
    """``text`` with every control, format or separator character escaped."""
    if text.isprintable():  # the common case: nothing to do (isprintable is False for all above)
        return text
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN else c for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
