"""Damaged or crafted tap files: every reader (report, diff) says "bad record at
FILE:LINE: why" in one line and exits 2 (never a traceback, never 1, which would say the
runs diverged); FIFOs, devices and giant lines are refused without hanging or filling
memory."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .tap_helpers import enginetap, one_error_line, record_tap, tap_lines, write_tap


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_tap(tmp_path_factory.mktemp("tap-records") / "good")


def _first_step(records: list[Any]) -> dict[str, Any]:
    return records[1]


def _set(field: str, value: Any) -> Callable[[list[Any]], None]:
    return lambda records: _first_step(records).__setitem__(field, value)


def _row(change: Callable[[dict[str, Any]], Any]) -> Callable[[list[Any]], None]:
    return lambda records: change(_first_step(records)["rows"][0])


def _row_value(records: list[Any], value: Any) -> None:
    _first_step(records)["rows"][0] = value


def _line(text: str, line: int = 1) -> Callable[[list[Any]], None]:
    return lambda records: records.__setitem__(line, text)


DEEP = "[" * 100_000 + "]" * 100_000
GIANT = '{"step": ' + "9" * 5000 + ', "mode": "decode", "rows": [], "checkpoints": [], ' \
        '"hashes": []}'

BAD_STEPS: dict[str, tuple[Callable[[list[Any]], None], str]] = {
    "row without key": (_row(lambda r: r.pop("key")), "'key'"),
    "row not an object": (lambda records: _row_value(records, 5), "row 0"),
    "row pos a string": (_row(lambda r: r.__setitem__("pos", "3")), "'pos'"),
    "row prefix a number": (_row(lambda r: r.__setitem__("prefix", 7)), "'prefix'"),
    "sampled a list": (_set("sampled", [1, 2]), "'sampled'"),
    "sampler entry a number": (_set("sampler", [1]), "'sampler'"),
    "sampler gap a string": (_set("sampler", [{"argmax": 1, "gap": "small"}]), "'sampler'"),
    "checkpoint name a number": (
        lambda records: _first_step(records)["checkpoints"].__setitem__(0, 5), "checkpoint"),
    "step a bool": (_set("step", True), "'step'"),
    "deep nesting": (_line(DEEP), "nested"),
    "giant integer": (_line(GIANT), "digits"),
}

BAD_HEADERS: dict[str, tuple[Callable[[list[Any]], None], str]] = {
    "deep nesting": (_line(DEEP, 0), "nested"),
    "models not a list": (lambda records: records[0].__setitem__("models", 5), "'models'"),
    "model not an object": (lambda records: records[0].__setitem__("models", ["llama"]),
                            "'models'"),
    "world size a string": (lambda records: records[0].__setitem__("world_size", "two"),
                            "'world_size'"),
    "world size huge": (lambda records: records[0].__setitem__("world_size", 10 ** 12),
                        "'world_size'"),
}


def _damaged(good: Path, tmp_path: Path, change: Callable[[list[Any]], None]) -> Path:
    records: list[Any] = tap_lines(good)
    change(records)
    run = tmp_path / "bad"
    write_tap(run, records)
    return run


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_a_bad_step_record_is_named_by_report_and_diff(good: Path, tmp_path: Path,
                                                       case: str) -> None:
    change, why = BAD_STEPS[case]
    run = _damaged(good, tmp_path, change)
    where = f"bad record at {run / 'tap-rank0.jsonl'}:2: "
    for args in (["report", str(run)], ["diff", str(good), str(run)],
                 ["diff", str(run), str(good), "--json"]):
        line = one_error_line(enginetap("tap", *args), where)
        assert why in line, line


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_a_bad_header_is_named_by_report_and_diff(good: Path, tmp_path: Path,
                                                  case: str) -> None:
    change, why = BAD_HEADERS[case]
    run = _damaged(good, tmp_path, change)
    where = f"bad record at {run / 'tap-rank0.jsonl'}:1: "
    for args in (["report", str(run)], ["diff", str(good), str(run)]):
        line = one_error_line(enginetap("tap", *args, timeout=120), where)
        assert why in line, line


def test_a_fifo_as_the_rank_file_is_refused_without_hanging(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "tap-rank0.jsonl")
    for args in (["report", str(run)], ["report", str(run / "tap-rank0.jsonl")],
                 ["diff", str(run), str(run)]):
        one_error_line(enginetap("tap", *args, timeout=60), "tap-rank0.jsonl",
                       "FIFO (named pipe)")


@pytest.mark.parametrize("given", ["link", "device"])
def test_dev_zero_is_refused_without_reading_it(tmp_path: Path, given: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "tap-rank0.jsonl").symlink_to("/dev/zero")
    target = run if given == "link" else Path("/dev/zero")
    one_error_line(enginetap("tap", "report", str(target), timeout=60), "character device")


def test_a_giant_line_costs_bounded_memory(good: Path, tmp_path: Path) -> None:
    """A 1 GiB sparse regular file of NUL bytes after a good header: one line far past
    the per-line bound, refused without reading it into memory (the reader runs under a
    1 GiB address-space limit; reading the file whole needs twice that)."""
    import resource

    run = tmp_path / "run"
    run.mkdir()
    path = run / "tap-rank0.jsonl"
    shutil.copy(good / "tap-rank0.jsonl", path)
    with path.open("r+b") as f:
        f.truncate(1 << 30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = enginetap("tap", "report", str(run), timeout=300, preexec=limit)
    line = one_error_line(done, "bad record at", "longer than")
    assert json.dumps(str(path))[1:-1] in line


def test_the_analysis_imports_no_torch() -> None:
    """Reading and analysing tap files needs no torch (a reader starts in a second, not
    ten, and the analysis side stays apart from the recording side)."""
    import subprocess
    import sys

    code = ("import sys, enginetap.tap.analysis.files, enginetap.tap.analysis.report, "
            "enginetap.tap.analysis.diff; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.strip() == "False", done.stderr
