"""Calling references and candidate solutions the same way, and checking what they leave.

A candidate is imported from ``module:function`` (or ``path/to/file.py:function``) at the
user's explicit request, in the child process :mod:`enginetap.replay.execution` runs it in:
a module from Python's ``sys.path`` as it is, or that one file loaded by its path (neither
its directory nor the current one is put on ``sys.path``). It takes the definition's
inputs positionally, in order. If its signature also has a parameter for every output name,
it is destination-passing: replay allocates those buffers, poisoned (NaN for floats, the
dtype's minimum for integers; bools and packed fp4 have no spare value and start as zeros),
passes them by keyword (positionally after the inputs when the parameters are
positional-only) and reads the results from them; an element still holding poison where the
reference has another value was never written. Otherwise the
candidate returns its outputs: a tensor for one output, a tuple/list in output order or a
dict by name for several.

A user's function says what it implements, so that replay runs it only there and reports
every other definition SKIPPED: a function attribute ``enginetap_implements`` (set by the
:func:`implements` decorator, or assigned), else a module-level ``ENGINETAP_IMPLEMENTS`` in
its module; either a family name (``rmsnorm``), a definition name, or a list of them.

Before a candidate runs, :func:`scrub_freed_memory` fills and frees blocks the size of the
reference's outputs, so that a candidate reading uninitialised memory (``torch.empty``) finds
NaN bytes there rather than freshly freed results of the right shape.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from enginetap.core.isolated import one_line
from enginetap.core.patching import ResolveError, resolve
from enginetap.core.patching.targets import attribute_path
from enginetap.dataset.dtypes import torch_dtype
from enginetap.dataset.schema import Definition
from enginetap.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["FUNCTION_CLAIM", "MODULE_CLAIM", "CallPlan", "declared_claim", "implements",
           "load_solution", "nbytes", "outputs_as_dict", "poison_left", "scrub_freed_memory"]

FUNCTION_CLAIM = "enginetap_implements"
"""The function attribute naming the families or definitions a user's function implements."""
MODULE_CLAIM = "ENGINETAP_IMPLEMENTS"
"""The same for every function of a module that does not say it itself."""

_F = TypeVar("_F", bound=Callable[..., Any])


def implements(*names: str) -> Callable[[_F], _F]:
    """Decorator: the function implements these families or definitions (and nothing else).

    ``@implements("rmsnorm")`` over a kernel makes ``enginetap replay --solution
    file.py:kernel`` run it on the rmsnorm definitions only and report the others SKIPPED.
    """
    def mark(function: _F) -> _F:
        setattr(function, FUNCTION_CLAIM, list(names))
        return function
    return mark


def declared_claim(function: Callable[..., Any]) -> tuple[list[str], str] | None:
    """What ``function`` says it implements, and where it says it; None when it does not.

    Raises:
        ConfigError: the attribute is not a name or a list of names.
    """
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    for owner, attribute, where in ((function, FUNCTION_CLAIM, f"its {FUNCTION_CLAIM}"),
                                    (module, MODULE_CLAIM, f"{MODULE_CLAIM} in its module")):
        value = getattr(owner, attribute, None) if owner is not None else None
        if value is None:
            continue
        names = [value] if isinstance(value, str) else value
        if (not isinstance(names, (list, tuple, set, frozenset)) or not names
                or not all(isinstance(n, str) and n for n in names)):
            raise ConfigError(f"bad {attribute} {value!r}",
                              "it names families or definitions: a string or a list of strings",
                              f'write e.g. {attribute} = "rmsnorm"')
        return sorted(names), where
    return None


