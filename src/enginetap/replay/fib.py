"""flashinfer-bench ``Solution`` files: candidates that travel to and from flashinfer-bench.

A Solution (flashinfer-bench's ``data/solution.py``) names one definition, its build spec
(``language``, ``target_hardware``, ``entry_point`` as ``file::function``, ``dependencies``,
``destination_passing_style``) and its sources as ``{path, content}``. The models here read
and write that JSON without importing flashinfer-bench (its own schema checks them in the
tests).

Writing: :func:`builtin_solution` turns a built-in solution and a definition into a Solution
whose one source, ``main.py``, builds the adapter through enginetap (a dependency, with the
kernel library), ``run`` returning the outputs. Reading: ``--solution path/to/x.json`` loads
a Python or Triton Solution: its sources are written into a private temporary directory of
the child process that runs it and the entry file is imported by path. In destination-passing
style the outputs are the last positional arguments, whatever the function calls them. A
Solution for another definition, or in a language that needs flashinfer-bench's builder
(CUDA, C++, TileLang), is SKIPPED with that reason.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from enginetap.errors import ConfigError

if TYPE_CHECKING:
    from enginetap.dataset.schema import Definition
    from enginetap.replay.builtin import BuiltinSolution

__all__ = ["FibSolution", "builtin_solution", "read_solution", "write_builtin_solutions"]

_RUNNABLE = ("python", "triton")


class SourceFile(BaseModel):
    path: str = Field(min_length=1)
    content: str = Field(min_length=1)

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        parts = PurePosixPath(value)
        if parts.is_absolute() or ".." in parts.parts:
            raise ValueError(f"source path {value!r} must be relative, without '..'")
        return value


class BuildSpec(BaseModel):
    language: str
    target_hardware: list[str] = Field(min_length=1)
    entry_point: str
    dependencies: list[str] = Field(default_factory=list)
    destination_passing_style: bool = True
    binding: str | None = None

    @field_validator("entry_point")
    @classmethod
    def _entry(cls, value: str) -> str:
        if value.count("::") != 1:
            raise ValueError(f"entry_point {value!r} is not 'file::function'")
        return value


class FibSolution(BaseModel):
    """A flashinfer-bench Solution, as its JSON holds it."""

    name: str = Field(min_length=1)
    definition: str = Field(min_length=1)
    author: str = Field(min_length=1)
    spec: BuildSpec
    sources: list[SourceFile] = Field(min_length=1)
    description: str | None = None
    _made: dict[str, Callable[..., Any]] = PrivateAttr(default_factory=dict)

    def skip_reason(self, definition: Definition) -> str | None:
        """Why it is not run on ``definition`` (None: it is)."""
        if definition.name != self.definition:
            return f"the solution {self.name!r} is for definition {self.definition!r}"
        if self.spec.language not in _RUNNABLE:
            return (f"its language {self.spec.language!r} needs flashinfer-bench's builder; "
                    f"enginetap runs {' and '.join(_RUNNABLE)} solutions")
        return None

    def adapter(self, definition: Definition) -> Callable[..., Any]:
        """The entry function (in a temporary directory), called as the definition says.

        Raises:
            ValueError: the entry file is not among the sources or lacks the function.
        """
        made = self._made.get(definition.name)
        if made is None:
            made = self._made[definition.name] = self._load(definition)
        return made

    def _load(self, definition: Definition) -> Callable[..., Any]:
        import atexit
        import shutil

        from enginetap.replay.solution import load_solution

        folder = Path(tempfile.mkdtemp(prefix="enginetap-fib-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        for source in self.sources:
            (folder / source.path).parent.mkdir(parents=True, exist_ok=True)
            (folder / source.path).write_text(source.content)
        file, _, function = self.spec.entry_point.partition("::")
        if file not in {s.path for s in self.sources}:
            raise ValueError(f"entry file {file!r} is not among the sources")
        entry = load_solution(f"{folder / file}:{function}")
        if not self.spec.destination_passing_style:
            return entry
        return _positional_destinations(entry, [*definition.inputs, *definition.outputs])


def _positional_destinations(entry: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
    """``entry`` behind a signature of positional-only inputs then outputs, so that replay
    passes poisoned output buffers last, as flashinfer-bench does."""

    def run(*args: Any) -> None:
        entry(*args)

    run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
    return run


MAX_SOLUTION_BYTES = 64 << 20
"""Largest Solution JSON read (its sources included)."""


def read_solution(path: str | Path) -> FibSolution:
    """Parse a Solution JSON file: a regular file of at most :data:`MAX_SOLUTION_BYTES`.

    Raises:
        ConfigError: it cannot be read (not a regular file, too large) or is not a Solution.
    """
    from enginetap.dataset.files import read_capped

    try:
        return FibSolution.model_validate_json(read_capped(Path(path), MAX_SOLUTION_BYTES))
    except (OSError, ValidationError) as exc:
        why = (exc.strerror or str(exc) if isinstance(exc, OSError)
               else "; ".join(str(exc).splitlines()[0:3]))
        raise ConfigError(f"cannot read the solution file {path}", why,
                          "pass a flashinfer-bench Solution JSON (a regular file)") from None


def _safe(kind: str, value: str) -> str:
    """``value`` if it may name a file and appear in generated code, else ConfigError."""
    from enginetap.dataset.paths import safe_component
    from enginetap.errors import DatasetError

    try:
        return safe_component(kind, value)
    except DatasetError as exc:
        raise ConfigError(f"{kind} {value!r} cannot be used in a Solution", exc.why,
                          f"rename the definition's {kind} (letters, digits, '_', '.', '-')"
                          ) from None


def builtin_solution(builtin: BuiltinSolution, definition: Definition) -> FibSolution:
    """``builtin`` as a Solution for ``definition`` (it must cover the family).

    The dataset's strings reach the generated code only as Python literals (``repr``), and a
    name or op_type that is not a safe file name is refused.

    Raises:
        ConfigError: the definition's name or op_type is not a safe name.
    """
    _safe("op_type", definition.op_type)
    _safe("name", definition.name)
    doc = f"enginetap built-in solution {builtin.name} for {definition.name}: {builtin.summary}."
    source = (f"{doc!r}\n\n"
              "import json\n\n"
              "from enginetap.dataset.schema import Definition\n"
              "from enginetap.replay.builtin import builtin_named\n\n"
              f"DEFINITION = Definition.model_validate(json.loads({definition.model_dump_json()!r}))\n"
              f"run = builtin_named({builtin.name!r}).adapter(DEFINITION)\n")
    language = "python" if builtin.modules == ("torch",) else "triton"
    return FibSolution(
        name=f"enginetap_{builtin.name.replace(':', '_')}_{definition.name}",
        definition=definition.name, author="enginetap", description=builtin.summary,
        spec=BuildSpec(language=language, target_hardware=list(builtin.devices),
                       entry_point="main.py::run", destination_passing_style=False,
                       dependencies=["enginetap", *builtin.library.split()]),
        sources=[SourceFile(path="main.py", content=source)])


def write_builtin_solutions(root: str | Path, builtin: BuiltinSolution,
                            definitions: list[Definition]) -> list[Path]:
    """Write ``solutions/<op_type>/<definition>/<name>.json`` under ``root`` for each
    definition ``builtin`` covers; returns the files written.

    Every name is checked before anything is written, and every path must stay under
    ``root/solutions`` (links followed).

    Raises:
        ConfigError: a definition's name or op_type is not a safe name, or a path would
            lead outside ``root``.
    """
    from enginetap.definitions.base import family_of

    covered = [(d, builtin_solution(builtin, d)) for d in definitions
               if family_of(d) in builtin.adapters]
    base = Path(root, "solutions")
    written = []
    for definition, solution in covered:
        path = Path(base, definition.op_type, definition.name, f"{solution.name}.json")
        real = path.resolve()
        if not real.is_relative_to(base.resolve()):
            raise ConfigError(f"refusing to write {path}", f"it resolves to {real}, outside "
                              f"{base} (through a symlink)",
                              "pass a new --write-solutions directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(solution.model_dump(exclude_none=True), indent=2) + "\n")
        written.append(path)
    return written
