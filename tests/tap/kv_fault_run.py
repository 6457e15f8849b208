"""Run by test_kv_in_place.py in a child with TRITON_INTERPRET=1 (Triton's interpreter runs
the deferred hash kernel on the CPU): the built-in engine's default tap, where a decode
step's KV points are its cache columns hashed in place at step end, once clean and once
with r2's newest key of layer ``LAYER`` (default 0) copied into r0's row after step ``AT``
sampled (still inside it, :func:`conftest.overwrite_between_steps`).

``kv_fault_run.py OUT_DIR AT NEW_TOKENS [LAYER]`` writes the runs to ``OUT_DIR/clean`` and
``OUT_DIR/faulted`` and prints one JSON line: each run's tokens, quick steps, the
checkpoint names demoted from the deferred path and the layers whose KV points took the
settled path (``CachePoints._kv_settled``: a step's layers after its first)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import overwrite_between_steps, requests  # noqa: E402

from enginetap.config import ArmConfig  # noqa: E402
from enginetap.core.jsonl import close_all  # noqa: E402
from enginetap.engines.hf import HFEngine  # noqa: E402
from enginetap.engines.hf.arming import disarm  # noqa: E402
from enginetap.tap.record import kernels  # noqa: E402

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]


def run(out: Path, new_tokens: int) -> dict[str, Any]:
    from enginetap.engines.hf.tap import CachePoints

    settled: list[int] = []
    original = CachePoints._kv_settled

    def counted(self: CachePoints, *args: Any) -> bool:
        took = original(self, *args)
        settled.append(int(took))
        return took

    CachePoints._kv_settled = counted  # type: ignore[method-assign]
    try:
        return _run(out, new_tokens) | {"settled": sum(settled)}
    finally:
        CachePoints._kv_settled = original  # type: ignore[method-assign]


def _run(out: Path, new_tokens: int) -> dict[str, Any]:
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"step": {"record": False}})
    try:
        engine = HFEngine.from_builtin("llama", dtype=torch.float32, prefix_cache_size=0,
                                       arm=config)
        tokens = [c.output_ids for c in engine.generate(requests(SAME, new_tokens))]
        recorder = engine.arming.context.notes["tap"]  # type: ignore[union-attr]
        (deferred,) = [d for d in recorder.checkpointer.deferred.values() if d is not None]
        return {"tokens": tokens, "quick": recorder.quick_count,
                "demoted": sorted(deferred.demoted)}
    finally:
        disarm()
        close_all()


LAYER = [0]


def write(cache: Any) -> None:
    keys = cache.layers[LAYER[0]].keys
    keys[0, :, -1].copy_(keys[2, :, -1])  # r2's newest key lands in r0's row


def main() -> None:
    out, at, new_tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    LAYER[0] = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    assert kernels.available(torch.zeros(1)), "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    found = {"clean": run(out / "clean", new_tokens)}
    with pytest.MonkeyPatch.context() as mp:
        overwrite_between_steps(mp, at, write)
        found["faulted"] = run(out / "faulted", new_tokens)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
