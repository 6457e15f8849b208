"""Armed built-in engines for tap tests; every arming is removed after its test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.files import TapRun, load_run

Recorder = Callable[..., tuple[list[list[int]], TapRun]]


def requests(prompts: list[str], max_new_tokens: int = 5) -> list[Request]:
    return [Request(request_id=f"r{i}", prompt=p, max_new_tokens=max_new_tokens)
            for i, p in enumerate(prompts)]


def overwrite_between_steps(mp: pytest.MonkeyPatch, at_step: int, write: Any) -> None:
    """After step ``at_step`` of the built-in engine sampled (still inside it), run
    ``write(cache)``: a cache row changed between steps, as a stray kernel would."""
    original = HFEngine._advance

    def advance(self: HFEngine, seqs: Any, logits: Any, cache: Any, mask: Any) -> Any:
        result = original(self, seqs, logits, cache, mask)
        if self.steps == at_step:
            write(cache)
        return result

    mp.setattr(HFEngine, "_advance", advance)


def named_first(clean: TapRun | None, faulted: TapRun | None, where: tuple[str, int, str],
                agrees: str) -> None:
    """``tap diff`` of ``clean`` against ``faulted`` names ``(request, step, checkpoint)``
    first, that request only, and the request's row at ``agrees`` (an input of the
    checkpoint) is unchanged: the fault is in the checkpoint or what it read, not before."""
    assert clean is not None and faulted is not None
    (result,) = diff_runs(clean, faulted)
    first = result.first
    assert first is not None
    key, at, _ = where
    assert (first.key, first.step_a, first.checkpoint) == where
    assert set(result.per_request) == {key}
    step = next(s for s in faulted.rank(0).steps if s.step == at)
    base = next(s for s in clean.rank(0).steps if s.step == at)
    row = next(i for i, r in enumerate(step.rows) if r["key"] == key)
    base_row = next(i for i, r in enumerate(base.rows) if r["key"] == key)
    assert step.hashes[step.checkpoints.index(agrees)][row] == \
        base.hashes[base.checkpoints.index(agrees)][base_row]


@pytest.fixture
def record(tmp_path: Path) -> Iterator[Recorder]:
    """``record(model, reqs, dtype=..., **tap_options)``: one armed generate call."""
    made: list[int] = []

    def run(model: str, reqs: list[Request], dtype: torch.dtype = torch.float32,
            out: Path | None = None, **options: Any) -> tuple[list[list[int]], TapRun]:
        out = out or tmp_path / f"run{len(made)}"
        made.append(1)
        config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                           options={"tap": options, "step": {"record": False}})
        try:
            engine = HFEngine.from_builtin(model, dtype=dtype, prefix_cache_size=0, arm=config)
            outputs = [c.output_ids for c in engine.generate(reqs)]
        finally:
            disarm()
            close_all()
        return outputs, load_run(out)

    yield run
    disarm()
    close_all()
