"""A fixed built-in-engine tap run whose records ``test_golden.py`` pins byte for byte.

``golden_run.py MODEL OUT_DIR [DEFER_BYTES]`` (run in a child with ``TRITON_INTERPRET=1``: the deferred
path on the CPU) prints the run's digest as one JSON line; the test imports
:func:`golden_digest` for the in-process (gathered) run. A tiny random-weight model the
project builds (seed 0), float32 on the CPU, the default tap options (continuity and
sampler on), four prompts of which two are identical, six decode steps, one CPU thread."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm

PROMPTS = ["the cache holds every key", "kernels and caches", "the cache holds every key",
           "decode"]
NEW_TOKENS = 7
HEADER_FIELDS = ("kind", "format", "version", "engine", "world_size", "tp_size",
                 "kv_block_size", "models", "cache_groups", "compiled", "cuda_graphs", "eager")
"""Header fields that do not depend on the machine or the versions installed."""


def golden_digest(model: str, out: Path, **options: Any) -> dict[str, Any]:
    """Run the fixed tap run of ``model`` into ``out`` (tap ``options`` beyond the default
    ones: the machinery they change must not change the bytes); what the test pins of
    its file, and how the recorder ran its steps."""
    reqs = [Request(request_id=f"r{i}", prompt=p, max_new_tokens=NEW_TOKENS)
            for i, p in enumerate(PROMPTS)]
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": options, "step": {"record": False}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads split a batch's rows differently: other bits
    try:
        engine = HFEngine.from_builtin(model, dtype=torch.float32, prefix_cache_size=0,
                                       arm=config)
        tokens = [c.output_ids for c in engine.generate(reqs)]
        recorder = engine.arming.context.notes["tap"]
        ran = {"quick": recorder.quick_count, "planned": recorder.planned_count,
               "at_call": sorted(recorder.at_call)}
    finally:
        torch.set_num_threads(threads)
        disarm()
        close_all()
    lines = (out / "tap-rank0.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    steps = lines[1:]
    records = [json.loads(line) for line in steps]
    first = records[1]  # the first decode step
    hashes = dict(zip(first["checkpoints"], first["hashes"]))
    return {
        "tokens": tokens,
        "header": {k: header[k] for k in HEADER_FIELDS},
        "steps": [hashlib.sha256(line.encode()).hexdigest()[:16] for line in steps],
        "checkpoints": len(first["checkpoints"]),
        "L0.in": hashes["L0.in"][:16],
        "L0.out": hashes["L0.out"][-16:],
        "norm.out": hashes["norm.out"][16:32],
        "L0.attn.kv_written": hashes.get("L0.attn.kv_written", hashes.get(
            "L3.attn.kv_written"))[:16],
        "sampler": first["sampler"][0],
        "ran": ran,
    }


if __name__ == "__main__":
    extra = {"defer_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}
    print(json.dumps(golden_digest(sys.argv[1], Path(sys.argv[2]), **extra)))
