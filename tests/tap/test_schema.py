"""The tap file's schema: every line the recorder writes validates through it and, built
again through the writer's functions, is the same bytes; the analysis imports no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from enginetap.core.jsonl import NonFinite, RankJsonl, close_all
from enginetap.tap.schema import TapHeader, TapStep, header_record, step_record

from .conftest import Recorder, requests


def _rebuilt(line: bytes, out: Path) -> bytes:
    """``line`` validated through its model, dumped, built again with the writer's
    function and written by the per-rank writer the recorder uses."""
    raw = json.loads(line)
    model = TapHeader if raw.get("kind") == "header" else TapStep
    fields = model.model_validate(raw).model_dump(exclude_unset=True)
    step, rank = fields.pop("step"), fields.pop("rank")
    if model is TapHeader:
        del fields["kind"], fields["format"], fields["version"]
        record = header_record(**fields)
    else:
        del fields["kind"]
        record = step_record(**fields)
        if not all(math.isfinite(s[k]) for s in record["sampler"] for k in ("top1", "top2")):
            record = NonFinite(record)
    writer = RankJsonl(out / "again.jsonl", rank, fast=True)
    writer.write(record, step=step)
    writer.close()
    return writer.path.read_bytes()


@pytest.mark.parametrize("model", ["llama", "qwen3_next"])
def test_recorded_lines_are_the_schema_bytes(record: Recorder, tmp_path: Path,
                                             model: str) -> None:
    reqs = requests(["kernels and caches", "the cache holds every key",
                     "kernels and caches"], max_new_tokens=3)
    _, run = record(model, reqs, out=tmp_path / "run")
    lines = (tmp_path / "run" / "tap-rank0.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 + len(run.rank(0).steps) > 3
    for number, line in enumerate(lines, 1):
        (tmp_path / "again-rank0.jsonl").unlink(missing_ok=True)
        assert _rebuilt(line, tmp_path) == line, f"line {number}"
    close_all()


def test_the_writer_functions_keep_the_schema_order_and_refuse_other_fields() -> None:
    step = step_record(hashes=["0" * 16], sampler=[], rows=[{"key": "a", "pos": 0}],
                       checkpoints=["L0.in"], mode="decode", engine="e", sampled={},
                       dropped=[])
    assert list(step) == ["kind", "mode", "engine", "rows", "checkpoints", "sampled",
                          "hashes", "sampler"]  # no dropped checkpoint: no field
    assert list(step_record(dropped=["L0.in"], mode="decode")) == ["kind", "mode", "dropped"]
    assert list(header_record(host="h", engine="e"))[:5] == ["kind", "format", "version",
                                                             "engine", "host"]
    with pytest.raises(TypeError, match="no field.*hashs"):
        step_record(hashs=[])
    assert TapStep.model_validate({"step": 0, **step}).sampled == {}


def test_the_schema_refuses_hashes_that_do_not_match() -> None:
    from pydantic import ValidationError

    step: dict[str, Any] = {"step": 0, "mode": "decode", "rows": [{"key": "a", "pos": 0}],
                            "checkpoints": ["L0.in", "L0.out"], "hashes": ["0" * 16]}
    with pytest.raises(ValidationError, match="hashes do not match"):
        TapStep.model_validate(step)
    with pytest.raises(ValidationError, match="valid integer"):
        TapStep.model_validate({**step, "step": True, "hashes": ["0" * 16] * 2})


def test_the_analysis_imports_no_torch() -> None:
    """Reading, analysing and reporting tap runs happens offline: no torch, nothing of the
    recording side (a fresh interpreter, every module of the analysis package)."""
    recording = ("enginetap.tap.record", "enginetap.tap.record.points", "enginetap.tap.record.fingerprint")
    code = ("import importlib, pkgutil, sys\n"
            "import enginetap.tap.analysis as a, enginetap.tap.schema\n"
            "for m in pkgutil.iter_modules(a.__path__):\n"
            "    importlib.import_module(a.__name__ + '.' + m.name)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] == 'torch' "
            f"or n.startswith({recording!r})))\n"
            "print(sorted(n for n in sys.modules if n.startswith('enginetap.tap.analysis.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    pulled, loaded = done.stdout.splitlines()
    assert pulled == "[]"
    assert "enginetap.tap.analysis.report" in loaded and "enginetap.tap.analysis.files" in loaded