def load_solution(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` or ``file.py:function`` and return the function.

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported or the attribute
            is missing or not callable.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"bad solution {spec!r}", "expected 'module:function'",
                          "pass e.g. --solution my_kernels:rmsnorm")
    try:
        target = _load(module_name, attr)
    except BaseException as exc:  # noqa: BLE001 (sys.exit at import too: this runs in a
        # child process that exists to contain the user's code)
        if isinstance(exc, ResolveError) and exc.kind == "missing-attribute":
            target = None
        else:
            why = exc.why if isinstance(exc, ResolveError) else one_line(exc)
            raise ConfigError(f"cannot import solution module {module_name!r}",
                              why, "name a .py file (path/to/file.py:function), "
                              "or a module on Python's path (PYTHONPATH); the current "
                              "directory is not on it") from None
    if not callable(target):
        raise ConfigError(f"solution {spec!r} is not a callable",
                          f"{module_name} has no callable {attr!r}",
                          "name a function defined in that module")
    return target


def _load(module_name: str, attr: str) -> Any:
    """A module's attribute through the one resolver, or a .py file's, loaded by path."""
    if not module_name.endswith(".py"):
        return resolve(f"{module_name}:{attr}")
    return attribute_path(_import_file(module_name), attr, f"{module_name}:{attr}")


def _import_file(name: str) -> Any:
    # Only the user's own file is loaded by path: its directory (and the current one, which
    # may be a dataset's) never goes on sys.path.
    path = Path(name).resolve()
    spec = importlib.util.spec_from_file_location(f"enginetap_solution_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class CallPlan:
    """How to call one function for one definition: returning or destination-passing."""

    definition: Definition
    destinations: tuple[str, ...] = ()
    """Output names passed as buffers (empty: the function returns its outputs)."""
    positional_destinations: bool = False

    @classmethod
    def for_function(cls, function: Callable[..., Any], definition: Definition) -> CallPlan:
        """Inspect ``function``'s signature.

        Raises:
            ValueError: it takes some outputs as parameters but not all of them.
        """
        try:
            params = inspect.signature(function).parameters
        except (TypeError, ValueError):  # builtins without a signature return their outputs
            return cls(definition)
        outputs = list(definition.outputs)
        named = [o for o in outputs if o in params]
        if not named:
            return cls(definition)
        if len(named) != len(outputs):
            raise ValueError(f"takes outputs {named} as parameters but not "
                             f"{sorted(set(outputs) - set(named))}; take all or none")
        positional = all(params[o].kind is inspect.Parameter.POSITIONAL_ONLY for o in outputs)
        return cls(definition, tuple(outputs), positional)

    def prepare(self, inputs: Mapping[str, Any], axes: Mapping[str, int],
                device: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh arguments: input clones, plus poisoned output buffers when destination-passing."""
        args = tuple(_fresh(v) for v in inputs.values())
        buffers = {name: self._poisoned(name, axes, device) for name in self.destinations}
        if self.positional_destinations:
            return args + tuple(buffers.values()), {}
        return args, buffers

    def collect(self, result: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The outputs of a call made with ``prepare``'s arguments.

        Raises:
            ValueError: the result does not match the definition's outputs.
        """
        if not self.destinations:
            return outputs_as_dict(self.definition, result)
        if self.positional_destinations:
            return dict(zip(self.destinations, args[-len(self.destinations):]))
        return {name: kwargs[name] for name in self.destinations}

    def _poisoned(self, name: str, axes: Mapping[str, int], device: str) -> torch.Tensor:
        import torch

        spec = self.definition.outputs[name]
        dtype = torch_dtype(spec.dtype)
        shape = self.definition.shape_of(spec, dict(axes)) or ()
        if not _poisonable(dtype):
            return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def _fresh(value: Any) -> Any:
    # Each call gets its own copy, so a function that writes into its inputs cannot
    # change what the next call sees.
    return value.clone() if hasattr(value, "clone") else value


def outputs_as_dict(definition: Definition, result: Any) -> dict[str, torch.Tensor]:
    """Name the values a reference or candidate returned, by the definition's outputs.

    Raises:
        ValueError: wrong number of values, missing names, or a value that is not a tensor.
    """
    import torch

    names = list(definition.outputs)
    if isinstance(result, Mapping):
        missing = [n for n in names if n not in result]
        if missing:
            raise ValueError(f"returned a dict without outputs {missing}")
        values = [result[n] for n in names]
    elif isinstance(result, (tuple, list)):
        values = list(result)
    else:
        values = [result]
    if len(values) != len(names):
        raise ValueError(f"returned {len(values)} value(s); the definition has {len(names)} "
                         f"output(s) {names}")
    for name, value in zip(names, values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"output {name!r} is a {type(value).__name__}, not a tensor")
    return dict(zip(names, values))


def poison_left(buffer: torch.Tensor, reference: torch.Tensor) -> int:
    """Elements of a destination buffer still poisoned where the reference is not."""
    import torch

    if buffer.shape != reference.shape or buffer.dtype != reference.dtype:
        return 0  # the comparison reports the structural mismatch itself
    if not _poisonable(buffer.dtype):
        return 0
    if buffer.dtype.is_floating_point:
        return int((buffer.isnan() & ~reference.isnan()).sum())
    sentinel = torch.iinfo(buffer.dtype).min
    return int(((buffer == sentinel) & (reference != sentinel)).sum())


def _poisonable(dtype: torch.dtype) -> bool:
    # bool has no spare value; packed fp4 has no NaN and no arithmetic in torch.
    import torch

    return dtype not in (torch.bool, getattr(torch, "float4_e2m1fn_x2", torch.bool))


def scrub_freed_memory(sizes: Iterable[int], device: str) -> None:
    """Allocate, fill with 0xFF (NaN in every float format) and free blocks of these bytes."""
    import torch

    blocks = [torch.full((size,), 0xFF, dtype=torch.uint8, device=device) for size in sizes]
    del blocks


def nbytes(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """The byte sizes :func:`scrub_freed_memory` takes, one per tensor."""
    return [t.numel() * t.element_size() for t in tensors.values()]
