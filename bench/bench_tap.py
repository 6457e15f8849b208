"""Step-time cost of the tap: disarmed vs tap armed vs the seed-002 approach, one process.

    PYTHONPATH=src python bench/bench_tap.py [--model builtin:llama] [--batch 8]
    PYTHONPATH=src python bench/bench_tap.py --device cuda --hidden 5120 --layers 48 \
        --batch 64 --context 512        # random weights of real width, built on device

A decode loop over a transformers model publishes one step per forward (as the built-in
engine does). Variants, interleaved round by round so that machine noise hits all alike:

- ``disarmed``: nothing installed;
- ``tap``: the tap capability, fingerprints only (no continuity or sampler points), so it
  records exactly the checkpoints the seed approach records; on a GPU its checkpoints are
  deferred (hashed in place at step end, one kernel);
- ``tap-at-call``: ``tap`` with every checkpoint examined at its call (the recorder's
  quick steps off: ``tap`` lists a settled step's checkpoints and examines them in one
  loop at the device wait);
- ``tap-inline``: ``tap`` with its records written at step end, after the transfer (by
  default a GPU run writes a step's record during the next step, once its forward is
  queued: the loop announces the device wait as the built-in engine does);
- ``tap-gather``: the same with ``defer=False`` (one gather launch per checkpoint);
- ``tap+points``: the tap as armed by default (KV/state continuity and sampler too);
- ``tap-layers``: ``tap`` with ``depth="layers"`` (decoder layers' input and output only:
  fewer checkpoints than the seed approach records, so it is not in the seed/tap ratio);
- ``seed-002``: per checkpoint copy the tapped rows, weighted int64 row sums, keep the
  result; at step end stack and one transfer (the approach of seed 002, written here).

Prints per variant the median decode-step time, its ratio to disarmed, the overhead, the
seed/tap overhead ratio, checkpoints per step and bytes hashed per step.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from enginetap.core.context import (Step, StepRows, device_wait, publish, subscribe,
                                    unsubscribe)
from enginetap.core.jsonl import close_all
from enginetap.core.patching import PatchSet
from enginetap.core.scope import sublayer_targets
from enginetap.engines.hf.targets import SUBLAYERS
from enginetap.tap.record.fingerprint import word_weights


def build(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = getattr(torch, args.dtype)
    if args.hidden:
        heads = max(1, args.hidden // 128)  # head dim 128; small widths for host diagnostics
        config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 27 // 10,
                             num_hidden_layers=args.layers, num_attention_heads=heads,
                             num_key_value_heads=min(8, heads), vocab_size=32000,
                             max_position_embeddings=4096)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    from enginetap.models import build_model

    path = build_model(args.model.partition(":")[2])
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()


class Loop:
    """Prefill once, then decode steps published like the built-in engine's."""

    def __init__(self, model: Any, batch: int, context: int, device: str,
                 static_len: int = 0) -> None:
        self.model, self.batch, self.device = model, batch, device
        vocab = model.config.vocab_size
        ids = torch.randint(3, vocab, (batch, context), device=device)
        extra: dict[str, Any] = {}
        if static_len:  # a preallocated cache: no per-step growth, no allocator stalls
            from transformers import StaticCache

            extra = {"past_key_values": StaticCache(config=model.config,
                                                    max_cache_len=static_len),
                     "cache_position": torch.arange(context, device=device)}
        self.static = bool(static_len)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
        self.cache, self.length, self.step = out.past_key_values, context, 0
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self) -> float:
        b = self.batch
        rows = StepRows([f"q{i}" for i in range(b)], [self.length] * b, [0] * b, list(range(b)),
                        [self.length] * b, kv_slots=list(range(b)), token_index=list(range(b)))
        step = Step("bench", self.step, "decode", rows, padded_tokens=b)
        sync()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] \
            if torch.cuda.is_available() else []
        mallocs, collected = device_mallocs(), GC_TIME[0]
        cpu = time.thread_time()
        start = CLOCK()
        if events:
            events[0].record()
        with torch.inference_mode(), publish(step):
            where = {"cache_position": torch.tensor([self.length], device=self.device)} \
                if self.static else {}
            out = self.model(input_ids=self.next, past_key_values=self.cache, use_cache=True,
                             position_ids=torch.full((b, 1), self.length, device=self.device),
                             logits_to_keep=1, **where)
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)
            step.sampled = {f"q{i}": 0 for i in range(b)}
            self.launched = CLOCK() - start  # host done launching the forward
            self.launched_cpu = time.thread_time() - cpu
            if torch.cuda.is_available():  # as the built-in engine announces it
                device_wait()
            if events:
                events[1].record()
        if events:
            events[2].record()
        sync()
        self.gc, self.mallocs = GC_TIME[0] - collected, device_mallocs() - mallocs
        if events:  # device time of the forward, and of what the step's end added after it
            self.device_times = (events[0].elapsed_time(events[1]) / 1e3,
                                 events[1].elapsed_time(events[2]) / 1e3)
        self.length, self.step = self.length + 1, self.step + 1
        return CLOCK() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_mallocs() -> int:
    """cudaMalloc calls of the caching allocator so far (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


GC_TIME = [0.0]
"""Seconds spent in Python's garbage collector so far (all generations)."""


