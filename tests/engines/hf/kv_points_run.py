"""A child of ``test_hf_tap_points.py``: the built-in engine's default tap run twice, the
checkpoints deferred (Triton's interpreter on the CPU, ``TRITON_INTERPRET=1``) and
gathered (``defer=False``), with ``max_rows`` given; prints, as one JSON line, both runs'
step records and, per step of the deferred run, the checkpoint names hashed in place and
those of them read as cache columns where they lie (no gathered copy), and its quick
steps."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.tap.record.deferred import DeferredHashes

DEFERRED: list[list[str]] = []
COLUMNS: list[list[str]] = []
QUICK: list[int] = []
_hashes = DeferredHashes.hashes


def noting_hashes(self: DeferredHashes, index: torch.Tensor) -> torch.Tensor:
    DEFERRED.append(list(self.names))
    COLUMNS.append([self.names[slot] for slot in self.pieces])
    return _hashes(self, index)


DeferredHashes.hashes = noting_hashes  # type: ignore[method-assign]


def run(out: Path, defer: bool, max_rows: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": {"defer": defer, "max_rows": max_rows},
                                "step": {"record": False}})
    torch.set_num_threads(1)
    try:
        engine = HFEngine.from_builtin("llama", dtype=torch.float32, prefix_cache_size=0,
                                       arm=config)
        reqs = [Request(request_id=f"r{i}", prompt=p, max_new_tokens=6)
                for i, p in enumerate(["the cat sat", "on a mat", "the cat sat"])]
        tokens = [c.output_ids for c in engine.generate(reqs)]
        QUICK.append(engine.arming.context.notes["tap"].quick_count)  # type: ignore[union-attr]
    finally:
        disarm()
        close_all()
    lines = (out / "tap-rank0.jsonl").read_text().splitlines()[1:]
    return tokens, [json.loads(line) for line in lines]


def main() -> None:
    root, max_rows = Path(tempfile.mkdtemp()), int(sys.argv[1])
    tokens_off, off = run(root / "off", False, max_rows)
    DEFERRED.clear()
    COLUMNS.clear()
    tokens_on, on = run(root / "on", True, max_rows)
    print(json.dumps({"tokens_equal": tokens_on == tokens_off, "gathered": off,
                      "deferred": on, "hashed_in_place": DEFERRED, "cache_columns": COLUMNS,
                      "quick": QUICK[-1]}))


if __name__ == "__main__":
    main()
