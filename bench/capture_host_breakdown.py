"""Where a selected decode step's host time goes, part by part (a diagnostic beside
``bench_capture.py``, whose model, requests and arming it reuses).

    python bench/capture_host_breakdown.py --device cuda --width 4096 --layers 8 --batch 32
    python bench/capture_host_breakdown.py --device cpu --width 256 --context 128

Wraps timers around the capture runtime's steps (binding the call, preparing it, adapting
and copying out, handing over) and the built-in engine's decode-adapter helpers (live
columns, page tables, paged gathers), the module scope's wrappers and the garbage
collector, then runs the variants given (``disarmed``, ``held``: the writer thread starts
only after the run, ``thread``, ``process``; ``threadsN`` sets torch's intra-op threads
for the variants after it) round by round. Prints, per variant and intra-op thread
count, the median per decode step of each part in milliseconds (counts as they are) from
every round but the first (a warm-up). Parts are inclusive: ``capture`` holds the
engine's own call (``engine``) and every part below it; ``scope`` is the module scope's
wrappers' own time (the modules' excluded).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_capture as bc  # noqa: E402

from enginetap.capture.writers import copy as capture_copy  # noqa: E402
from enginetap.capture import calls, runtime, writers  # noqa: E402
from enginetap.core import scope  # noqa: E402
from enginetap.engines.hf.probes import attention  # noqa: E402

SPENT: defaultdict[str, float] = defaultdict(float)
"""Seconds (or counts, for ``n_*``) of the current decode step, by part."""

PARTS = ["step", "cpu", "capture", "engine", "bind", "prepare", "finish", "live", "paged",
         "gather", "copies", "facts", "submit", "on_begin", "on_end", "scope", "gc",
         "n_capture", "n_scope", "n_gc"]


def _timed(function: Callable[..., Any], part: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[part] += time.perf_counter() - start
    return timed


def _time(owner: Any, name: str, part: str) -> None:
    setattr(owner, name, _timed(getattr(owner, name), part))


def install_timers() -> None:
    """Timers around the parts (before any engine is armed: the runtime subscribes and
    installs bound methods and wrapper functions when it arms)."""
    _time(attention._Live, "__init__", "live")
    _time(attention._Paged, "__init__", "paged")
    _time(attention, "gather_pages", "gather")
    of_groups = capture_copy.HostCopies.of_groups.__func__
    capture_copy.HostCopies.of_groups = classmethod(_timed(of_groups, "copies"))
    _time(calls, "bind_arguments", "bind")
    _time(calls, "receipt_facts", "facts")
    _time(writers.CaptureWriter, "submit", "submit")
    for name in ("_prepare", "_finish"):
        _time(calls.ProbeCalls, name, name.lstrip("_"))
    for name in ("_on_begin", "_on_end"):
        _time(runtime.CaptureRuntime, name, name.lstrip("_"))
    capture = calls.ProbeCalls._capture

    def timed_capture(self: Any, *args: Any) -> Any:
        start = time.perf_counter()
        before = {p: SPENT[p] for p in ("bind", "prepare", "finish")}
        try:
            return capture(self, *args)
        finally:
            whole = time.perf_counter() - start
            SPENT["capture"] += whole
            SPENT["engine"] += whole - sum(SPENT[p] - before[p] for p in before)
            SPENT["n_capture"] += 1

    calls.ProbeCalls._capture = timed_capture  # type: ignore[method-assign]
    enter = scope._enter_module

    def timed_enter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        inner = [0.0]

        def timed_wrapped(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return wrapped(*a, **k)
            finally:
                inner[0] = time.perf_counter() - start

        start = time.perf_counter()
        try:
            return enter(timed_wrapped, instance, args, kwargs)
        finally:  # the wrapper's own time, not the module's
            SPENT["scope"] += time.perf_counter() - start - inner[0]
            SPENT["n_scope"] += 1

    scope._enter_module = timed_enter
    began: list[float] = []

    def collector(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            SPENT["gc"] += time.perf_counter() - began.pop()
            SPENT["n_gc"] += 1

    gc.callbacks.append(collector)


def run(engine: Any, requests: list, device: str) -> list[dict[str, float]]:
    """One generation; per decode step, the parts' time."""
    steps: list[dict[str, float]] = []
    marks: dict[int, tuple[float, float]] = {}

    def begin(step: Any) -> None:
        if step.mode == "decode":
            SPENT.clear()
            marks[step.step] = (time.perf_counter(), time.thread_time())

    def end(step: Any) -> None:
        if step.step in marks:
            if device == "cuda":
                torch.cuda.synchronize()
            start, cpu = marks.pop(step.step)
            steps.append({**SPENT, "step": time.perf_counter() - start,
                          "cpu": time.thread_time() - cpu})

    bc.subscribe(on_begin=begin, on_end=end)
    bc._CTX.on_begin.insert(0, bc._CTX.on_begin.pop())  # first to begin, last to end
    try:
        engine.generate(requests)
    finally:
        bc.unsubscribe(begin)
        bc.unsubscribe(end)
    return steps[1:]  # the first decode step warms caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--variants", default="disarmed,held,thread,process",
                        help="comma-separated: disarmed, held, thread, process, threadsN")
    args = parser.parse_args()
    args.model = ""
    if not args.width:
        parser.error("--width is required (a Llama-style random-weight model of that width)")
    bc.BUDGET["bytes"] = int(args.budget_gb * (1 << 30))
    bc._hold_writer_until_close()
    install_timers()
    model, what = bc._model(args)
    requests = bc._requests(args, model.config.vocab_size)
    print(f"{what}; batch {args.batch}, context {args.context}, {args.new_tokens} new tokens; "
          f"device {args.device}; every decode call selected", flush=True)
    found: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        threads = torch.get_num_threads()
        for round_ in range(args.rounds):
            torch.set_num_threads(threads)  # each round starts where the first did
            for variant in args.variants.split(","):
                if variant.startswith("threads"):
                    torch.set_num_threads(int(variant.removeprefix("threads")))
                    continue
                out = Path(tmp) / f"{variant}-{round_}"
                config = None if variant == "disarmed" else bc._config(
                    out, bc.EVERY_DECODE, **({"writer": "process"} if variant == "process"
                                             else {}))
                bc.HOLD["writer"] = variant == "held"
                engine = bc.HFEngine.from_loaded(model, arm=config)
                try:
                    steps = run(engine, requests, args.device)
                finally:
                    bc.disarm()
                    shutil.rmtree(out, ignore_errors=True)
                if round_ == 0 and args.rounds > 1:
                    continue  # warm-up
                label = f"{variant}@{torch.get_num_threads()}"
                for step in steps:
                    for part, value in step.items():
                        found.setdefault(label, {}).setdefault(part, []).append(value)
    for label, parts in found.items():
        shown = [f"{p}={statistics.median(parts[p]) * (1 if p.startswith('n_') else 1e3):.2f}"
                 for p in PARTS if p in parts]
        print(f"{label:>12}: " + "  ".join(shown))


if __name__ == "__main__":
    main()
