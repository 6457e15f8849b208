"""Cost of capture on the built-in engine, measured side by side in one process.

    python bench/bench_capture.py [--model builtin:qwen3_next] [--device cpu]
    python bench/bench_capture.py --device cuda --width 4096 --layers 8 --batch 32

Variants, interleaved round by round so machine noise hits all alike (one model, armed
and disarmed around it):

- ``disarmed``;
- ``unselected``: capture armed, a policy that selects no step: what capture costs a step
  it does not select (the probes' and the scope's gates shut, the step listeners);
- ``unselected after prefill``: capture armed, policy ``prefill-only``: the decode steps
  measured are never selected, but the prefill's workloads are still being written beside
  them (the writer's backlog, a cost of the selected prefill);
- ``selected``: capture armed, every decode step selected, no per-variant limit (the cost
  of copying every probed call's tensors out, and of the writer keeping up).

Per variant: the median decode-step time (from step begin to step end, sampling included)
and its ratio to disarmed; for ``selected`` also the bytes copied per step and, on a GPU,
that copy's rate against the measured pinned device→host bandwidth (against the first
disarmed variant, and against both disarmed variants pooled); per variant also the engine
thread's CPU time per decode step and how long the step's end waited for the device
(near zero: the host, not the device, set the step's pace). Then the writer alone:
workloads of a given size committed per second, against a plain safetensors write.

The host work an unselected step adds is also accounted directly, since step medians
cannot resolve 1 %: capture's step listeners' time on decode steps (measured in the run,
listener by listener) and the calls through shut gates (counted with every gate open, of
the patches that stay on their class while shut, priced side by side on a small module);
the step log armed with it (``--step-log``: of captured steps only, as ``enginetap capture``
arms it, or of every step) is shown beside it.
Diagnostics: ``--trace`` (torch.profiler, host and device, of a disarmed and a selected
run), ``--held-writer`` (a selected variant whose writer starts only after the
run), ``--python-switch`` (a selected variant whose writer leaves the switch interval at
Python's 5 ms), ``--switch-variants`` (other intervals), ``--process-writer`` (a selected
variant whose writer is a child process), ``--profile`` (cProfile of a selected run),
``--only`` (fewer variants).

``--width/--layers`` build a Llama-style random-weight model of that size on the device
(nothing is downloaded); without them ``--model`` is a built-in tiny model.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from collections import Counter
from typing import Any
from pathlib import Path

import torch

from enginetap.capture.writers import copy as capture_copy
from enginetap.config import ArmConfig
from enginetap.core.context import _CTX, subscribe, unsubscribe
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm


def _model(args: argparse.Namespace):
    if args.width:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=args.width, intermediate_size=args.width * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=args.width // 128,
                             num_key_value_heads=max(1, args.width // 512), vocab_size=32000,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        with torch.device(args.device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        return model, f"llama-style random weights, hidden {args.width}, {args.layers} layers"
    from enginetap.models import build_model
    from transformers import AutoModelForCausalLM

    name = args.model.partition(":")[2] or args.model
    model = AutoModelForCausalLM.from_pretrained(build_model(name), dtype=torch.bfloat16)
    return model.to(args.device), f"built-in {name}"


def _requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    return [Request(request_id=f"b{i}", max_new_tokens=args.new_tokens,
                    prompt_ids=torch.randint(3, vocab, (args.context,), generator=gen).tolist())
            for i in range(args.batch)]


HOST: dict[str, list[float]] = {"cpu": [], "wait": [], "ahead": []}
"""Per decode step of the last :func:`_decode_steps`: the engine thread's CPU time, how
long the step's end waited for the device (near 0: the host set the pace), and (on a GPU)
1 where the device was still running the step's forward when the listeners of the step's
device wait had finished (their host work overlapped the device's), else 0."""


def _decode_steps(engine: HFEngine, requests: list[Request]
                  ) -> tuple[list[float], list[int], list[list[int]]]:
    times, copied, marks = [], [], {}
    HOST["cpu"], HOST["wait"], HOST["ahead"] = [], [], []

    def begin(step) -> None:
        if step.mode == "decode":
            marks[step.step] = (time.perf_counter(), capture_copy.STATS.bytes,
                                time.thread_time())

    def end(step) -> None:
        if step.step in marks:
            synced = time.perf_counter()
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            t0, b0, c0 = marks.pop(step.step)
            times.append(now - t0)
            copied.append(capture_copy.STATS.bytes - b0)
            HOST["cpu"].append(time.thread_time() - c0)
            HOST["wait"].append(now - synced)

    def waited(step) -> None:
        # the last wait listener: is the forward queued before it still running?
        if step.step in marks:
            event = torch.cuda.Event()
            event.record()
            HOST["ahead"].append(float(not event.query()))

    subscribe(on_begin=begin, on_end=end, on_wait=waited)
    # the step's clock starts before any other listener's work and stops after it
    _CTX.on_begin.insert(0, _CTX.on_begin.pop())
    try:
        done = engine.generate(requests)
    finally:
        unsubscribe(begin)
        unsubscribe(end)
        unsubscribe(waited)
    return times, copied, [c.output_ids for c in done]


EACH: dict[str, list[float]] = {}
"""Per step listener (by name), its time on each decode step of the current run."""


def _time_listeners() -> None:
    """Time each step listener (the bench's own two included: they are the same in every
    variant) on every decode step."""
    from enginetap.core import context as step_context

    original = step_context._notify

    def notify(listeners, step) -> None:
        for listener in list(listeners):  # one at a time: each one's own time
            began = time.perf_counter()
            original([listener], step)
            if step.mode == "decode":
                name = getattr(listener, "__qualname__", repr(listener))
                EACH.setdefault(name, []).append(time.perf_counter() - began)

    step_context._notify = notify


PARTS: dict[str, dict[str, list[float]]] = {}
"""``--recorder-parts``: by variant, seconds of each part of the step recorder's line on
every decode step."""
PART_OF = {"variant": "", "inside": False}


def _time_recorder_parts() -> None:
    """Time the parts of ``StepRecorder.write`` in place (diagnostic): the step as JSON
    data, the line's encoding, taking the writers' lock, the ``write`` call, the whole."""
    import os

    from enginetap.core import jsonl
    from enginetap.core import recorder as step_recorder
    from enginetap.core.context import Step

    def note(part: str, seconds: float) -> None:
        PARTS.setdefault(PART_OF["variant"], {}).setdefault(part, []).append(seconds)

    def timed(part: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not PART_OF["inside"]:
                return function(*args, **kwargs)
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                note(part, time.perf_counter() - began)
        return call

    def whole(method: Any, label: str) -> Any:
        def call(self: Any, step: Any) -> None:
            PART_OF["inside"] = step.mode == "decode"
            began = time.perf_counter()
            try:
                method(self, step)
            finally:
                if PART_OF["inside"]:
                    note(label, time.perf_counter() - began)
                PART_OF["inside"] = False
        call.__qualname__ = method.__qualname__  # the listener table's name stays the same
        return call

    class TimedLock:
        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def __enter__(self) -> Any:
            began = time.perf_counter()
            got = self.lock.__enter__()
            if PART_OF["inside"]:
                note("lock", time.perf_counter() - began)
            return got

        def __exit__(self, *exc: Any) -> Any:
            return self.lock.__exit__(*exc)

    class TimedOs:
        write = staticmethod(timed("os.write", os.write))

        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

    recorder = step_recorder.StepRecorder
    recorder.write = whole(recorder.write, "at step end")  # type: ignore[method-assign]
    # on a GPU the line is written during the next decode step's device wait
    recorder.pump = whole(recorder.pump, "in the device wait")  # type: ignore[method-assign]
    Step.to_json = timed("step.to_json", Step.to_json)  # type: ignore[method-assign]
    jsonl.encode_line_bytes = timed("encode", jsonl.encode_line_bytes)
    jsonl._LOCK = TimedLock(jsonl._LOCK)  # type: ignore[assignment]
    jsonl.os = TimedOs()  # type: ignore[assignment]


def calls_per_step(model: Any, requests: list[Request]) -> float:
    """Wrapper calls a decode step makes with every gate open (every decode step selected)
    whose patch stays on its class while its gate is shut: the calls that, on an
    unselected step, pass a shut gate instead (a ``detach`` gate's patches on class
    methods are off their class then, and cost nothing)."""
    from enginetap.core.patching import Patch

    original = Patch._call
    counts: Counter = Counter()

    def counted(self, wrapped, instance, args, kwargs):
        counts[self] += 1
        return original(self, wrapped, instance, args, kwargs)

    per_step: list[Counter] = []

    def begin(step) -> None:
        counts.clear()

    def end(step) -> None:
        if step.mode == "decode":
            per_step.append(Counter(counts))

    Patch._call = counted  # type: ignore[method-assign]
    subscribe(on_begin=begin, on_end=end)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine = HFEngine.from_loaded(model, arm=_config(Path(tmp), EVERY_DECODE))
            try:
                engine.generate(requests[:2])
                patches = {p for step in per_step for p in step}
                for patch in patches:  # as on an unselected step
                    if patch.gate is not None:
                        patch.gate.set(False)
                stay = {p for p in patches if p.attached}
            finally:
                disarm()
    finally:
        Patch._call = original  # type: ignore[method-assign]
        unsubscribe(begin)
        unsubscribe(end)
    everything = statistics.median(sum(step.values()) for step in per_step)
    shut = statistics.median(sum(n for p, n in step.items() if p in stay) for step in per_step)
    print(f"calls through wrappers per decode step with every gate open: {everything:.0f}; "
          f"of them through patches that stay on their class while shut: {shut:.0f}")
    return shut


def gated_call_seconds(device: str) -> float:
    """What one call through a shut gate adds to a module call, measured side by side on a
    small module patched by the patching layer itself: the unselected steps' per-call
    price."""
    import sys
    import types

    from enginetap.core.patching import Gate, Patch, Target

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x

    class Gated(torch.nn.Module):
        def forward(self, x):
            return x

    module_name = "_enginetap_bench_gate"
    holder = types.ModuleType(module_name)
    holder.Gated = Gated  # type: ignore[attr-defined]
    sys.modules[module_name] = holder
    patch = Patch(Target.parse(f"{module_name}:Gated.forward"),
                  lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs),
                  Gate(is_open=False)).install()
    plain, gated, x = Plain(), Gated(), torch.zeros(1, device=device)
    best: dict[str, float] = {}
    try:
        for name, module in (("plain", plain), ("gated", gated)) * 3:
            start = time.perf_counter()
            for _ in range(20000):
                module(x)
            took = (time.perf_counter() - start) / 20000
            best[name] = min(best.get(name, took), took)
    finally:
        patch.uninstall()
        del sys.modules[module_name]
    return max(0.0, best["gated"] - best["plain"])


BUDGET = {"bytes": 1 << 30}
HOLD = {"writer": False}


def _hold_writer_until_close() -> None:
    """Diagnostic (``--held-writer``): in the variant that asks for it, the capture writer
    thread starts writing only when the run ends (the budget must hold the whole run), so
    the selected steps run without the writer's work beside them in the process."""
    from enginetap.capture.writers import ThreadWriter

    original = ThreadWriter._run

    def run(self: ThreadWriter) -> None:
        if HOLD["writer"]:
            while not self._closed:
                time.sleep(0.01)
        original(self)

    ThreadWriter._run = run  # type: ignore[method-assign]


def _config(out: Path, policy, **capture: Any) -> ArmConfig:
    return ArmConfig(enabled=True, capabilities=["capture"], out_dir=out / "run",
                     options={"capture": {"dataset": str(out / "ds"), "policy": policy,
                                          "budget_bytes": BUDGET["bytes"], **capture},
                              "step": {"record": STEP_RECORD["record"]}})


STEP_RECORD: dict[str, Any] = {"record": "selected"}
"""``options.step.record`` of the armed variants: ``enginetap capture``'s "selected" (the
step log of captured steps only), or ``--step-log all``."""


NOTHING = {"name": "bench-nothing", "prefill": False, "decode_steps": []}
EVERY_DECODE = {"name": "bench-every-decode", "prefill": False,
                "decode_steps": list(range(512)), "per_variant": 1 << 20,
                "per_definition": 1 << 20, "per_layer": True}


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model, what = _model(args)
    print(f"model: {what}; batch {args.batch}, context {args.context}, "
          f"{args.new_tokens} new tokens; device {args.device}")
    requests = _requests(args, model.config.vocab_size)
    # "disarmed again" shows the spread between two identical variants in this run
    results: dict[str, list[float]] = {"disarmed": [], "unselected": [],
                                       "unselected after prefill": [], "selected": [],
                                       "disarmed again": []}
    if args.only:
        results = {v: t for v, t in results.items()
                   if v in args.only.split(",") or v in ("disarmed", "unselected")}
    if args.held_writer:
        results["selected, writer held"] = []
    if args.python_switch:
        results["selected, 5 ms switch"] = []
    if args.process_writer:
        results["selected, process writer"] = []
    switches = {f"selected, {float(v) * 1e3:g} ms switch": float(v)
                for v in args.switch_variants.split(",") if v}
    for variant in switches:
        results[variant] = []
    copied: dict[str, list[int]] = {v: [] for v in results if v.startswith("selected")}
    each_s: dict[str, dict[str, list[float]]] = {}
    host_cpu: dict[str, list[float]] = {}
    ahead: dict[str, list[float]] = {}
    device_wait: dict[str, list[float]] = {}
    tokens: dict[str, list] = {v: [] for v in results}
    batches: dict[str, list] = {v: [] for v in results}
    with tempfile.TemporaryDirectory() as tmp:
        names = list(results)
        for round_ in range(args.rounds):
            # rotate the order each round: no variant always runs first (or after another)
            for variant in names[round_ % len(names):] + names[:round_ % len(names)]:
                policy = {"unselected": NOTHING, "unselected after prefill": "prefill-only",
                          "selected": EVERY_DECODE,
                          "selected, writer held": EVERY_DECODE,
                          "selected, 5 ms switch": EVERY_DECODE}.get(
                              variant, EVERY_DECODE if variant in switches else None)
                extra = {"switch_interval_s": 0.0} if variant == "selected, 5 ms switch" else {}
                if variant in switches:
                    extra = {"switch_interval_s": switches[variant]}
                if variant == "selected, process writer":
                    policy, extra = EVERY_DECODE, {"writer": "process"}
                HOLD["writer"] = variant == "selected, writer held"
                PART_OF["variant"] = variant
                out = Path(tmp) / f"{variant}-{round_}"
                engine = HFEngine.from_loaded(
                    model, arm=_config(out, policy, **extra) if policy else None)
                try:
                    EACH.clear()
                    misses = capture_copy.STATS.ring_misses
                    times, sizes, batch_out = _decode_steps(engine, requests)
                    misses = capture_copy.STATS.ring_misses - misses
                    host_cpu.setdefault(variant, []).extend(HOST["cpu"][1:])
                    device_wait.setdefault(variant, []).extend(HOST["wait"][1:])
                    ahead.setdefault(variant, []).extend(HOST["ahead"][1:])
                    for name, spent in EACH.items():
                        each_s.setdefault(variant, {}).setdefault(name, []).extend(spent[1:])
                    done = [c.output_ids for c in engine.generate(requests[:1])]
                finally:
                    disarm()
                    # a selected run writes gigabytes: keep the disk from filling up
                    shutil.rmtree(out, ignore_errors=True)
                tokens[variant].append(done)
                batches[variant].append(batch_out)
                reference = batches["disarmed"][0]
                differ = [i for i, (a, b) in enumerate(zip(reference, batch_out)) if a != b]
                print(f"  round {round_} {variant:>14}: batch tokens "
                      f"{hashlib.sha256(repr(batch_out).encode()).hexdigest()[:10]}, "
                      f"{len(differ)}/{len(batch_out)} requests differ from the first disarmed "
                      f"run" + (f" (first at output position "
                                f"{min(_first_diff(reference[i], batch_out[i]) for i in differ)})"
                                if differ else "")
                      + (f"; {misses} workloads copied outside the pinned ring (no room)" if misses
                         else ""), flush=True)
                results[variant] += times[1:]  # the first decode step warms caches
                if variant in copied:
                    copied[variant] += sizes[1:]
    base = statistics.median(results["disarmed"])
    # both disarmed variants' steps pooled: a base less at the mercy of one variant's luck
    pooled = statistics.median(results["disarmed"] + results.get("disarmed again", []))
    table = {v: {"median_ms": statistics.median(t) * 1e3,
                 "ratio": statistics.median(t) / base} for v, t in results.items()}
    table["disarmed"]["pooled_ms"] = pooled * 1e3
    for variant, sizes in copied.items():
        if sizes:
            size, step = statistics.median(sizes), statistics.median(results[variant])
            table[variant]["bytes_per_step"] = size
            for key, disarmed in (("copy_gb_per_s", base), ("pooled_copy_gb_per_s", pooled)):
                table[variant][key] = size / max(step - disarmed, 1e-9) / 1e9
    for variant, spent in host_cpu.items():
        table[variant]["engine_cpu_ms"] = statistics.median(spent) * 1e3
        table[variant]["device_wait_ms"] = statistics.median(device_wait[variant]) * 1e3
    for variant, flags in ahead.items():
        if flags:
            table[variant]["hidden_waits"] = (sum(flags), len(flags))
    if any(ahead.values()):
        print("device still running the decode step's forward after its device-wait "
              "listeners (their host work hidden): " + "; ".join(
                  f"{variant} {sum(flags):.0f}/{len(flags)} steps"
                  for variant, flags in ahead.items() if flags))
    for variant, by_name in each_s.items():
        table[variant]["each_us"] = {name: statistics.median(spent) * 1e6
                                     for name, spent in by_name.items()}
    for variant in ("disarmed", "unselected"):
        print(f"step listeners on {variant} decode steps (median each): " + ", ".join(
            f"{name} {statistics.median(spent) * 1e6:.1f} us"
            for name, spent in each_s.get(variant, {}).items()))
    PART_OF["variant"] = ""  # the runs below are not variants of the table
    table["unselected"]["gated_calls"] = calls_per_step(model, requests)
    table["unselected"]["gated_call_us"] = gated_call_seconds(args.device) * 1e6
    first = tokens["disarmed"][0]
    first_batch = batches["disarmed"][0]
    for variant, runs in tokens.items():
        table[variant]["runs_with_first_disarmed_tokens"] = sum(r == first for r in runs)
        table[variant]["runs"] = len(runs)
        table[variant]["batch_runs_equal"] = sum(b == first_batch for b in batches[variant])
        for run in runs:
            if run != first:
                explain_flip(model, requests[0], first[0], run[0])
    return table


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def explain_flip(model: Any, request: Request, expected: list[int], got: list[int]) -> None:
    """Where a greedy continuation left the first disarmed run's, and by what logit margin
    the disarmed model's own choice won there (teacher-forced, one forward)."""
    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
              min(len(expected), len(got)))
    ids = torch.tensor([list(request.prompt_ids) + expected[:at]], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    print(f"  token flip at output position {at}: expected {expected[at:at + 1]}, got "
          f"{got[at:at + 1]}; teacher-forced logits: top1 {top.values[0]:.6f} "
          f"(id {int(top.indices[0])}), top2 {top.values[1]:.6f} (id {int(top.indices[1])}), "
          f"gap {float(top.values[0] - top.values[1]):.6f}; logit of the id taken "
          f"{float(logits[got[at]]) if at < len(got) else float('nan'):.6f}")


def profile_selected(args: argparse.Namespace) -> None:
    """Where the host time of a run with every decode step selected goes."""
    import cProfile
    import pstats

    model, _ = _model(args)
    requests = _requests(args, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        engine = HFEngine.from_loaded(model, arm=_config(Path(tmp), EVERY_DECODE))
        prof = cProfile.Profile()
        try:
            prof.enable()
            _decode_steps(engine, requests)
            prof.disable()
        finally:
            disarm()
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


def trace_selected(args: argparse.Namespace) -> None:
    """Host and device time of a run with every decode step selected (torch.profiler):
    whether the selected step waits for the host or for the device, and on what."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    model, _ = _model(args)
    requests = _requests(args, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        for variant, policy in (("disarmed", None), ("selected", EVERY_DECODE)):
            engine = HFEngine.from_loaded(model, arm=_config(Path(tmp) / variant, policy)
                                          if policy else None)
            try:
                _decode_steps(engine, requests)  # warm: the ring is pinned, caches built
                with torch_profile(activities=[ProfilerActivity.CPU,
                                               ProfilerActivity.CUDA]) as prof:
                    times, _, _ = _decode_steps(engine, requests)
            finally:
                disarm()
            rows = prof.key_averages()
            steps = len(times)
            device = sum(r.self_device_time_total for r in rows) / steps / 1e3
            print(f"\n{variant}: {steps} decode steps, wall {statistics.median(times) * 1e3:.2f} "
                  f"ms (median, profiled), device busy {device:.2f} ms per step")
            print(rows.table(sort_by="self_cuda_time_total", row_limit=10,
                             max_name_column_width=50))
            print(rows.table(sort_by="self_cpu_time_total", row_limit=15,
                             max_name_column_width=50))


def pinned_d2h_gb_per_s(device: str) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 10 * src.numel() / (time.perf_counter() - start) / 1e9


def writer_throughput(workloads: int, rows: int, width: int) -> tuple[float, float]:
    """Workloads/s through the capture writer vs plain safetensors files, same bytes."""
    from safetensors.torch import save_file

    from enginetap.capture.writers.copy import HostCopies
    from enginetap.capture.writers import Item, ThreadWriter
    from enginetap.dataset import Dataset
    from enginetap.dataset.schema import Receipt
    from enginetap.definitions import get_template

    definition = get_template("rmsnorm").instantiate(hidden_size=width)
    x = torch.randn(rows, width).to(torch.bfloat16)
    w = torch.ones(width, dtype=torch.bfloat16)
    receipt = Receipt(source="bench", created_at="2026-01-01T00:00:00+00:00")
    with tempfile.TemporaryDirectory() as tmp:
        writer = ThreadWriter(Dataset(Path(tmp) / "ds", create=True), budget_bytes=1 << 30)
        start = time.perf_counter()
        for _ in range(workloads):
            writer.submit(Item(definition, HostCopies.of({"hidden_states": x, "weight": w,
                                                          "eps": 1e-6}),
                               HostCopies.of({"output": x}), lambda: receipt))
        writer.close()
        ours = workloads / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(workloads):
            save_file({"hidden_states": x.clone(), "weight": w.clone(), "output": x.clone()},
                      str(Path(tmp) / f"plain{i}.safetensors"))
        plain = workloads / (time.perf_counter() - start)
    return ours, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen3_next")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--writer-workloads", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--budget-gb", type=float, default=1.0,
                        help="capture's host byte budget: when the writer (disk) falls behind "
                             "by more, selected steps wait for it")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms (warn-only: the ops without one "
                             "are named) and cuBLAS's fixed workspace, so that run-to-run "
                             "differences of the engine itself are ruled out")
    parser.add_argument("--profile", action="store_true",
                        help="also print the host profile (cProfile, own time per function) "
                             "of one run with every decode step selected")
    parser.add_argument("--trace", action="store_true",
                        help="only profile (torch.profiler, host and device) one disarmed run "
                             "and one with every decode step selected")
    parser.add_argument("--only", default="",
                        help="comma-separated variants to run besides disarmed and unselected "
                             "(e.g. 'disarmed again'); default: all")
    parser.add_argument("--step-log", choices=["selected", "all"], default="selected",
                        help="the armed variants' step log: of the captured steps only, as "
                             "`enginetap capture` arms it (default), or of every step")
    parser.add_argument("--held-writer", action="store_true",
                        help="diagnostic: add a variant 'selected, writer held' whose writer "
                             "thread writes only after the run (what the writer's concurrent "
                             "work costs the engine)")
    parser.add_argument("--python-switch", action="store_true",
                        help="diagnostic: add a variant 'selected, 5 ms switch' whose writer "
                             "leaves the interpreter's switch interval at Python's 5 ms "
                             "(options.capture.switch_interval_s = 0)")
    parser.add_argument("--process-writer", action="store_true",
                        help="add a variant 'selected, process writer': the dataset work in "
                             "a child process that maps a shared ring (options.capture.writer "
                             "= process)")
    parser.add_argument("--recorder-parts", action="store_true",
                        help="diagnostic: time the parts of the core step recorder's line "
                             "(JSON data, encoding, lock, write) on every armed decode step")
    parser.add_argument("--switch-variants", default="",
                        help="diagnostic: comma-separated switch intervals in seconds (e.g. "
                             "0.0001,0.002), each a 'selected' variant whose writer lowers the "
                             "interpreter's switch interval to it while it has work")
    args = parser.parse_args()
    if args.held_writer:
        _hold_writer_until_close()
    if args.trace:
        BUDGET["bytes"] = int(args.budget_gb * (1 << 30))
        trace_selected(args)
        return
    if args.deterministic:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    BUDGET["bytes"] = int(args.budget_gb * (1 << 30))
    if args.threads:
        torch.set_num_threads(args.threads)
    STEP_RECORD["record"] = True if args.step_log == "all" else "selected"
    _time_listeners()
    if args.recorder_parts:
        _time_recorder_parts()
    table = measure(args)
    for variant, row in table.items():
        print(f"{variant:>14}: decode step {row['median_ms']:.3f} ms  ratio {row['ratio']:.3f}"
              f"  tokens = first disarmed run's: {row['runs_with_first_disarmed_tokens']}/"
              f"{row['runs']} (batch: {row['batch_runs_equal']}/{row['runs']})"
              + (f"  copied {row['bytes_per_step'] / 1e6:.2f} MB/step "
                 f"({row['copy_gb_per_s']:.2f} GB/s of added step time)"
                 if "bytes_per_step" in row else ""))
    print("engine thread per decode step (medians): " + "; ".join(
        f"{v} {row['engine_cpu_ms']:.2f} ms CPU, {row['device_wait_ms']:.2f} ms waiting for "
        f"the device at step end" for v, row in table.items() if "engine_cpu_ms" in row))
    bandwidth = pinned_d2h_gb_per_s(args.device)
    if bandwidth == bandwidth:
        print(f"pinned device->host bandwidth: {bandwidth:.1f} GB/s; selected-step copy rate "
              + "; ".join(f"{table[v]['copy_gb_per_s'] / bandwidth:.1%} of it ({v})"
                          for v in table if "copy_gb_per_s" in table[v]))
        print(f"  the same against both disarmed variants pooled "
              f"({table['disarmed']['pooled_ms']:.2f} ms): " + "; ".join(
                  f"{table[v]['pooled_copy_gb_per_s'] / bandwidth:.1%} ({v})"
                  for v in table if "pooled_copy_gb_per_s" in table[v]))
    # decode steps only (a prefill's step record is far longer), listener by listener
    each = table["unselected"].get("each_us", {})
    listeners = {n: us for n, us in each.items() if n.startswith("CaptureRuntime.")}
    # at step end, and (GPU) in the next step's device wait: free only where the device
    # still runs the forward then (the host ahead), so both are counted
    recorder = sum(us for n, us in each.items() if n.startswith("StepRecorder."))
    unselected = table["unselected"]
    waiting = {n: us for n, us in each.items() if n.endswith((".pump", ".waiting"))}
    if waiting:
        hidden, steps = unselected.get("hidden_waits", (0, 0))
        print("unselected: listeners during the decode step's device wait (median): "
              + ", ".join(f"{n} {us:.1f} us" for n, us in waiting.items())
              + f"; the device still ran the forward after them in {hidden:.0f}/{steps} "
                "steps (their work hidden there, counted below anyway)")
    gated = unselected["gated_calls"] * unselected["gated_call_us"]
    capture_us = sum(listeners.values()) + gated
    log = ("its step log of captured steps only (options.step.record \"selected\", as "
           "`enginetap capture` arms it)" if args.step_log == "selected" else
           "the step log of every step (options.step.record true)")
    for label, step_ms in (("disarmed", table["disarmed"]["median_ms"]),
                           ("both disarmed variants pooled", table["disarmed"]["pooled_ms"])):
        print(f"unselected decode step, capture's host work: listeners "
              + " + ".join(f"{n} {us:.1f}" for n, us in listeners.items())
              + f" us; {unselected['gated_calls']:.0f} calls through shut gates x "
              f"{unselected['gated_call_us']:.3f} us = {gated:.1f} us; in all {capture_us:.1f}"
              f" us = {capture_us / 1e3 / step_ms:.2%} of the {label} decode step "
              f"({step_ms:.2f} ms); with {log} ({recorder:.1f} us) "
              f"{(capture_us + recorder) / 1e3 / step_ms:.2%}")
    for variant, parts in PARTS.items():
        if variant:
            print(f"step recorder on {variant} decode steps (median us): " + ", ".join(
                f"{part} {statistics.median(spent) * 1e6:.1f} (p90 "
                f"{sorted(spent)[int(len(spent) * 0.9)] * 1e6:.1f})"
                for part, spent in parts.items()))
    if args.profile:
        profile_selected(args)
    ours, plain = writer_throughput(args.writer_workloads, 64, 4096)
    print(f"writer: {ours:.0f} workloads/s (64x4096 bf16 in+out) vs plain safetensors files "
          f"{plain:.0f}/s: ratio {ours / plain:.2f}")


if __name__ == "__main__":
    main()
