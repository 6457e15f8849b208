"""What the serving engines' step adapters share (vLLM's V1 runner, SGLang's model runner).

An adapter patches its engine's runner, keeps bookkeeping per runner beside it (never on
it), publishes a :class:`~enginetap.core.context.Step` when the forward of a real step
begins, ends it when the sampler returned for it and abandons it (no end listeners)
otherwise. A begun step dropped for a reason other than the engine's own (its sampler
raised, disarming, the process ending before its sampler returned: vLLM waits only for
its output rank, so it can stop another rank mid-step at shutdown) is logged with its
number, never dropped silently. If reading a step ever fails, the adapter logs it and
calls ``on_failure`` (default: its own :meth:`StepAdapter.uninstall`): a step context
that cannot be trusted is no step context. Each engine's adapter says when its steps begin and end.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from weakref import WeakKeyDictionary

from enginetap.core import context, shutdown
from enginetap.core.context import Step, publish
from enginetap.core.patching import PatchSet

__all__ = ["RunnerState", "StepAdapter"]


@dataclass(slots=True)
class RunnerState:
    """Our per-runner bookkeeping: the next step's number and the step in flight."""

    next_step: int = 0
    active: publish | None = None
    batch: Any = None
    """The engine's own batch object the adapter is following (vLLM: the scheduler output
    of the ``execute_model`` call in progress; SGLang: the ``ForwardBatch`` of the step in
    flight), else None."""


@dataclass
class StepAdapter(ABC):
    """Publishes one :class:`Step` per real step of every runner of one engine here."""

    rank: int = 0
    world_size: int = 1
    on_failure: Callable[[], None] | None = None
    patches: PatchSet = field(init=False)
    _states: WeakKeyDictionary = field(init=False, default_factory=WeakKeyDictionary)

    engine: ClassVar[str] = "the engine"
    """The engine's name in the log (its logger: ``enginetap.<name in lower case>``)."""
    runner: ClassVar[str] = ""
    """The engine's model runner class (``module:qualname``)."""

    def __init_subclass__(cls, engine: str = "", runner: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.engine, cls.runner = engine or cls.engine, runner or cls.runner

    def __post_init__(self) -> None:
        self.patches = PatchSet("step")
        for method, wrapper in self.wrappers().items():
            self.patches.add(f"{self.runner}.{method}", wrapper)

    @abstractmethod
    def wrappers(self) -> dict[str, Callable[..., Any]]:
        """The wrapper of each patched method of the runner, by the method's name."""

    def install(self) -> StepAdapter:
        """Install the runner patches (now, or when the runner module is imported).

        Raises:
            PatchError: the installed engine's runner lacks one of the patched methods.
        """
        self.patches.install()
        shutdown.on_exit(self._at_exit, signals=False)
        return self

    def uninstall(self) -> None:
        """Remove the patches; a step in flight is abandoned (and logged)."""
        shutdown.forget(self._at_exit)
        self.patches.uninstall()
        for state in list(self._states.values()):
            self._abandon(state, "enginetap disarmed while it ran")

    def _at_exit(self) -> None:
        for state in list(self._states.values()):
            self._abandon(state, "the process ended before its sampler returned")

    def _read(self, read: Callable[[], Step]) -> Step | None:
        """``read()``, or None after disarming when it failed (ours, not the engine's)."""
        try:
            return read()
        except Exception:  # our reading failed, not the engine: disarm, let the step run
            logging.getLogger(f"enginetap.{self.engine.lower()}").exception(
                "enginetap: reading %s's step failed; the step context disarms", self.engine)
            (self.on_failure or self.uninstall)()
            return None

    def _begin(self, state: RunnerState, step: Step) -> None:
        state.active = publish(step)
        state.active.__enter__()

    def _sample(self, state: RunnerState, wrapped: Any, args: tuple, kwargs: dict,
                fill: Callable[[Step, Any], None]) -> Any:
        """Run the sampler of the step in flight; it ends (``fill`` sets what it sampled)
        when the sampler returned and is abandoned when it raised."""
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            ending = isinstance(exc, (SystemExit, KeyboardInterrupt))
            self._abandon(state, f"its sampler raised {type(exc).__name__}"
                          + (" (the process is ending)" if ending else ""))
            raise
        active, state.active = state.active, None
        self._cleared(state)
        state.next_step += 1
        assert active is not None
        fill(active.step, result)
        active.__exit__(None, None, None)
        return result

    def _abandon(self, state: RunnerState, why: str = "") -> None:
        """Drop a begun step without end listeners: it never sampled, so it is not real.
        ``why``: the reason, when it is not the engine's own (logged with the step)."""
        if state.active is None:
            return
        if why:
            logging.getLogger(f"enginetap.{self.engine.lower()}").warning(
                "enginetap: %s step %d on rank %d was not recorded: %s", self.engine,
                state.active.step.step, self.rank, why)
        state.active = None
        self._cleared(state)
        context.abandon()

    def _cleared(self, state: RunnerState) -> None:
        """The step in flight ended or was dropped (an engine's own bookkeeping)."""
