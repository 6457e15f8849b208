"""Capture runs of the built-in engine shared by the ``test_capture_hf_*`` files.

One run per model (cached for the session): the same traffic armed with capture and then
disarmed, so fidelity, token-identity, flashinfer-bench and catalog tests read one capture.
The traffic has requests of different lengths in one batch, and a second ``generate`` call
whose first prompt extends an earlier one (a prefix-cache hit on full-attention models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from enginetap.config import ArmConfig
from enginetap.dataset import Dataset
from enginetap.dataset.schema import WorkloadLine
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm

__all__ = ["CaptureRun", "POLICY", "capture_run", "hf_capture_root", "workload_lines"]

POLICY: dict[str, Any] = {"name": "hf-tests", "decode_steps": [0, 1, 3, "last"],
                          "per_variant": 2, "per_definition": 12}
"""Prefill, a few decode steps, two workloads per variant: enough to cover each family's
variants (batch shapes, cached prefix) while keeping replay short."""

_PROMPT = [5 + (7 * i) % 400 for i in range(22)]
_CALLS: list[list[Request]] = [
    [Request("a", prompt_ids=_PROMPT, max_new_tokens=5),
     Request("b", prompt_ids=[9, 8, 7, 6, 5], max_new_tokens=3),
     Request("c", prompt_ids=[300, 301, 302, 303, 304, 305, 306, 307, 308], max_new_tokens=4)],
    # "d" extends "a"'s prompt: full-attention models reuse a's 22 cached tokens.
    [Request("d", prompt_ids=_PROMPT + [41, 42, 43], max_new_tokens=4),
     Request("e", prompt_ids=[11, 12], max_new_tokens=2)],
    # One fresh request alone: no padding, so transformers passes SDPA no mask at all
    # (is_causal prefill, enable_gqa decode).
    [Request("f", prompt_ids=[200 + i for i in range(11)], max_new_tokens=3)],
]


@dataclass(frozen=True)
class CaptureRun:
    model: str
    out_dir: Path
    armed_tokens: list[list[int]]
    disarmed_tokens: list[list[int]]
    summary: dict[str, Any]
    config: dict[str, Any]
    prefix_reuse: bool

    @property
    def dataset(self) -> Path:
        return self.out_dir / "dataset"


def _generate(engine: HFEngine, calls: list[list[Request]]) -> list[list[int]]:
    return [c.output_ids for call in calls for c in engine.generate(call)]


_RUNS: dict[str, CaptureRun] = {}


def capture_run(model: str, root: Path, *, calls: list[list[Request]] | None = None,
                capture: dict[str, Any] | None = None, tag: str = "") -> CaptureRun:
    """The capture run of ``model`` (done once per session and ``tag``, under ``root``):
    ``calls`` (default: the traffic above) armed with ``capture`` options (default: the
    :data:`POLICY`), then the same calls disarmed."""
    key = f"{model}{tag}"
    if key not in _RUNS:
        calls = calls or _CALLS
        out = root / key
        arm = ArmConfig(enabled=True, capabilities=["capture"], out_dir=out,
                        options={"capture": capture or {"policy": POLICY}})
        try:
            engine = HFEngine.from_builtin(model, arm=arm)
            armed = _generate(engine, calls)
            reuse = engine.prefix_reuse
        finally:
            disarm()
        disarmed = _generate(HFEngine.from_builtin(model, arm=ArmConfig(enabled=False)), calls)
        summary = json.loads((out / "capture-summary-rank0.json").read_text())
        config = json.loads((engine.model_dir / "config.json").read_text())
        _RUNS[key] = CaptureRun(model, out, armed, disarmed, summary, config, reuse)
    return _RUNS[key]


def workload_lines(run: CaptureRun) -> dict[str, list[WorkloadLine]]:
    """Workload lines by definition name."""
    dataset = Dataset(run.dataset)
    return {name: dataset.workloads(name) for name in dataset.definitions()}


@pytest.fixture(scope="session")
def hf_capture_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's capture runs write (one folder per model)."""
    return tmp_path_factory.mktemp("hf-capture")
