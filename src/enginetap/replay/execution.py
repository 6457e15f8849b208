"""Where references and candidates run: enginetap's own references here, the rest in a child.

A candidate solution and a reference the user trusted from a dataset are foreign code: they
may call ``sys.exit``, raise ``KeyboardInterrupt``, call ``os._exit`` or crash. They run in an
:class:`enginetap.core.isolated.Child`, so that any of that becomes a :class:`FunctionFailed`
for the workload it happened on (the child is started again for the next one) and never ends
the replay. Tensors go to and from the child as safetensors files in a private temporary
directory; scalars and everything else as JSON. enginetap's regenerated references run
in a child too, under the same limits (:class:`LocalFunction` calls a function in this
process with the same convention, for callers that trust it and need no limits).

Limits: loading a function (importing a solution, compiling a reference) and every call
take at most ``timeout`` seconds; during a call the child's data segment (heap and
anonymous mappings, ``RLIMIT_DATA``) may grow by at most ``memory`` bytes, so code that
allocates past it fails with a one-line error instead of exhausting the machine.

Both return a :class:`Called`: the outputs of one call, whether they were written into
destination buffers, and the median time of ``repeats`` further calls (after ``warmup``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginetap.core.isolated import Child, ChildDied, one_line
from enginetap.dataset.schema import Definition
from enginetap.errors import ConfigError
from enginetap.replay.solution import (
    CallPlan,
    declared_claim,
    load_solution,
    scrub_freed_memory,
)
from enginetap.replay.timing import median_ms

if TYPE_CHECKING:
    import torch

__all__ = ["Called", "ChildFunction", "FunctionFailed", "LocalFunction", "Timing", "child"]

_INPUTS, _OUTPUTS = "inputs.safetensors", "outputs.safetensors"


class FunctionFailed(Exception):
    """The function raised, returned the wrong thing, or ended its process (one line)."""


@dataclass(frozen=True)
class Timing:
    device: str
    warmup: int
    repeats: int
    timeout: float | None = None
    """Seconds a call in a child may take (warm-up and timed runs included); None: no
    limit. A call past it is killed with its process."""
    memory: int | None = None
    """Bytes a call in a child may allocate beyond what its process held before it; None:
    no limit."""


@dataclass
class Called:
    outputs: dict[str, torch.Tensor]
    destination: bool
    """The outputs were written into poisoned buffers (destination-passing)."""
    ms: float | None


def _run(function: Callable[..., Any], plan: CallPlan, inputs: Mapping[str, Any],
         axes: Mapping[str, int], timing: Timing, scrub: Iterable[int]) -> Called:
    scrub_freed_memory(scrub, timing.device)
    args, kwargs = plan.prepare(inputs, axes, timing.device)
    outputs = plan.collect(function(*args, **kwargs), args, kwargs)
    ms = median_ms(function, lambda: plan.prepare(inputs, axes, timing.device),
                   device=timing.device, warmup=timing.warmup, repeats=timing.repeats)
    return Called(outputs, bool(plan.destinations), ms)


class LocalFunction:
    """enginetap's own regenerated reference, called in this process."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def call(self, definition: Definition, inputs: Mapping[str, Any], axes: Mapping[str, int],
             timing: Timing, scrub: Iterable[int] = ()) -> Called:
        """Raises FunctionFailed: the call raised or returned the wrong outputs."""
        try:
            return _run(self.function, CallPlan(definition), inputs, axes, timing, scrub)
        except Exception as exc:  # enginetap's reference on stored data: report, go on
            raise FunctionFailed(one_line(exc)) from None

    def close(self) -> None:
        """Nothing to release: it runs in this process."""


def child() -> Child:
    """A child process that :class:`ChildFunction` objects can share (started on first use)."""
    return Child("enginetap.replay.execution:serve")


