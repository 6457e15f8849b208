"""Probes: data that says where an engine runs an operator and how its call maps onto a
definition.

A :class:`Probe` names a target (``"module:Qualname.method"``, or a class-name suffix
resolved against each loaded model), when it fires (prefill, decode or both), the
definition family it feeds, and two small functions:

- ``define(call)`` — the :class:`~enginetap.dataset.schema.Definition` this call
  instantiates (from shapes and the module's constants only; no tensor is read), or None
  when the call is not one this probe describes;
- ``adapt(call)`` — after the engine's call returned: the definition's inputs and outputs
  in its canonical layout (:class:`Extracted`), with a note for each change of layout.

State the engine updates in place is snapshotted by ``before(call)`` (clones, taken only
for selected calls) and read back from the call's arguments after it returned. Adding an
operator for an engine is one table entry plus, at most, a small adapter function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from enginetap.core.context import Step
from enginetap.dataset.schema import Definition

__all__ = ["Extracted", "Probe", "ProbeCall", "When"]

When = Literal["prefill", "decode", "both"]


@dataclass
class ProbeCall:
    """One selected call of a probed target, as its adapter sees it."""

    probe: Probe
    instance: Any
    """The module (or other object) whose method was called; None for functions."""
    args: dict[str, Any]
    """The call's bound arguments by parameter name (defaults applied)."""
    step: Step
    layer: tuple[str, str] | None
    """``(qualified name, short name)`` of the sublayer running the call, if known."""
    result: Any = None
    before: dict[str, Any] = field(default_factory=dict)
    """What ``probe.before`` snapshotted (clones of in-place state)."""
    definition: Definition | None = None


@dataclass
class Extracted:
    """A call in a definition's canonical layout.

    ``inputs`` holds every input of the definition (tensors, or Python scalars for scalar
    inputs); ``outputs`` what the engine produced, by output name (a subset is allowed
    when the engine does not expose an output, e.g. a log-sum-exp). ``notes`` says what
    the adapter changed and why (compaction of pages, head layouts, dropped padding).
    ``rows`` are the step rows the workload covers (for the receipt's request keys).
    ``checks`` are what the adapter verified on the device without waiting for it: pairs of
    a bool scalar tensor (True: it holds) and what it means when it does not. They travel
    with the copies; the writer reads them before writing and refuses the workload (its
    probe is disabled, as for any adapter failure) when one fails. An adapter that asked the
    host instead would stop the engine's host thread until the device caught up.
    """

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    rows: list[int] | None = None
    checks: list[tuple[Any, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Probe:
    """One hook point of one engine, mapped onto one definition family."""

    name: str
    family: str
    define: Callable[[ProbeCall], Definition | None]
    adapt: Callable[[ProbeCall], Extracted | None]
    target: str = ""
    """``"module:Qualname.method"``; empty when ``suffix`` names the classes."""
    suffix: str = ""
    """Class-name suffix: every class of a loaded model ending with it, at ``method``."""
    method: str = "forward"
    when: When = "both"
    before: Callable[[ProbeCall], dict[str, Any]] | None = None
    inside: str = ""
    """Fire only while the running sublayer's class name ends with this ("" = anywhere):
    a kernel-level target (``scaled_dot_product_attention``) is called from many places."""
    description: str = ""
    signature: Callable[..., Any] | None = None
    """A Python function whose parameters describe the target's, for targets without an
    introspectable signature (C builtins such as ``scaled_dot_product_attention``)."""
    regroup: Callable[[dict[str, Any], list[int]], dict[str, Any]] | None = None
    """The call's arguments (bound by name) for a batch of its requests ``picks`` (indices
    in the call's request order, repeats allowed), where picking token rows is not enough:
    per-request metadata and state slots laid out again (``tap explain``'s calls made
    again). None: tensors whose first dimension is the step's tokens are picked by row."""

    def fires_in(self, step: Step) -> bool:
        return self.when == "both" or step.mode == self.when or step.mode == "mixed"
