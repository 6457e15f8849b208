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


def read_solution(path: str | Path) -> FibSolution:
    """Parse a Solution JSON file.

    Raises:
        ConfigError: it cannot be read or is not a Solution.
    """
    try:
        return FibSolution.model_validate_json(Path(path).read_bytes())
    except (OSError, ValidationError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc).splitlines()[0:3]
        raise ConfigError(f"cannot read the solution file {path}", str(why),
                          "pass a flashinfer-bench Solution JSON") from None


def builtin_solution(builtin: BuiltinSolution, definition: Definition) -> FibSolution:
    """``builtin`` as a Solution for ``definition`` (it must cover the family)."""
    source = (f'"""enginetap built-in solution {builtin.name} for {definition.name}: '
              f'{builtin.summary}."""\n\n'
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
    definition ``builtin`` covers; returns the files written."""
    from enginetap.definitions.base import family_of

    written = []
    for definition in definitions:
        if family_of(definition) not in builtin.adapters:
            continue
        solution = builtin_solution(builtin, definition)
        path = Path(root, "solutions", definition.op_type, definition.name,
                    f"{solution.name}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(solution.model_dump(exclude_none=True), indent=2) + "\n")
        written.append(path)
    return written
