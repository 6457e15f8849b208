"""An engine's capture drift lock checked against its probe groups: a group whose pinned
sources changed (or are not pinned) is refused with the drift as its reason, the others
arm; a lock that cannot be read refuses every probe. The engine serves on either way."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from enginetap.capture.probe import Probe
from enginetap.guard.lock import Drift, GuardLock, diff_lock

logger = logging.getLogger("enginetap.capture")

__all__ = ["ProbeGroups", "ProbeLock", "checked_groups"]

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


@dataclass(frozen=True)
class ProbeLock:
    """One engine's capture drift lock: its probe groups, the targets they pin, the lock
    file shipped with the engine's probes (``engine``: its name in the log)."""

    engine: str
    groups: ProbeGroups
    targets: Sequence[str]
    file: Path

    def checked_probes(self, lock: GuardLock | Path | None = None
                       ) -> tuple[list[Probe], dict[str, str]]:
        """The probes whose sources match ``lock`` (default: the shipped one), and each
        refused probe with its reason. A lock that cannot be read refuses every probe."""
        return checked_groups(self.groups, self.file if lock is None else lock, self.file,
                              self.engine)

    def print_targets(self) -> None:
        """The targets to pin, one per line (what ``guard pin`` takes)."""
        print("\n".join(self.targets))
