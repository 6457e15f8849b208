"""Test helper: capture from the built-in engine in a loop until killed.

    python capture_loop.py OUT [rounds] [thread|process]

Prints "round N" after each generate call (flushed), so a test can kill it mid-run; with
the process writer it first prints "writer pid N" (the writer process's pid).
"""

import sys
from pathlib import Path

from enginetap.config import ArmConfig
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm

out = Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
writer = sys.argv[3] if len(sys.argv) > 3 else "thread"
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
    print(f"round {n}", flush=True)
disarm()
print("done", flush=True)
