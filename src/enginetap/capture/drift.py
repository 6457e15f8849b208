"""An engine's capture drift lock checked against its probe groups: a group whose pinned
sources changed (or are not pinned) is refused with the drift as its reason, the others
arm; a lock that cannot be read refuses every probe. The engine serves on either way."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from enginetap.capture.probe import Probe
from enginetap.guard.lock import Drift, GuardLock, diff_lock

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProbeGroups", "checked_groups"]

ProbeGroups = Sequence[tuple[Sequence[Probe], Sequence[str]]]
"""Per group: its probes and the ``module:qualname`` targets they rely on."""


def checked_groups(groups: ProbeGroups, lock: GuardLock | Path, lock_file: Path,
                   engine: str) -> tuple[list[Probe], dict[str, str]]:
    """The probes of ``groups`` whose sources match ``lock``, and each refused probe with
    its reason (``lock_file``: the engine's shipped lock, named in the fix; ``engine``: the
    engine's name in the log)."""
    try:
        drifts = diff_lock(lock)
        locked = {e.target for e in (lock if isinstance(lock, GuardLock)
                                     else GuardLock.load(lock)).entries}
    except Exception as exc:  # noqa: BLE001 - a broken lock refuses capture, the engine serves on
        reason = f"capture drift lock {lock} unreadable: {exc}"
        _log_refused(f"every {engine} probe", reason, lock_file, engine)
        return [], {p.name: reason for group, _ in groups for p in group}
    by_target: dict[str, Drift] = {d.target: d for d in drifts}
    kept: list[Probe] = []
    refused: dict[str, str] = {}
    for probes, targets in groups:
        problems = [str(by_target[t]) for t in targets if t in by_target]
        problems += [f"{t}: not pinned in the lock" for t in targets if t not in locked]
        if not problems:
            kept.extend(probes)
            continue
        reason = "; ".join(problems)
        for probe in probes:
            refused[probe.name] = reason
        _log_refused(", ".join(p.name for p in probes), reason, lock_file, engine)
    return kept, refused


def _log_refused(names: str, reason: str, lock_file: Path, engine: str) -> None:
    logger.error("enginetap capture: probes %s refused: the %s sources they rely on drifted "
                 "from %s (%s). Why: a changed engine would be captured wrong. %s serves "
                 "on without them. Fix: review the probes against this %s and re-pin the "
                 "lock ('enginetap guard pin ... -o %s'), or install the %s it was made for",
                 names, engine, lock_file.name, reason, engine, engine, lock_file, engine)
