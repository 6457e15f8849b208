"""Test helper: capture from the built-in engine in a loop until killed.

    python capture_loop.py OUT [rounds] [thread|process] [sink]

Prints "round N" after each generate call (flushed), so a test can kill it mid-run; with
the process writer it first prints "writer pid N" (the writer process's pid). With
``sink``, each round also submits a record ``{"round": N}`` to a deferred record sink
writing ``OUT/sink-rank0.jsonl`` whose fallback writer never runs: a record reaches the
file only when the sink is flushed at exit.
"""

import sys
from pathlib import Path

from enginetap.config import ArmConfig
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm

out = Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
writer = sys.argv[3] if len(sys.argv) > 3 else "thread"
records = None
if len(sys.argv) > 4 and sys.argv[4] == "sink":
    from enginetap.core import sink
    from enginetap.core.jsonl import RankJsonl

    sink.IDLE_S = 1e9
    records = sink.RecordSink(RankJsonl(out / "sink.jsonl", 0), deferred=True)
policy = {"name": "all", "decode_steps": list(range(64)), "per_variant": 10_000,
          "per_definition": 10_000, "per_layer": True}
config = ArmConfig(enabled=True, capabilities=["capture"], out_dir=out / "run",
                   options={"capture": {"dataset": str(out / "ds"), "policy": policy,
                                        "batch": 4, "budget_bytes": 4 << 20,
                                        "writer": writer}})
# a small budget bounds the writer's backlog, so the flush at SIGTERM/SIGINT stays short
# on a loaded machine (the loop captures every call of every step)
engine = HFEngine.from_builtin("llama", arm=config)
if writer == "process":
    import os

    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    print(f"writer pid {children[0]}", flush=True)
prompts = ["kernels and caches meet the scheduler", "a shorter prompt", "hi"]
for n in range(rounds):
    engine.generate([Request(request_id=f"r{n}-{i}", prompt=p, max_new_tokens=4)
                     for i, p in enumerate(prompts)])
    if records is not None:
        records.submit(lambda n=n: {"round": n}, n)
    print(f"round {n}", flush=True)
disarm()
print("done", flush=True)
