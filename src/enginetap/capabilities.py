"""The capabilities enginetap can arm, as one explicit list (installation order).

Each entry names its options model (validated when an arming config is parsed) and its
install function (imported only when arming). Adding a capability is one entry here plus
its own folder; core never imports a feature.
"""

from __future__ import annotations

from enginetap.core.arming import STEP
from enginetap.core.capability import Capability, CapabilityRegistry
from enginetap.core.scope import SCOPE_CAPABILITY
from enginetap.capture.options import CaptureOptions
from enginetap.guard.options import GuardOptions
from enginetap.patches.sp_prefill.options import SpPrefillOptions
from enginetap.tap.options import TapOptions

__all__ = ["REGISTRY", "arm"]

GUARD = Capability("guard", GuardOptions, "enginetap.guard.arming:install",
                   "guarded engine patches: drift lock, per-shape exactness proof")

CAPTURE = Capability("capture", CaptureOptions, "enginetap.capture.arming:install",
                     "operator workloads into a FlashInfer-Trace dataset",
                     needs=("step", "scope"))

TAP = Capability("tap", TapOptions, "enginetap.tap.record.arming:install",
                 "per-step fingerprints of tapped rows at every sublayer",
                 needs=("step", "scope"), running_scope=False)

SP_PREFILL = Capability("sp_prefill", SpPrefillOptions,
                        "enginetap.patches.sp_prefill.arming:install",
                        "sequence-parallel prefill for vLLM at TP >= 2 (guarded patch)")

# sp_prefill last: guard patches (a user's own, or a test's injections) are in place first.
REGISTRY = CapabilityRegistry([STEP, SCOPE_CAPABILITY, GUARD, CAPTURE, TAP, SP_PREFILL])


def arm(config, hooks=None, rank: int = 0, world_size: int = 1):
    """Install ``config`` (an enabled :class:`~enginetap.config.ArmConfig`) in this process
    with ``hooks`` (default: an engine that publishes its own steps).

    Raises:
        ConfigError, PatchError: as :meth:`~enginetap.core.arming.Arming.install`; nothing
        stays installed on error.
    """
    from enginetap.core.arming import Arming
    from enginetap.core.capability import EngineHooks

    return Arming(config, REGISTRY, config.parsed_options(), hooks or EngineHooks(), rank,
                  world_size).install()
