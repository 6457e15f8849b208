"""Gates, and the chains of ``detach`` patches that a gate takes off their class while it
is shut (see :mod:`enginetap.core.patching`)."""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from enginetap.core.patching.targets import MISSING, raw_attribute

if TYPE_CHECKING:
    from enginetap.core.patching.patch import Patch

__all__ = ["CHAINS", "CHAIN_LOCK", "Chain", "Gate"]

logger = logging.getLogger("enginetap.patching")


class Gate:
    """Open or shut for the patches given it; open when made.

    wrapt asks :attr:`check` on every call of a gated patch; it is built from C callables
    (no Python frame); :meth:`set` is for step boundaries. With ``detach`` the gate's
    patches on class methods are also taken off their class while it is shut (see the
    module docstring).
    """

    __slots__ = ("_flag", "check", "detach", "_patches")

    def __init__(self, is_open: bool = True, detach: bool = False) -> None:
        self._flag = [bool(is_open)]
        self.check: Callable[[], bool] = functools.partial(operator.getitem, self._flag, 0)
        self.detach = detach
        self._patches: list[Patch] = []
        """The installed patches that follow this gate on and off their class."""

    @property
    def is_open(self) -> bool:
        return self._flag[0]

    def set(self, is_open: bool) -> None:
        is_open = bool(is_open)
        if self._flag[0] is is_open:
            return
        self._flag[0] = is_open
        for patch in self._patches:
            patch._follow()

    def _join(self, patch: Patch) -> None:
        if self.detach and patch not in self._patches:
            self._patches.append(patch)

    def _leave(self, patch: Patch) -> None:
        if patch in self._patches:
            self._patches.remove(patch)


class Chain:
    """The ``detach`` patches stacked on one class attribute, in install order; each
    one's wrapper wraps the one below it (the lowest wraps the engine's original).

    The class holds the wrapper of the highest patch whose gate is open, or the original
    when every gate is shut: the wrappers below it still run, each behind its own gate,
    and those above it are off. Once anything else touched the attribute (a patch
    without ``detach`` stacked on top, a replacement made by someone else) the chain is
    ``pinned``: every wrapper stays on for good, gated as without ``detach``.
    """

    def __init__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name
        self.patches: list[Patch] = []
        self.pinned = False

    def _held_level(self) -> int:
        """How many of the chain's wrappers the class holds now; -1 for something else."""
        held = vars(self.owner).get(self.name, MISSING)
        for level in range(len(self.patches), 0, -1):
            if held is self.patches[level - 1]._installed_wrapper:
                return level
        bottom = self.patches[0]
        return 0 if held is (bottom._original if bottom._owned else MISSING) else -1

    def _put(self, level: int) -> None:
        if self._held_level() == level:
            pass
        elif level:
            setattr(self.owner, self.name, self.patches[level - 1]._installed_wrapper)
        else:
            self.patches[0]._put_back()
        for i, patch in enumerate(self.patches):
            patch._attached = i < level

    def settle(self) -> None:
        """Put on the class what the gates say (see the class docstring)."""
        if not self.patches or self.pinned:
            return
        want = max((i + 1 for i, p in enumerate(self.patches) if p.gate.is_open), default=0)
        held = self._held_level()
        if held < 0:
            self._foreign()
        elif held != want:
            self._put(want)

    def pin(self) -> None:
        """Every wrapper on, for good (something is stacked on the chain)."""
        if self.pinned:
            return
        if self._held_level() < 0:
            self._foreign()
        else:
            self._put(len(self.patches))
        self.pinned = True

    def _foreign(self) -> None:
        """The class holds something the chain did not put there. If it wraps one of the
        chain's wrappers (stacked on them while they were on), it stays as it is; else it
        replaced the original while the chain was off, and is wrapped again. Pinned
        either way."""
        self.pinned = True
        found = vars(self.owner).get(self.name, MISSING)
        level = {id(p._installed_wrapper): i + 1 for i, p in enumerate(self.patches)}
        for _ in range(64):  # a wrapper chain; bounded against a cyclic __wrapped__
            if found is MISSING or found is None:
                break
            if id(found) in level:
                for i, patch in enumerate(self.patches):
                    patch._attached = i < level[id(found)]
                return
            found = getattr(found, "__wrapped__", None)
        self._rewrap()

    def _rewrap(self) -> None:
        """The attribute was replaced by someone else: wrap the replacement with the
        chain's wrappers again (uninstalling leaves the replacement)."""
        try:
            original, owned = raw_attribute(self.owner, self.name)
        except AttributeError:  # deleted: nothing left to wrap
            logger.warning("enginetap: %s.%s was deleted while enginetap's patches were "
                           "off it; they stay off", self.owner.__qualname__, self.name)
            for patch in self.patches:
                patch._attached = False
            return
        logger.info("enginetap: %s.%s was replaced while enginetap's patches were off it; "
                    "wrapping the replacement, on from now on", self.owner.__qualname__,
                    self.name)
        for patch in self.patches:
            patch._original, patch._owned = original, owned
            patch._attach_wrapper()
            original, owned = patch._installed_wrapper, True

    def remove(self, patch: Patch) -> None:
        """Take ``patch``'s wrapper away: the top one is unwrapped; one below another is
        left in place (uninstalled out of order) and the chain pinned."""
        if patch is self.patches[-1] and not self.pinned and self._held_level() >= 0:
            self._put(len(self.patches) - 1)
            self.patches.pop()
            self.settle()
        else:
            patch._take_back()
            self.pinned = True
            self.patches.remove(patch)
        if not self.patches:
            CHAINS.pop((id(self.owner), self.name), None)




CHAINS: dict[tuple[int, str], Chain] = {}
"""The ``detach`` chains by (id of the class, attribute)."""
CHAIN_LOCK = threading.RLock()
"""Every change to a chain (gate changes on the engine's thread; installs, from a
post-import hook on any thread) is made under it."""
