"""``ast.parse`` safe to call from several threads at once.

CPython 3.11 tracks the depth of its AST-to-object conversion in per-interpreter state, so
two threads parsing at the same moment can fail with ``SystemError: AST constructor
recursion depth mismatch`` (CPython gh-106905). enginetap parses in more than one thread:
the engine's thread instantiates definitions (constraint expressions, reference sources)
while capture's writer thread validates the ones it writes. Seen in the suite on Python
3.11.7: a capture probe disabled itself after that error. Every parse in enginetap goes
through :func:`parse`, one at a time; the sources are small and bounded.
"""

from __future__ import annotations

import ast
import threading

__all__ = ["parse"]

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """``ast.parse(source, mode=mode)``, one thread at a time (same errors)."""
    with _LOCK:
        return ast.parse(source, mode=mode)
