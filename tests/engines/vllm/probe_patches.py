"""Test-only guard patches, named in the arming config and imported inside vLLM workers
(the tests put this folder on the workers' PYTHONPATH).

- ``watch_rmsnorm``: counts RMSNorm kernel calls per published step and outside any step,
  and writes one line per real step to ``<out_dir>/probe-rank<r>.jsonl``.
- ``mark_worker``: writes ``<out_dir>/guard-mark-<pid>.json`` (rank, world size).
- ``break_step_reading``: makes enginetap's own reading of vLLM's step raise (fault
  injection through the patching layer: the step context must disarm, vLLM go on).
"""

from __future__ import annotations

import json
import os

from enginetap.config import arming
from enginetap.core.context import Step, current_step, subscribe
from enginetap.core.patching import Patch, PatchSet
from enginetap.core.ranks import rank_path, rank_world

RMSNORM = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"
READ_STEP = "enginetap.engines.vllm.runner:read_step"


class _Counter:
    def __init__(self) -> None:
        self.in_step = 0
        self.outside = 0
        self.row_mismatches = 0

    def wrapper(self, wrapped, instance, args, kwargs):
        step = current_step()
        if step is None:
            self.outside += 1
        else:
            self.in_step += 1
            self.row_mismatches += args[0].shape[0] != len(step.rows)
        return wrapped(*args, **kwargs)

    def on_end(self, step: Step) -> None:
        path = rank_path(arming().out_dir / "probe.jsonl", step.rank)
        with path.open("a") as f:
            f.write(json.dumps({"step": step.step, "calls": self.in_step,
                                "outside_so_far": self.outside,
                                "row_mismatches": self.row_mismatches}) + "\n")
        self.in_step = self.row_mismatches = 0


def watch_rmsnorm() -> PatchSet:
    counter = _Counter()
    subscribe(on_end=counter.on_end)
    return PatchSet("probe", [Patch(RMSNORM, counter.wrapper)]).install()


def mark_worker() -> None:
    rank, world = rank_world()
    out = arming().out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / f"guard-mark-{os.getpid()}.json").write_text(json.dumps({"rank": rank,
                                                                    "world": world}))



def _without_runner(wrapped, instance, args, kwargs):
    # The patching layer contains a wrapper's own errors but not the wrapped function's:
    # handing read_step no runner makes enginetap's reader itself fail.
    return wrapped(None, *args[1:], **kwargs)


def break_step_reading() -> PatchSet:
    return PatchSet("fault", [Patch(READ_STEP, _without_runner)]).install()
