"""The ``guard`` capability: import and call each configured guard patch.

Each ``options.guard.patches`` entry (``"module:function"``) installs its own patches and
may return an object with ``uninstall()``. One broken patch (its import fails, its lock
drifted, a precondition fails) is logged and skipped: the engine serves its stock path.
A patch reads the guard options through
:func:`~enginetap.core.capability.current_arming`, never the environment.
"""

from __future__ import annotations

import logging

from enginetap.core.capability import ArmContext, InstalledGroup, InstallResult
from enginetap.guard.options import GuardOptions, load_install_function

logger = logging.getLogger("enginetap.guard")

__all__ = ["install"]


def install(context: ArmContext) -> InstallResult:
    options = context.options_of("guard")
    assert isinstance(options, GuardOptions)
    done, handles = [], []
    for spec in options.patches:
        try:
            handle = load_install_function(spec)()
        except Exception:  # one broken guard patch must not take the others down
            logger.exception("enginetap: guard patch %s failed; skipped", spec)
            continue
        done.append(spec)
        if callable(getattr(handle, "uninstall", None)):
            handles.append(handle)
    return InstalledGroup(handles), f"guard ({len(done)} patch(es): {', '.join(done) or 'none'})"
