"""The capture drift lock: the vLLM sources the probes rely on, pinned when they were written.

Checked when capture arms in a vLLM worker: a probe group whose pinned sources changed,
vanished or cannot be read is refused by name (logged with what changed, why it matters
and how to fix it) and the other probes arm; vLLM itself serves on either way. Re-pin
after reviewing the probes against a new vLLM::

    enginetap guard pin $(python -m enginetap.engines.vllm.probes.lock) \\
        -o src/enginetap/engines/vllm/capture.lock
"""

from __future__ import annotations

from pathlib import Path

from enginetap.capture.drift import checked_groups
from enginetap.capture.probe import Probe
from enginetap.engines.vllm.probes import GROUPS, LOCKED_TARGETS
from enginetap.guard.lock import GuardLock

__all__ = ["LOCK_FILE", "checked_probes"]

LOCK_FILE = Path(__file__).resolve().parent.parent / "capture.lock"


def checked_probes(lock: GuardLock | Path = LOCK_FILE) -> tuple[list[Probe], dict[str, str]]:
    """The probes whose sources match the lock, and each refused probe with its reason.

    A lock that cannot be read refuses every probe (nothing can be trusted)."""
    return checked_groups(GROUPS, lock, LOCK_FILE, "vLLM")


if __name__ == "__main__":  # the targets to pin, one per line
    print("\n".join(LOCKED_TARGETS))
