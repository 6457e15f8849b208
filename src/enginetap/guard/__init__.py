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

# Names are imported on first use: arming configs validate guard's options without
# importing torch (enginetap.guard.exact needs it).
_HOMES = {
    "Decision": "exact", "ExactnessError": "exact", "ExactPatch": "exact",
    "describe_key": "keys", "shape_key": "keys",
    "DriftError": "lock", "GuardLock": "lock", "check_lock": "lock", "diff_lock": "lock",
    "pin": "lock", "GuardOptions": "options", "install_configured": "options",
    "RequirementError": "require", "engine_version": "require", "equals": "require",
    "holds": "require", "one_of": "require", "require": "require",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'enginetap.guard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"enginetap.guard.{home}"), name)


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
