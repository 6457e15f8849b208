"""Hostile Solution files: names that inject code or escape ``--write-solutions OUT``, and a
``--solution x.json`` that is a FIFO or ``/dev/zero``.

Each CLI test runs the real ``enginetap`` command in a fresh process, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import enginetap
from enginetap.dataset import Dataset
from enginetap.definitions import get_template
from enginetap.replay.synth import synthesize

SRC = Path(enginetap.__file__).resolve().parents[1]
ENGINETAP = Path(sys.executable).parent / "enginetap"


def _enginetap(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([str(ENGINETAP), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _sdpa_dataset(root: Path, **changes: str) -> Path:
    """A gqa_paged_decode dataset (covered by ``torch:sdpa``) whose definition file is
    rewritten with ``changes`` (e.g. a hostile ``name``)."""
    dataset = Dataset(root, create=True)
    definition = synthesize(dataset, get_template("gqa_paged_decode"), workloads=1, seed=1)
    if changes:
        (path,) = (root / "definitions").rglob("*.json")
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
        assert definition.name  # the workloads keep the old name: no matter for writing
    return root


_INJECTED = 'x"""\nopen(__file__ + ".pwned", "w").close()\n"""'


def test_a_name_that_would_inject_code_is_refused(tmp_path: Path) -> None:
    ds = _sdpa_dataset(tmp_path / "ds", name=_INJECTED)
    out = tmp_path / "out"
    done = _enginetap("replay", str(ds), "--solution", "torch:sdpa", "--write-solutions",
                      str(out), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot be used" in done.stderr and "Traceback" not in done.stderr
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not any('open(__file__' in p.read_text() for p in written), written


def test_generated_code_quotes_every_dataset_string(tmp_path: Path) -> None:
    """The text of main.py holds the definition only as a Python literal: compiling it and
    reading its docstring gives back the name, whatever quotes the summary had."""
    import ast

    from enginetap.replay.builtin import builtin_named
    from enginetap.replay.fib import builtin_solution

    definition = get_template("gqa_paged_decode").example_definition()
    definition = definition.model_copy(update={"description": 'say """ and \'\'\' \\'})
    source = builtin_solution(builtin_named("torch:sdpa"), definition).sources[0].content
    tree = ast.parse(source)
    assert definition.name in (ast.get_docstring(tree) or "")
    # Top level: the docstring, imports and two assignments; nothing else runs at import.
    kinds = [type(node).__name__ for node in tree.body]
    assert kinds == ["Expr", "Import", "ImportFrom", "ImportFrom", "Assign", "Assign"], kinds


@pytest.mark.parametrize("field,value", [
    ("op_type", "../../escaped"), ("op_type", "ABS"), ("name", "../../../escaped"),
    ("name", "ABS"), ("name", "a/../../b"),
])
def test_paths_from_the_dataset_never_leave_out(tmp_path: Path, field: str, value: str) -> None:
    # An absolute path, inside tmp_path so that a failing run writes nowhere else.
    value = str(tmp_path / "abs-target") if value == "ABS" else value
    ds = _sdpa_dataset(tmp_path / "ds", **{field: value})
    out = tmp_path / "deep" / "er" / "out"
    victim = tmp_path / "escaped"
    before = {p for p in tmp_path.rglob("*") if not p.is_relative_to(out)}
    done = _enginetap("replay", str(ds), "--solution", "torch:sdpa", "--write-solutions",
                      str(out), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{field} {value!r} cannot be used" in done.stderr, done.stderr
    after = {p for p in tmp_path.rglob("*") if not p.is_relative_to(out)}
    assert after == before and not victim.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_solution_file_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    ds = _sdpa_dataset(tmp_path / "ds")
    fifo = tmp_path / "x.json"
    os.mkfifo(fifo)
    done = _enginetap("replay", str(ds), "--solution", str(fifo), cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "a FIFO (named pipe), not a regular file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_solution_file_without_end_is_refused(tmp_path: Path) -> None:
    ds = _sdpa_dataset(tmp_path / "ds")
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    done = _enginetap("replay", str(ds), "--solution", str(link), cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "a symlink to a character device" in done.stderr, done.stderr


def test_a_huge_solution_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from enginetap.errors import ConfigError
    from enginetap.replay import fib

    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(fib.MAX_SOLUTION_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ConfigError, match="byte limit"):
        fib.read_solution(big)
