"""A :class:`Patch` (one wrapper on one target: install, post-import hook, exact restore,
contained wrapper errors) and a :class:`PatchSet` (one capability's patches)."""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from enginetap.core.patching.gate import CHAIN_LOCK, CHAINS, Chain, Gate
from enginetap.core.patching.targets import Target, owner_of, raw_attribute
from enginetap.errors import PatchError

__all__ = ["Patch", "PatchSet", "ReachesCaller", "Wrapper", "WrapperError", "contained"]

logger = logging.getLogger("enginetap.patching")

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]

_CONTAINED = "__enginetap_contained__"


def contained(wrapper: Wrapper) -> Wrapper:
    """Mark ``wrapper`` as containing its own errors (see the module docstring): a patch
    installs it without the containment layer. Returns ``wrapper``."""
    setattr(wrapper, _CONTAINED, True)
    return wrapper


class ReachesCaller(Exception):
    """Base for errors a wrapper raises on purpose for the engine's caller to see.

    Every other exception a wrapper raises is contained (recorded, original called). A
    patch that exists to stop a run (a guard in ``strict`` mode) raises a subclass.
    """


@dataclass(frozen=True)
class WrapperError:
    """One contained failure of a wrapper."""

    target: str
    error: str
    traceback: str


class _TrackedCall:
    """Calls the original once and remembers whether it ran, what it returned or raised."""

    __slots__ = ("_wrapped", "called", "result", "raised")

    def __init__(self, wrapped: Callable[..., Any]) -> None:
        self._wrapped = wrapped
        self.called = False
        self.result: Any = None
        self.raised: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        try:
            self.result = self._wrapped(*args, **kwargs)
        except BaseException as exc:  # the engine's own error: re-raised unchanged
            self.raised = exc
            raise
        return self.result

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally; an unset slot (a tracer probing the
        # object before __init__ ran) must not recurse through self._wrapped.
        if name in _TrackedCall.__slots__:
            raise AttributeError(name)
        return getattr(self._wrapped, name)


@dataclass(eq=False)
class Patch:
    """One wrapper applied to one target; installable, uninstallable, error-containing.

    Raises:
        PatchError: on install, when the target's module imports but the attribute path
            does not resolve, or the attribute is not callable.
    """

    target: Target
    wrapper: Wrapper
    gate: Gate | None = None
    """While shut, calls go straight to the original (see the module docstring)."""
    max_errors: int = 32
    errors: deque[WrapperError] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _state: str = field(init=False, default="idle")  # idle | pending | installed
    _owner: Any = field(init=False, default=None)
    _original: Any = field(init=False, default=None)
    _owned: bool = field(init=False, default=True)
    _logged: bool = field(init=False, default=False)
    _installed_wrapper: Any = field(init=False, default=None)
    """The ``FunctionWrapper`` this patch put on the owner."""
    _attached: bool = field(init=False, default=False)
    """The owner holds :attr:`_installed_wrapper` (False: detached, the original is back)."""

    def __post_init__(self) -> None:
        if isinstance(self.target, str):
            self.target = Target.parse(self.target)
        self.errors = deque(maxlen=self.max_errors)

    @property
    def installed(self) -> bool:
        return self._state == "installed"

    @property
    def pending(self) -> bool:
        return self._state == "pending"

    @property
    def original(self) -> Any:
        """The exact object the patch replaced (None until installed)."""
        return self._original

    @property
    def attached(self) -> bool:
        """Installed and its wrapper called by the owner's attribute (False while a
        ``detach`` gate has it off the class)."""
        return self._state == "installed" and self._attached

    def install(self) -> Patch:
        """Install now if the module is imported, else when it is first imported."""
        with self._lock:
            if self._state != "idle":
                return self
            if self.target.module in sys.modules:
                self._apply()
            else:
                self._state = "pending"
                wrapt.register_post_import_hook(self._on_import, self.target.module)
        return self

    def uninstall(self) -> None:
        """Restore the exact original where the owner still holds this patch's wrapper
        (a later patch stacked on it is left in place); a pending patch is cancelled."""
        with self._lock, CHAIN_LOCK:
            if self._state == "installed":
                if self.gate is not None:
                    self.gate._leave(self)
                chain = CHAINS.get((id(self._owner), self.target.attribute))
                if chain is not None and self in chain.patches:
                    chain.remove(self)
                else:
                    self._take_back()
            self._state = "idle"
            self._owner = self._original = self._installed_wrapper = None
            self._attached = False

    def _on_import(self, module: Any) -> None:
        with self._lock:
            if self._state != "pending":
                return
            try:
                self._apply()
            except PatchError as exc:
                # A post-import hook must not break the engine's import: report, stay off.
                self._state = "idle"
                self._record(exc)

    def _apply(self) -> None:
        owner = owner_of(self.target)
        name = self.target.attribute
        detach = (self.gate is not None and self.gate.detach and isinstance(owner, type))
        with CHAIN_LOCK:
            chain = CHAINS.get((id(owner), name))
            if chain is not None:  # stacking on it: every wrapper on first, in order
                if not detach:
                    chain.pin()
                elif not chain.pinned:
                    chain.settle()  # a replacement found there is dealt with first
                    if not chain.pinned:
                        chain._put(len(chain.patches))
            try:
                original, owned = raw_attribute(owner, name)
            except (AttributeError, KeyError) as exc:
                raise PatchError(
                    f"cannot patch {self.target}",
                    f"{name!r} does not exist on {owner!r}",
                    "check the target against the installed engine version",
                ) from exc
            if not (callable(original) or isinstance(original, (staticmethod, classmethod))):
                raise PatchError(f"cannot patch {self.target}", f"{original!r} is not callable")
            self._owner, self._original, self._owned = owner, original, owned
            self._attach_wrapper()
            self._state = "installed"
            if detach:
                assert self.gate is not None
                if chain is None:
                    chain = CHAINS[(id(owner), name)] = Chain(owner, name)
                chain.patches.append(self)
                self.gate._join(self)
                chain.settle()

    def _take_back(self) -> None:
        """Put the original back if the owner still holds this patch's wrapper: a wrapper
        that someone stacked on ours (or their own replacement) stays."""
        if vars(self._owner).get(self.target.attribute) is self._installed_wrapper:
            self._put_back()

    def _put_back(self) -> None:
        """The owner's attribute as it was before this patch (deleted if inherited)."""
        if self._owned:
            setattr(self._owner, self.target.attribute, self._original)
        else:
            delattr(self._owner, self.target.attribute)

    def _attach_wrapper(self) -> None:
        """Wrap :attr:`_original` and put the wrapper on the owner."""
        enabled = None if self.gate is None else self.gate.check
        wrapper = self.wrapper if getattr(self.wrapper, _CONTAINED, False) else self._call
        self._installed_wrapper = wrapt.FunctionWrapper(self._original, wrapper,
                                                        enabled=enabled)
        setattr(self._owner, self.target.attribute, self._installed_wrapper)
        self._attached = True

    def _follow(self) -> None:
        """Its ``detach`` gate changed: put on the class what the gates now say."""
        with CHAIN_LOCK:
            chain = CHAINS.get((id(self._owner), self.target.attribute))
            if self._state == "installed" and chain is not None:
                chain.settle()

    def _call(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        call = _TrackedCall(wrapped)
        try:
            return self.wrapper(call, instance, args, kwargs)
        except ReachesCaller:
            raise
        except Exception as exc:
            if call.raised is not None:
                raise call.raised from None
            self._record(exc)
            if call.called:
                return call.result
            return wrapped(*args, **kwargs)

    def _record(self, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append(WrapperError(str(self.target), repr(exc), tb))
        if not self._logged:
            self._logged = True
            logger.error("enginetap: wrapper for %s failed (engine call went on): %s\n%s",
                         self.target, exc, tb)


class PatchSet:
    """A named group of patches installed and removed together (one capability)."""

    def __init__(self, name: str, patches: Iterable[Patch] = ()) -> None:
        self.name = name
        self.patches: list[Patch] = list(patches)

    def add(self, target: str | Target, wrapper: Wrapper, gate: Gate | None = None) -> Patch:
        patch = Patch(Target.parse(target) if isinstance(target, str) else target, wrapper,
                      gate)
        self.patches.append(patch)
        return patch

    def install(self) -> PatchSet:
        done: list[Patch] = []
        try:
            for patch in self.patches:
                done.append(patch.install())
        except PatchError:
            for patch in reversed(done):
                patch.uninstall()
            raise
        return self

    def install_more(self, wrappers: Iterable[tuple[str | Target, Wrapper]],
                     gate: Gate | None = None) -> None:
        """Install further patches into this (installed) set, all or none: patches are
        added as models load, and one that fails leaves none of the new ones behind.
        ``gate``: every new patch's gate.

        Raises:
            PatchError: a target does not resolve (nothing new stays installed).
        """
        fresh = PatchSet(self.name)
        for target, wrapper in wrappers:
            fresh.add(target, wrapper, gate)
        fresh.install()
        self.patches.extend(fresh.patches)

    def uninstall(self) -> None:
        for patch in reversed(self.patches):
            patch.uninstall()

    def errors(self) -> list[WrapperError]:
        return [e for p in self.patches for e in p.errors]

    def __enter__(self) -> PatchSet:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
