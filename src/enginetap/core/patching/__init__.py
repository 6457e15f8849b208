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

from enginetap.core.patching.gate import Gate
from enginetap.core.patching.patch import (
    Patch, PatchSet, ReachesCaller, WrapperError, contained,
)
from enginetap.core.patching.signatures import bind_arguments, call_signature
from enginetap.core.patching.targets import ResolveError, Target, lookup_raw, resolve

__all__ = ["Gate", "Patch", "PatchSet", "ReachesCaller", "ResolveError", "Target",
           "WrapperError", "bind_arguments", "call_signature", "contained", "lookup_raw",
           "resolve"]
