"""Which checkpoints two same-prefix rows must agree on (one rule for every analysis).

Rows of different requests at the same position with the same token prefix computed the
same function of the same tokens, except where a checkpoint reads more than the prefix:

- ``kv_prev`` at position 0 re-reads a padding column, not the request's;
- a recurrent state (``state_``/``conv_`` ``before``/``after``) covers every token of its
  request up to the step's start or end, so it is comparable only between the requests'
  last rows of the step, and only where both had computed as many tokens before it;
  before a request's first token its state slot holds nothing of the request (an engine
  that reuses slots leaves a finished request's state there), so ``before`` states are
  not compared at a request's first step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PER_REQUEST", "comparable", "compared", "last_of_request"]

PER_REQUEST = (".state_before", ".state_after", ".conv_before", ".conv_after")
_BEFORE = (".state_before", ".conv_before")


def compared(name: str, position: int) -> bool:
    """Whether checkpoint ``name`` is comparable between same-prefix rows at ``position``
    (the previous KV column of position 0 is padding, not the request's)."""
    return not (position == 0 and name.split("#")[0].endswith(".kv_prev"))


def comparable(name: str, a: dict[str, Any], b: dict[str, Any], both_last: bool) -> bool:
    """Whether same-prefix rows ``a`` and ``b`` must agree on checkpoint ``name``
    (``both_last``: each is its request's last row in the step)."""
    if not compared(name, a["pos"]):
        return False
    base = name.split("#")[0]
    if base.endswith(PER_REQUEST):
        fresh = base.endswith(_BEFORE) and a["computed_host"] == 0
        return both_last and a["computed_host"] == b["computed_host"] and not fresh
    return True


def last_of_request(rows: list[dict[str, Any]]) -> set[int]:
    """Indices of each request's last row (rows of a request are in position order)."""
    return set({row["key"]: i for i, row in enumerate(rows)}.values())
