"""Guard: make out-of-tree engine patches safe to ship.

- :mod:`~enginetap.guard.lock` — pin the engine sources a patch relies on; refuse on drift.
- :mod:`~enginetap.guard.exact` — use a patched implementation only for the keys (shapes)
  where it is proven bit-exact against the stock one, agreed across ranks.
- :mod:`~enginetap.guard.require` — state preconditions; refuse with every failure listed.

See docs/guard.md for the workflow and a worked vLLM example.
"""

from __future__ import annotations

import importlib
from typing import Any

from enginetap.guard.lock import DriftError, GuardLock, check_lock, diff_lock, pin
from enginetap.guard.options import GuardOptions, install_configured
from enginetap.guard.require import (
    RequirementError,
    engine_version,
    equals,
    holds,
    one_of,
    require,
)

# The exactness proof needs torch: imported on first use, so that arming configs can
# validate guard's options without importing torch.
_LAZY = {"Decision": "exact", "ExactnessError": "exact", "ExactPatch": "exact",
         "describe_key": "keys", "shape_key": "keys"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'enginetap.guard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"enginetap.guard.{_LAZY[name]}"), name)


__all__ = [
    "Decision",
    "DriftError",
    "ExactPatch",
    "ExactnessError",
    "GuardLock",
    "GuardOptions",
    "RequirementError",
    "check_lock",
    "describe_key",
    "diff_lock",
    "engine_version",
    "equals",
    "holds",
    "install_configured",
    "one_of",
    "pin",
    "require",
    "shape_key",
]
