"""The one patching layer: every change enginetap makes to an engine goes through here.

A target is ``"package.module:Qualname.attr"``. A :class:`Patch` resolves it, wraps the
attribute with a :mod:`wrapt` ``FunctionWrapper`` and keeps the exact object it replaced
(read from the owner's ``__dict__``, never through ``getattr``, so descriptors such as
``staticmethod`` come back as they were). If the module is not imported yet the patch is
installed by a post-import hook, i.e. before any importer can take a private
``from module import f`` copy.

A patch may have a :class:`Gate`: while the gate is shut, wrapt calls the original
directly (in C, without entering Python), so a capability that works only on some steps
(capture's selected steps) costs about a microsecond per call on the others (wrapt's
binding of the method and its C call) instead of its wrapper's checks.

A gate made with ``detach=True`` goes further for methods of classes: while it is shut,
the class holds the original again (the wrapper is put back when it opens), so the
engine's calls on the other steps meet no wrapper at all. Several such patches on one
attribute form a chain in install order; the class holds the wrapper of the highest one
whose gate is open (those below it run gated). A swap is made only while the class
holds exactly what the chain left there; once anything else touched the attribute (a
patch without ``detach`` stacked on top, a library's own monkeypatch) the chain stays on
for good, each wrapper gated as without ``detach``. Module-level functions are never
detached: a ``from module import f`` taken while the original was back would keep it.
Swaps happen in :meth:`Gate.set`, i.e. at step boundaries on the engine's thread.

Wrappers have wrapt's signature ``(wrapped, instance, args, kwargs)``. Errors raised by a
wrapper are contained: they are recorded on the patch and logged once, and the original
is called (or its result returned, if the wrapper already called it). Exceptions raised
by the original itself propagate unchanged: they are the engine's, not ours.

That containment is a layer of Python calls around every wrapper call. A wrapper on a
path called hundreds of times per step (the tap's sublayer wrapper) can contain its own
errors instead and be marked with :func:`contained`: it is then installed as it is. Such
a wrapper must call the original exactly once, let the original's exceptions through,
and catch and report everything of its own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import operator
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from enginetap.errors import PatchError

logger = logging.getLogger("enginetap.patching")

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]

__all__ = ["Gate", "Patch", "PatchSet", "ReachesCaller", "ResolveError", "Target",
           "WrapperError", "bind_arguments", "call_signature", "contained", "lookup_raw",
           "resolve"]

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


@dataclass(frozen=True)
class Target:
    """A parsed ``"module:Qualname.attr"`` path."""

    module: str
    qualname: str

    @classmethod
    def parse(cls, spec: str) -> Target:
        module, sep, qualname = spec.partition(":")
        if not sep or not module or not qualname or any(not p for p in qualname.split(".")):
            raise PatchError(
                f"bad patch target {spec!r}",
                "a target names a module and an attribute path separated by one colon",
                "write it as 'package.module:Class.method' or 'package.module:function'",
            )
        return cls(module, qualname)

    @property
    def owner_path(self) -> list[str]:
        return self.qualname.split(".")[:-1]

    @property
    def attribute(self) -> str:
        return self.qualname.split(".")[-1]

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


class ResolveError(PatchError):
    """A ``"module:qualname"`` does not resolve. ``kind`` says why: ``missing-module`` (not
    installed), ``import-failed`` (its import raised) or ``missing-attribute``."""

    def __init__(self, spec: str, kind: str, why: str) -> None:
        self.kind = kind
        super().__init__(f"cannot resolve {spec}", why,
                         "check the name against the installed package's version")


_MISSING = object()


def lookup_raw(owner: Any, name: str) -> Any:
    """``owner.name`` as stored (a class's ``__dict__`` along its MRO first, so descriptors
    such as ``property`` or ``classmethod`` come back unbound); ``_MISSING`` if absent."""
    for klass in owner.__mro__ if isinstance(owner, type) else (owner,):
        try:
            namespace = vars(klass)
        except TypeError:
            break
        if name in namespace:
            return namespace[name]
    return getattr(owner, name, _MISSING)


def resolve(spec: str | Target, *, raw: bool = False) -> Any:
    """The object ``"package.module:Qualname.attr"`` names, importing its module.

    ``raw`` reads each attribute as stored (see :func:`lookup_raw`) instead of through
    ``getattr``. The one resolver of enginetap: patch targets, guard pins and patches,
    capture probes all go through it.

    Raises:
        PatchError: ``spec`` is malformed. ResolveError: the module is not installed, its
            import raised (the error is named), or an attribute is missing.
    """
    target = spec if isinstance(spec, Target) else Target.parse(spec)
    try:
        found: Any = importlib.import_module(target.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        kind = ("missing-module" if target.module == missing
                or target.module.startswith(missing + ".") else "import-failed")
        raise ResolveError(str(target), kind, f"importing {target.module} failed: {exc!r}"
                           ) from None
    except Exception as exc:  # a module that fails to import cannot be resolved
        raise ResolveError(str(target), "import-failed",
                           f"importing {target.module} failed: {exc!r}") from None
    for part in target.qualname.split("."):
        value = lookup_raw(found, part) if raw else getattr(found, part, _MISSING)
        if value is _MISSING:
            raise ResolveError(str(target), "missing-attribute",
                               f"{part!r} is missing on {getattr(found, '__name__', found)!r}")
        found = value
    return found


@dataclass(frozen=True)
class WrapperError:
    """One contained failure of a wrapper."""

    target: str
    error: str
    traceback: str


def _resolve_owner(target: Target) -> Any:
    """Return the object that holds ``target.attribute`` (a module or a class)."""
    owner: Any = sys.modules[target.module]
    for part in target.owner_path:
        try:
            owner = vars(owner)[part] if part in vars(owner) else getattr(owner, part)
        except (AttributeError, TypeError) as exc:
            raise PatchError(
                f"cannot resolve {target}",
                f"{part!r} is missing on {owner!r}",
                "check the target against the installed engine version",
            ) from exc
    return owner


def _raw_attribute(owner: Any, name: str) -> tuple[Any, bool]:
    """The attribute as stored (no descriptor binding) and whether ``owner`` holds it itself."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name], klass is owner
        raise AttributeError(name)
    return vars(owner)[name], True


