"""Cost of arming: pass-through wrappers on every sublayer class + a step listener.

    python bench/bench_patching.py [--model llama] [--device cpu|cuda] [--repeats 5]

Two measurements, each interleaved so machine noise hits both sides alike:

1. one wrapped call of a tiny function vs the bare function (the patching layer's own
   per-call cost);
2. the built-in engine's ``generate`` (a batch of 4 requests, 16 new tokens) disarmed, with
   a step listener that reads every row, with a pass-through wrapper on every decoder
   layer, attention, MoE, norm and MLP class (``sublayer_targets``), and with both (armed
   the way capture/tap arm it). Every variant's tokens are checked equal to disarmed.

Prints medians and the ratios to disarmed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from enginetap.core.context import subscribe, unsubscribe
from enginetap.core.patching import Patch, PatchSet
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.targets import sublayer_targets


def tiny(x: int) -> int:
    return x + 1


def _median_loop(fn: Callable[[], object], calls: int, repeats: int,
                 sync: Callable[[], None]) -> list[float]:
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def per_call(repeats: int) -> tuple[float, float]:
    bare = tiny
    module = sys.modules[__name__]
    patch = Patch(f"{__name__}:tiny", lambda w, i, a, k: w(*a, **k))
    plain, wrapped = [], []
    for _ in range(repeats):
        plain += _median_loop(lambda: bare(1), 20000, 1, lambda: None)
        with PatchSet("bench", [patch]):
            wrapped += _median_loop(lambda: module.tiny(1), 20000, 1, lambda: None)
    return statistics.median(plain), statistics.median(wrapped)


def _requests() -> list[Request]:
    prompts = ["kernels", "a prompt about batching requests and caches",
               "decode steps read the cache", "prefill"]
    return [Request(request_id=f"b{i}", prompt=p, max_new_tokens=16) for i, p in enumerate(prompts)]


def engine_run(model: str, device: str, repeats: int) -> tuple[dict[str, float], int]:
    """Median ms of generate per arming variant, interleaved; tokens checked each time."""
    engine = HFEngine.from_builtin(model, device=device, prefix_cache_size=0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    patches = PatchSet("armed", [Patch(t, lambda w, i, a, k: w(*a, **k))
                                 for t in sublayer_targets(engine.model)])
    rows: list[int] = []

    def listener(step):
        rows.append(sum(step.rows.positions))  # touch every row, as a tap would

    variants = {"disarmed": (False, False), "listener only": (True, False),
                "wrappers only": (False, True), "armed": (True, True)}
    expected = [c.output_ids for c in engine.generate(_requests())]  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (listen, wrap) in variants.items():
            if listen:
                subscribe(on_begin=listener)
            if wrap:
                patches.install()
            try:
                samples[name] += _median_loop(lambda: engine.generate(_requests()), 1, 1, sync)
                tokens = [c.output_ids for c in engine.generate(_requests())]
            finally:
                patches.uninstall()
                unsubscribe(listener)
            assert tokens == expected, f"{name}: arming changed the engine's tokens"
    return {k: statistics.median(v) for k, v in samples.items()}, len(patches.patches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 thread"
    print(f"torch {torch.__version__}, {where}, medians of {args.repeats} interleaved runs")
    plain, wrapped = per_call(args.repeats)
    print(f"per call: bare {plain * 1e9:.0f} ns, wrapped {wrapped * 1e9:.0f} ns, "
          f"overhead {(wrapped - plain) * 1e9:.0f} ns")
    times, count = engine_run(args.model, args.device, args.repeats)
    base = times["disarmed"]
    print(f"generate {args.model} (4 requests x 16 tokens; {count} sublayer classes wrapped), "
          "tokens identical in every variant:")
    for name, value in times.items():
        print(f"  {name:>14}: {value * 1e3:8.1f} ms  ratio {value / base:.3f}")


if __name__ == "__main__":
    main()