class ChildFunction:
    """A candidate (``solution``) or a trusted dataset reference, called in a child process.

    Several may share one ``process`` (the trusted references of a replay, to start one
    interpreter rather than one per definition); without one it gets its own. Each is
    loaded again whenever the process had to be started again.
    """

    def __init__(self, process: Child | None = None, *, solution: str | None = None,
                 reference: str | None = None, name: str = "<reference>") -> None:
        key = "candidate" if solution is not None else f"reference {name}"
        self._load = ({"op": "load", "key": key, "solution": solution} if solution is not None
                      else {"op": "load", "key": key, "reference": reference, "name": name})
        self._key, self._own = key, process is None
        self._child = process if process is not None else child()
        self._loaded_in: int | None = None
        self.loaded: dict[str, Any] = {}
        """The child's answer to the last load (a user's function: ``claim``)."""
        self._dir = Path(tempfile.mkdtemp(prefix="enginetap-replay-"))

    def start(self, timeout: float | None = None) -> None:
        """Start the child and load the function there, within ``timeout`` seconds.

        Raises:
            ConfigError: a solution cannot be imported (or ended its process importing, or
                took longer than ``timeout``).
            FunctionFailed: a reference cannot be loaded.
        """
        try:
            if not self._child.running:
                # The interpreter and torch start without the limit (enginetap's own
                # imports, slow on a busy machine); the function's own import runs under it.
                self._child.request({"op": "warm"})
            reply = self._child.request(self._load, timeout)
        except ChildDied as exc:
            reply = {"error": str(exc)}
        if "config_error" in reply:
            raise ConfigError(*reply["config_error"])
        if "error" in reply:
            if "solution" in self._load:
                raise ConfigError(f"cannot load solution {self._load['solution']!r}",
                                  f"importing it failed: {reply['error']}",
                                  "run the solution's module on its own to see why")
            raise FunctionFailed(reply["error"])
        self._loaded_in, self.loaded = self._child.starts, reply

    def call(self, definition: Definition, inputs: Mapping[str, Any], axes: Mapping[str, int],
             timing: Timing, scrub: Iterable[int] = ()) -> Called:
        """Raises FunctionFailed: it raised, returned the wrong outputs or ended its process."""
        import safetensors.torch

        tensors = {k: v for k, v in inputs.items() if hasattr(v, "shape")}
        message = {"op": "call", "key": self._key, "dir": str(self._dir),
                   "definition": definition.model_dump_json(),
                   "scalars": {k: v for k, v in inputs.items() if k not in tensors},
                   "axes": dict(axes), "device": timing.device, "warmup": timing.warmup,
                   "repeats": timing.repeats, "scrub": list(scrub), "memory": timing.memory}
        try:
            _save(tensors, self._dir / _INPUTS)
            if not self._child.running or self._loaded_in != self._child.starts:
                self.start(timing.timeout)
            reply = self._child.request(message, timing.timeout)
        except (ChildDied, ConfigError, OSError) as exc:  # OSError: no room for the inputs
            raise FunctionFailed(str(exc)) from None
        if "error" in reply:
            raise FunctionFailed(reply["error"])
        try:
            loaded = safetensors.torch.load_file(str(self._dir / _OUTPUTS))
        except Exception as exc:  # e.g. the child's disk filled up mid-write
            raise FunctionFailed(f"cannot read its outputs back: {one_line(exc)}") from None
        outputs = {name: loaded[name].to(timing.device) for name in reply["outputs"]}
        return Called(outputs, reply["destination"], reply["ms"])

    def reset(self) -> None:
        """End its own child, so that the next call starts a fresh process.

        After a failure the process may be unusable though alive: a CUDA error (an illegal
        memory access) poisons the context of the process it happened in, and every later
        CUDA call there fails too.
        """
        if self._own:
            self._child.close()

    def close(self) -> None:
        """Remove the temporary directory, and end the child unless it is shared."""
        if self._own:
            self._child.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _save(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    import safetensors.torch
    import torch

    # Own contiguous CPU copies: safetensors refuses views of one shared buffer.
    safetensors.torch.save_file(
        {k: t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)
         for k, t in tensors.items()}, str(path))