class _Chain:
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
        held = vars(self.owner).get(self.name, _MISSING)
        for level in range(len(self.patches), 0, -1):
            if held is self.patches[level - 1]._installed_wrapper:
                return level
        bottom = self.patches[0]
        return 0 if held is (bottom._original if bottom._owned else _MISSING) else -1

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
        found = vars(self.owner).get(self.name, _MISSING)
        level = {id(p._installed_wrapper): i + 1 for i, p in enumerate(self.patches)}
        for _ in range(64):  # a wrapper chain; bounded against a cyclic __wrapped__
            if found is _MISSING or found is None:
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
            original, owned = _raw_attribute(self.owner, self.name)
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
            _CHAINS.pop((id(self.owner), self.name), None)


_CHAINS: dict[tuple[int, str], _Chain] = {}
"""The ``detach`` chains by (id of the class, attribute)."""
_CHAIN_LOCK = threading.RLock()
"""Every change to a chain (gate changes on the engine's thread; installs, from a
post-import hook on any thread) is made under it."""


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
        with self._lock, _CHAIN_LOCK:
            if self._state == "installed":
                if self.gate is not None:
                    self.gate._leave(self)
                chain = _CHAINS.get((id(self._owner), self.target.attribute))
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
        owner = _resolve_owner(self.target)
        name = self.target.attribute
        detach = (self.gate is not None and self.gate.detach and isinstance(owner, type))
        with _CHAIN_LOCK:
            chain = _CHAINS.get((id(owner), name))
            if chain is not None:  # stacking on it: every wrapper on first, in order
                if not detach:
                    chain.pin()
                elif not chain.pinned:
                    chain.settle()  # a replacement found there is dealt with first
                    if not chain.pinned:
                        chain._put(len(chain.patches))
            try:
                original, owned = _raw_attribute(owner, name)
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
                    chain = _CHAINS[(id(owner), name)] = _Chain(owner, name)
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
        with _CHAIN_LOCK:
            chain = _CHAINS.get((id(self._owner), self.target.attribute))
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


_SIGNATURES: dict[tuple[Any, bool], inspect.Signature] = {}


def call_signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of ``function`` as called, computed once per underlying function.

    A bound method (what wrapt passes as ``wrapped`` for instance methods) is keyed by its
    ``__func__`` so that the cache hits across instances; its first parameter is dropped.
    """
    func = getattr(function, "__func__", None)
    bound = func is not None
    key = (func if bound else function, bound)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = inspect.signature(key[0])
        if bound:
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        _SIGNATURES[key] = sig
    return sig


def bind_arguments(function: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of one call by parameter name, in parameter order, defaults applied (what
    ``inspect.Signature.bind`` gives, with its errors, in a few microseconds: capture binds
    every call it selects).

    Raises:
        TypeError: the call does not fit the signature (as ``Signature.bind`` says it).
    """
    plan = _bind_plan(function)
    if plan is not None and len(args) <= plan.positional:
        given = len(args)
        try:
            out = {name: args[i] if i < given else kwargs[name] if name in kwargs
                   else plan.defaults[name] for i, name in enumerate(plan.names)}
        except KeyError:  # a required argument is missing: bind says which
            out = None
        if out is not None and all(name in out and plan.names.index(name) >= given
                                   and name not in plan.positional_only for name in kwargs):
            return out
    bound = call_signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclass(frozen=True)
class _BindPlan:
    names: tuple[str, ...]
    defaults: dict[str, Any]
    positional_only: frozenset[str]
    positional: int
    """How many leading parameters a positional argument can fill."""


_PLANS: dict[tuple[Any, bool], _BindPlan | None] = {}


def _bind_plan(function: Callable[..., Any]) -> _BindPlan | None:
    """The fast path's view of ``function``'s signature; None for ``*args``/``**kwargs``
    signatures (bound the slow way)."""
    func = getattr(function, "__func__", None)
    key = (function if func is None else func, func is not None)
    if key in _PLANS:
        return _PLANS[key]
    params = list(call_signature(function).parameters.values())
    plan = None
    if all(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        plan = _BindPlan(tuple(p.name for p in params),
                         {p.name: p.default for p in params if p.default is not p.empty},
                         frozenset(p.name for p in params if p.kind == p.POSITIONAL_ONLY),
                         sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                             for p in params))
    _PLANS[key] = plan
    return plan
