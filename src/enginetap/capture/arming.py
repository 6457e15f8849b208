"""The ``capture`` capability: a :class:`~enginetap.capture.runtime.CaptureRuntime` in this
process, its probes installed on every model the engine loads."""

from __future__ import annotations

from enginetap.capture.options import CaptureOptions
from enginetap.capture.runtime import CaptureRuntime
from enginetap.core.capability import ArmContext, InstallResult

__all__ = ["install"]


def install(context: ArmContext) -> InstallResult:
    """Raises: DatasetError: the dataset directory cannot be created or opened."""
    options = context.options_of("capture")
    assert isinstance(options, CaptureOptions)
    runtime = CaptureRuntime(context, options).install()
    context.notes["capture"] = runtime
    where = runtime.dataset_root if context.rank == 0 else "rank 0's dataset"
    return runtime, (f"capture ({len(runtime.probes)} probe(s), policy "
                     f"{options.selection().name}, writing to {where})")