def _gc_clock(phase: str, info: dict[str, Any], started: list[float] = [0.0]) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        GC_TIME[0] += time.perf_counter() - started[0]


gc.callbacks.append(_gc_clock)


class SeedStyle:
    """The seed-002 approach on the same checkpoints: per checkpoint, copy the rows, int64
    weighted row sums, keep; at step end stack and one transfer."""

    def __init__(self, model: Any, rows: int) -> None:
        self.rows, self.hashes, self.index = rows, [], None
        self.patches = PatchSet("bench-seed")
        for target in sublayer_targets(model, SUBLAYERS):
            self.patches.add(target, self.wrap)
        self.checkpoints = 0

    def begin(self, step: Step) -> None:
        self.hashes = []
        self.padded = step.padded_tokens or len(step.rows)
        self.index = torch.tensor(step.rows.token_index[-self.rows:], device=DEVICE)

    def end(self, step: Step) -> None:
        if self.hashes:
            torch.stack(self.hashes).cpu()
        self.checkpoints = len(self.hashes)

    def hash(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() % self.padded:
            return
        rows = t.reshape(self.padded, -1).index_select(0, self.index).contiguous()
        words = rows.view(torch.int32) if rows.shape[1] * rows.element_size() % 4 == 0 \
            else rows.view(torch.uint8)
        weights = word_weights(words.shape[1], words.device) if words.shape[1] not in WEIGHTS \
            else WEIGHTS[words.shape[1]]
        WEIGHTS[words.shape[1]] = weights
        self.hashes.append((words.to(torch.int64) * weights).sum(dim=1))

    def wrap(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.index is None:
            return wrapped(*args, **kwargs)
        if type(instance).__name__.endswith("DecoderLayer"):
            self.hash(args[0] if args else kwargs.get("hidden_states"))
        out = wrapped(*args, **kwargs)
        for t in (out if isinstance(out, tuple) else (out,)):
            self.hash(t)
        return out

    def install(self) -> None:
        self.patches.install()
        subscribe(on_begin=self.begin, on_end=self.end)

    def uninstall(self) -> None:
        unsubscribe(self.begin)
        unsubscribe(self.end)
        self.patches.uninstall()
        self.index = None


WEIGHTS: dict[int, torch.Tensor] = {}
DEVICE = "cpu"
CLOCK = time.perf_counter
"""Wall time on a GPU; on a CPU the thread's own CPU time (one intra-op thread), which
other processes on a shared machine do not inflate."""


class TapVariant:
    def __init__(self, model: Any, out: Path, options: dict[str, Any]) -> None:
        self.model, self.out, self.options, self.arming = model, out, options, None

    inline = False
    """Write records in the engine thread at step end instead of the sink's thread."""
    quick = True
    """The recorder's quick steps (off: every checkpoint examined at its call)."""

    def install(self) -> None:
        from enginetap.capabilities import arm
        from enginetap.config import ArmConfig
        from enginetap.engines.hf.arming import HFHooks

        config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=self.out,
                           options={"tap": self.options, "step": {"record": False}})
        self.arming = arm(config, HFHooks())
        self.arming.hooks.model_loaded(self.model)
        if self.inline:
            self.recorder.sink.deferred = False
        self.recorder.quick_steps = self.quick

    @property
    def recorder(self) -> Any:
        return self.arming.context.notes["tap"]

    def uninstall(self) -> None:
        self.last = (self.recorder.last_checkpoints, self.recorder.last_bytes,
                     self.recorder.last_deferred, self.recorder.last_quick)
        self.arming.uninstall()
        close_all()


class Nothing:
    def install(self) -> None: ...

    def uninstall(self) -> None: ...


def inline(variant: TapVariant) -> TapVariant:
    variant.inline = True
    return variant


def at_call(variant: TapVariant) -> TapVariant:
    variant.quick = False
    return variant


HOOK_TIME: dict[str, list[float]] = {}


def _time_methods(names: tuple[str, ...], into: dict[str, list[float]]) -> None:
    """Wrap the recorder's methods ``names``: each call's host time goes to ``into``."""
    from enginetap.tap.record import TapRecorder

    for name in names:
        original = getattr(TapRecorder, name)

        def timed(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                into.setdefault(_name, []).append(time.perf_counter() - start)

        setattr(TapRecorder, name, timed)


def time_hooks() -> None:
    """Host time of the recorder's step begin and end (both run while the device waits)."""
    _time_methods(("begin", "end"), HOOK_TIME)


CHECKPOINT_TIME: dict[str, list[float]] = {}


def time_checkpoints() -> None:
    """Host time per call of the recorder's checkpoint and of the graph-capture check it
    makes first (``allowed``)."""
    _time_methods(("take", "allowed"), CHECKPOINT_TIME)


def make_variants(model: Any, out: Path, rows: int) -> dict[str, Any]:
    return {"disarmed": Nothing(),
            "tap": TapVariant(model, out / "tap", {"max_rows": rows, "continuity": False,
                                                   "sampler": False}),
            "tap-at-call": at_call(TapVariant(model, out / "at-call",
                                              {"max_rows": rows, "continuity": False,
                                               "sampler": False})),
            "tap-inline": inline(TapVariant(model, out / "inline",
                                            {"max_rows": rows, "continuity": False,
                                             "sampler": False})),
            "tap-gather": TapVariant(model, out / "gather", {"max_rows": rows,
                                                             "continuity": False,
                                                             "sampler": False,
                                                             "defer": False}),
            "tap+points": TapVariant(model, out / "full", {"max_rows": rows}),
            "tap-layers": TapVariant(model, out / "layers", {"max_rows": rows,
                                                             "continuity": False,
                                                             "sampler": False,
                                                             "depth": "layers"}),
            "seed-002": SeedStyle(model, rows)}


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, batch and device options (shared with ``tap_host_breakdown.py``)."""
    parser.add_argument("--model", default="builtin:llama")
    parser.add_argument("--hidden", type=int, default=0, help="random Llama of this width")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")


def main() -> None:
    global DEVICE, CLOCK
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per variant per round")
    parser.add_argument("--warm", type=int, default=4,
                        help="untimed decode steps after each variant is armed (the tap's "
                        "first three verify its deferred checkpoints on a GPU, the fourth "
                        "settles them: quick steps from the fifth on)")
    parser.add_argument("--variants", default="", help="comma-separated variants to run "
                        "(default all; disarmed always runs)")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    parser.add_argument("--static", action="store_true",
                        help="a preallocated KV cache (transformers StaticCache): the dynamic "
                        "cache grows every step and its allocations stall the host at random")
    parser.add_argument("--time-hooks", action="store_true",
                        help="also print the host time of the recorder's step begin/end")
    parser.add_argument("--time-checkpoints", action="store_true",
                        help="also print the host time per call of the recorder's checkpoint "
                        "(and of its graph-capture check inside it)")
    parser.add_argument("--trace", default="", help="comma-separated variants whose device "
                        "kernels to list (torch.profiler, CUDA only)")
    parser.add_argument("--profile", default="", help="also print the host profile "
                        "(cProfile, top functions) of this variant's steps")
    args = parser.parse_args()
    if args.time_hooks:
        time_hooks()
    if args.time_checkpoints:
        time_checkpoints()
    torch.set_num_threads(args.threads)
    DEVICE = args.device
    if args.device == "cpu" and args.threads == 1:
        CLOCK = time.thread_time
    model = build(args)
    out = Path(tempfile.mkdtemp(prefix="bench-tap-"))
    variants = make_variants(model, out, args.rows)
    if args.variants:
        wanted = {"disarmed", *args.variants.split(",")}
        unknown = wanted - set(variants)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(variants)}")
        variants = {name: v for name, v in variants.items() if name in wanted}
    traced = len(list(filter(None, args.trace.split(","))))
    steps = (args.rounds * len(variants) * (args.steps + args.warm)
             + (1 + traced) * (args.steps + 3) + 1)  # + --profile and --trace steps
    loop = Loop(model, args.batch, args.context, args.device,
                args.context + steps + 8 if args.static else 0)
    times: dict[str, list[float]] = {name: [] for name in variants}
    launched: dict[str, list[float]] = {}
    host: dict[str, list[tuple[float, float, int]]] = {}
    device: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            variant.install()
            try:
                for _ in range(args.warm):  # allocations, layouts; the tap's first
                    loop.decode()               # steps also verify its deferred checkpoints
                for _ in range(args.steps):
                    times[name].append(loop.decode())
                    launched.setdefault(name, []).append(loop.launched)
                    host.setdefault(name, []).append((loop.launched_cpu, loop.gc,
                                                      loop.mallocs))
                    if hasattr(loop, "device_times"):
                        device.setdefault(name, []).append(loop.device_times)
            finally:
                variant.uninstall()
    report(args, times, variants)
    print("  host time to launch the forward (median; below the step time: the device, not "
          "the host, sets the pace): " + ", ".join(
              f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in launched.items()))
    print("  the engine thread's own CPU time while launching (median; far below the host "
          "time above: the thread waited, not worked), garbage collection per step (mean) "
          "and device allocations (total): " + ", ".join(
              f"{name} {statistics.median(c for c, _, _ in h) * 1e3:.2f} ms / "
              f"{statistics.fmean(g for _, g, _ in h) * 1e3:.2f} ms / {sum(m for *_, m in h)}"
              for name, h in host.items()))
    if device:
        print("  device time (CUDA events, medians): forward / after the forward until the "
              "step ended: " + ", ".join(
                  f"{name} {statistics.median(f for f, _ in d) * 1e3:.2f} / "
                  f"{statistics.median(t for _, t in d) * 1e3:.3f} ms"
                  for name, d in device.items()))
    for name, spent in HOOK_TIME.items():
        print(f"  recorder.{name}: median {statistics.median(spent) * 1e3:.3f} ms host time "
              f"over {len(spent)} steps (all tap variants)")
    for name, spent in CHECKPOINT_TIME.items():
        print(f"  recorder.{name}: median {statistics.median(spent) * 1e6:.2f} us, mean "
              f"{statistics.fmean(spent) * 1e6:.2f} us host time per call over {len(spent)} "
              f"calls (all tap variants)")
    if args.profile:
        profile(loop, variants[args.profile], args.steps)
    for name in filter(None, args.trace.split(",")):
        trace(loop, name, variants[name], args.steps)


def profile(loop: Loop, variant: Any, steps: int) -> None:
    """Where the host time of ``variant``'s decode steps goes (own time per function)."""
    import cProfile
    import pstats

    variant.install()
    try:
        for _ in range(3):  # past the first verifying steps
            loop.decode()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            loop.decode()
        prof.disable()
    finally:
        variant.uninstall()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats("enginetap", 15)


def trace(loop: Loop, name: str, variant: Any, steps: int) -> None:
    """The device time of ``variant``'s decode steps per kernel (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    variant.install()
    try:
        for _ in range(3):
            loop.decode()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                loop.decode()
    finally:
        variant.uninstall()
    rows = prof.key_averages()
    total = sum(r.self_device_time_total for r in rows) / steps / 1e3
    print(f"\n{name}: device time {total:.3f} ms per step (profiled), top kernels:")
    print(rows.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


def report(args: argparse.Namespace, times: dict[str, list[float]], variants: dict) -> None:
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    low = {name: min(t) * 1e3 for name, t in times.items()}
    base = median["disarmed"]
    model = f"llama hidden {args.hidden} x {args.layers}" if args.hidden else args.model
    print(f"device {args.device}, model {model}, "
          f"batch {args.batch}, context {args.context}, rows {args.rows}, "
          f"{args.rounds}x{args.steps} steps per variant, torch {torch.__version__}, "
          f"clock {CLOCK.__name__}")
    for name, ms in median.items():
        extra = ""
        if isinstance(variants[name], TapVariant):
            cps, nbytes, deferred, quick = variants[name].last
            extra = (f"  {cps} checkpoints/step ({deferred} deferred), "
                     f"{nbytes / 1e6:.2f} MB hashed/step{', quick' if quick else ''}")
        elif isinstance(variants[name], SeedStyle):
            extra = f"  {variants[name].checkpoints} checkpoints/step"
        print(f"  {name:11s} median {ms:8.3f} ms/step  x{ms / base:6.3f}  +{ms - base:7.3f} ms"
              f"  (min {low[name]:8.3f}  +{low[name] - low['disarmed']:7.3f}){extra}")
    for label, table in (("median", median), ("min", low)):
        if "seed-002" not in table:
            break
        seed = table["seed-002"] - table["disarmed"]
        for name in (n for n in ("tap", "tap-at-call", "tap-gather") if n in table):
            tap = table[name] - table["disarmed"]
            ratio = seed / tap if tap > 0 else float("inf")
            print(f"  seed-002 overhead / {name} overhead ({label}): {ratio:.2f}")


if __name__ == "__main__":
    main()
