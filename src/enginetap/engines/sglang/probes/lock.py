"""The capture drift lock: the SGLang sources the probes rely on, pinned when they were written.

Checked when capture arms in a SGLang scheduler: a probe group whose pinned sources changed,
vanished or cannot be read is refused by name (logged with what changed, why it matters
and how to fix it) and the other probes arm; SGLang itself serves on either way. Re-pin
after reviewing the probes against a new SGLang::

    enginetap guard pin $(python -m enginetap.engines.sglang.probes.lock) \\
        -o src/enginetap/engines/sglang/capture.lock
"""

from __future__ import annotations

import logging
from pathlib import Path

from enginetap.capture.probe import Probe
from enginetap.engines.sglang.probes import GROUPS, LOCKED_TARGETS
from enginetap.guard.lock import Drift, GuardLock, diff_lock

logger = logging.getLogger("enginetap.capture")

__all__ = ["LOCK_FILE", "checked_probes"]

LOCK_FILE = Path(__file__).resolve().parent.parent / "capture.lock"


def checked_probes(lock: GuardLock | Path = LOCK_FILE) -> tuple[list[Probe], dict[str, str]]:
    """The probes whose sources match the lock, and each refused probe with its reason.

    A lock that cannot be read refuses every probe (nothing can be trusted)."""
    try:
        drifts = diff_lock(lock)
        locked = {e.target for e in (lock if isinstance(lock, GuardLock)
                                     else GuardLock.load(lock)).entries}
    except Exception as exc:  # noqa: BLE001 - a broken lock refuses capture, SGLang serves on
        reason = f"capture drift lock {lock} unreadable: {exc}"
        _log_refused("every SGLang probe", reason)
        return [], {p.name: reason for group, _ in GROUPS for p in group}
    by_target: dict[str, Drift] = {d.target: d for d in drifts}
    kept: list[Probe] = []
    refused: dict[str, str] = {}
    for probes, targets in GROUPS:
        problems = [str(by_target[t]) for t in targets if t in by_target]
        problems += [f"{t}: not pinned in the lock" for t in targets if t not in locked]
        if not problems:
            kept.extend(probes)
            continue
        reason = "; ".join(problems)
        for probe in probes:
            refused[probe.name] = reason
        _log_refused(", ".join(p.name for p in probes), reason)
    return kept, refused


def _log_refused(names: str, reason: str) -> None:
    logger.error("enginetap capture: probes %s refused: the SGLang sources they rely on drifted "
                 "from %s (%s). Why: a changed engine would be captured wrong. SGLang serves "
                 "on without them. Fix: review the probes against this SGLang and re-pin the "
                 "lock ('enginetap guard pin ... -o %s'), or install the SGLang it was made for",
                 names, LOCK_FILE.name, reason, LOCK_FILE)


if __name__ == "__main__":  # the targets to pin, one per line
    print("\n".join(LOCKED_TARGETS))
