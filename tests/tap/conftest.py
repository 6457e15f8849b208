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
from enginetap.tap.analysis.files import TapRun, load_run

Recorder = Callable[..., tuple[list[list[int]], TapRun]]


def requests(prompts: list[str], max_new_tokens: int = 5) -> list[Request]:
    return [Request(request_id=f"r{i}", prompt=p, max_new_tokens=max_new_tokens)
            for i, p in enumerate(prompts)]


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
