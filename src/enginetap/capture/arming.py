"""The ``capture`` capability: a :class:`~enginetap.capture.runtime.CaptureRuntime` in this
process, its probes installed on every model the engine loads.

A dataset directory that cannot be created or opened (under a regular file, a name with a
NUL byte, no permission, a full disk) disarms capture alone: one error line says why, and
the engine and the other capabilities serve on, as they do after any later capture failure.
"""

from __future__ import annotations

import logging
from pathlib import Path

from enginetap.capture.options import CaptureOptions
from enginetap.capture.runtime import CaptureRuntime
from enginetap.core.capability import ArmContext, InstallResult
from enginetap.errors import DatasetError

logger = logging.getLogger("enginetap.capture")

__all__ = ["install"]


def install(context: ArmContext) -> InstallResult:
    """Raises nothing for an unusable dataset directory: capture is then not installed."""
    options = context.options_of("capture")
    assert isinstance(options, CaptureOptions)
    try:
        runtime = CaptureRuntime(context, options)
    except (OSError, ValueError, DatasetError) as exc:
        where = str(options.dataset or Path(context.out_dir) / "dataset")
        why = getattr(exc, "strerror", None) or str(exc)
        logger.error("enginetap capture: cannot use the dataset directory %r (%s); capture is "
                     "disarmed, the engine serves on. Fix: point options.capture.dataset (or "
                     "out_dir) at a writable directory path", where, why)
        return None, f"capture (disarmed: cannot use the dataset directory {where!r}: {why})"
    runtime.install()
    context.notes["capture"] = runtime
    where = runtime.dataset_root if context.rank == 0 else "rank 0's dataset"
    return runtime, (f"capture ({len(runtime.probes)} probe(s), policy "
                     f"{options.selection().name}, writing to {where})")