# ----------------------------------------------------------------------- in the child

_LOADED: dict[str, tuple[Any, str]] = {}
"""Loaded functions by key: the function and its kind (``candidate`` or ``reference``), or a
built-in solution or Solution file (``adapter``) that makes the function per definition."""


def serve(message: dict[str, Any]) -> dict[str, Any]:
    """The child's side of :class:`ChildFunction` (``enginetap.core.isolated`` calls it)."""
    if message["op"] == "warm":
        import safetensors.torch  # noqa: F401  (and torch with it)

        return {}
    if message["op"] == "load":
        return _load(message)
    return _call(message)


def _load(message: dict[str, Any]) -> dict[str, Any]:
    from enginetap.definitions.base import compile_reference
    from enginetap.errors import EnginetapError

    from enginetap.replay.builtin import builtin_named
    from enginetap.replay.fib import read_solution

    solution = message.get("solution") or ""
    builtin = builtin_named(solution)
    if builtin is not None:
        _LOADED[message["key"]] = (builtin, "adapter")
    elif solution.endswith(".json"):  # a flashinfer-bench Solution file
        try:
            _LOADED[message["key"]] = (read_solution(solution), "adapter")
        except EnginetapError as exc:
            return {"config_error": [exc.what, exc.why, exc.fix]}
    elif message.get("solution") is not None:
        try:
            function = load_solution(message["solution"])
            _LOADED[message["key"]] = (function, "candidate")
            return {"claim": declared_claim(function)}  # what it says it implements
        except EnginetapError as exc:
            return {"config_error": [exc.what, exc.why, exc.fix]}
    else:
        _LOADED[message["key"]] = (compile_reference(message["reference"], message["name"]),
                                   "reference")
    return {}


def _call(message: dict[str, Any]) -> dict[str, Any]:
    import safetensors.torch

    definition = Definition.model_validate_json(message["definition"])
    folder, device = Path(message["dir"]), message["device"]
    tensors = safetensors.torch.load_file(str(folder / _INPUTS), device=device)
    inputs = {name: tensors[name] if name in tensors else message["scalars"][name]
              for name in definition.inputs}
    function, kind = _LOADED[message["key"]]
    if kind == "adapter":  # a built-in's or a Solution file's function for this definition
        function = function.adapter(definition)
    plan = (CallPlan(definition) if kind == "reference"
            else CallPlan.for_function(function, definition))
    memory = message.get("memory")
    with _memory_bound(memory):
        try:
            called = _run(function, plan, inputs, message["axes"],
                          Timing(device, message["warmup"], message["repeats"]),
                          message["scrub"])
        except (MemoryError, RuntimeError) as exc:
            if memory is None or not isinstance(exc, MemoryError) and \
                    "allocate memory" not in str(exc):
                raise
            raise MemoryError(f"it allocated past the memory limit of {memory >> 20} MiB per "
                              "call (--memory-limit)") from None
    _save(called.outputs, folder / _OUTPUTS)
    return {"outputs": list(called.outputs), "destination": called.destination, "ms": called.ms}


@contextmanager
def _memory_bound(limit: int | None) -> Iterator[None]:
    """Let this process's data segment grow by at most ``limit`` bytes inside the block."""
    if limit is None:
        yield
        return
    try:
        import resource

        status = Path("/proc/self/status").read_text()
        held = int(status.split("VmData:")[1].split()[0]) * 1024
        old = resource.getrlimit(resource.RLIMIT_DATA)
    except (ImportError, OSError, IndexError, ValueError):  # not Linux: no bound to set
        yield
        return
    hard = old[1]
    soft = held + limit if hard == resource.RLIM_INFINITY else min(held + limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)
