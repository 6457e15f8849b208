"""The tap's cost through the built-in engine's own generate loop (issue 29, eager goal).

    PYTHONPATH=src python bench/bench_tap_engine.py                      # CPU, tiny
    PYTHONPATH=src python bench/bench_tap_engine.py --device cuda --hidden 5120 \
        --layers 48 --batch 64 8 --context 512 --new-tokens 40 --rounds 5

``HFEngine.from_loaded`` over a random-weight Llama built on the device runs one
``generate`` per variant and round; variants are interleaved round by round (their order
rotated each round) so that machine noise hits all alike:

- ``disarmed``: the engine with nothing armed;
- ``tap``: armed with ``capabilities=["tap"]`` and the default tap options (continuity
  and sampler on);
- ``tap-fp``: fingerprints only (``continuity=False, sampler=False``): the checkpoints
  the seed approach records;
- ``tap-at-call``: the default tap with the recorder's quick steps off (every checkpoint
  examined at its call; on a GPU the quick steps list a settled step's checkpoints and
  examine them at the device wait): whether that machinery pays;
- ``tap-no-plan``: the default tap whose quick steps make no plan (each settled step's
  list examined one by one, never kept whole as the last one's plan): whether plans pay;
- ``tap-no-sampler``, ``tap-no-kv``: the default tap without the sampler's top-2, or
  without the KV points (what each costs);
- ``tap-gather``: the default tap with ``defer=False``: every checkpoint's rows gathered
  and hashed at its call (the CPU's path), nothing kept for a step-end hash in place:
  whether deferral pays;
- ``tap-kv-staged``: the default tap with the KV points always gathered into staging
  slots (as where not every token row is tapped), never kept for the step-end hash in
  place: what keeping them saves;
- ``hooks``: forward hooks on the same modules that do nothing (the per-checkpoint budget);
- ``seed-002``: the seed's approach on those checkpoints, written here: forward hooks on
  the same sublayer modules (decoder layers' inputs, every sublayer's output), per
  checkpoint the tapped rows gathered, weighted int64 row sums kept on the device; at step
  end one stack and one device-to-host copy.

A decode step is the host interval between two consecutive decode steps' begins (the first
two of each run are left out: warm-up). Per variant: the median step over its runs in each
round; printed are the median over rounds and the spread (min-max) of the per-round
medians, and of the per-round ratio to ``disarmed``. The host time of the forward's launch
(step begin to the device wait the engine announces; CPU: to step end) is printed too:
that is where per-checkpoint host work shows. The engine thread's CPU time per decode step
is printed beside it (a shared host's wall clock moves more than the work does), with
the cost per checkpoint over ``disarmed``. ``--emulate-defer`` runs the GPU's path on a
CPU (see :func:`emulate_deferral`); ``--breakdown`` times the tap's parts in one more
generate per variant; ``--profile VARIANT`` runs one more generate of that variant under
cProfile (thread CPU time) and prints where its host time went.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import io
import pstats
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from enginetap.config import ArmConfig
from enginetap.core.context import Step, subscribe, unsubscribe
from enginetap.core.jsonl import close_all
from enginetap.core.scope import sublayer_targets
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.engines.hf.targets import SUBLAYERS
from enginetap.tap.record.fingerprint import word_weights

VARIANTS = ("disarmed", "tap", "tap-kv-staged", "tap-fp", "tap-at-call", "tap-gather",
            "tap-no-sampler", "tap-no-kv", "tap-no-plan", "seed-002", "hooks")
OPTIONS: dict[str, dict[str, Any]] = {
    "tap-fp": {"continuity": False, "sampler": False}, "tap-gather": {"defer": False},
    "tap-no-sampler": {"sampler": False}, "tap-no-kv": {"continuity": False}}
"""The tap options of the variants that are not the defaults."""


def build(hidden: int, layers: int, device: str, dtype: torch.dtype, vocab: int = 32000) -> Any:
    """A random-weight Llama of width ``hidden`` (head dim 128, 8 KV heads) on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = max(1, hidden // 128)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 27 // 10,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=min(8, heads), vocab_size=vocab,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Clock:
    """Per decode step: when it began, the engine thread's CPU time at that moment (less
    the emulated table hash's, see :func:`emulate_deferral`), and how long the host took to
    launch its forward."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.cpu: list[float] = []
        self.launch: list[float] = []
        self._began = 0.0
        self._waited = False

    def begin(self, step: Step) -> None:
        self._began, self._waited = time.perf_counter(), False
        if step.mode == "decode":
            self.begins.append(self._began)
            self.cpu.append(time.thread_time() - EMULATED[0])

    def wait(self, step: Step) -> None:
        if step.mode == "decode" and not self._waited:
            self._waited = True
            self.launch.append(time.perf_counter() - self._began)

    def end(self, step: Step) -> None:
        if step.mode == "decode" and not self._waited:
            self.launch.append(time.perf_counter() - self._began)

    def steps(self, skip: int = 2) -> list[float]:
        return [b - a for a, b in zip(self.begins[skip:], self.begins[skip + 1:])]

    def cpu_steps(self, skip: int = 2) -> list[float]:
        return [b - a for a, b in zip(self.cpu[skip:], self.cpu[skip + 1:])]


EMULATED = [0.0]
"""Engine-thread CPU seconds spent in the emulated table hash (left out of the steps)."""


def emulate_deferral() -> None:
    """On the CPU, run the tap's GPU path: checkpoints kept and hashed in place at step end
    (quick steps, plans), the kernels' ``available`` answering yes for CPU tensors. The
    step-end table hash (one Triton launch on a GPU) is done here by torch over the
    table's addresses, the same function of the same bytes; its CPU time is left out of
    the step times (:data:`EMULATED`): on a GPU it is device time."""
    from enginetap.tap.record import kernels
    from enginetap.tap.record.fingerprint import hash_rows

    def table_rows(table: torch.Tensor, index: torch.Tensor, max_words: int) -> torch.Tensor:
        start = time.thread_time()
        last = int(index.max()) if index.numel() else 0
        out = torch.empty((table.shape[1], index.numel()), dtype=torch.int64)
        for c, (address, stride, width, segments, apart, second) in enumerate(
                zip(*table.tolist())):
            # each piece: rows of ``segments`` runs of ``width`` words (a KV cache column:
            # every head's key, then from ``second`` every head's value)
            pieces = []
            for base in (address, second) if second else (address,):
                span = (ctypes.c_int32 * (last * stride + (segments - 1) * apart + width)
                        ).from_address(base)
                words = torch.frombuffer(span, dtype=torch.int32)
                pieces.append(words.as_strided((last + 1, segments, width),
                                               (stride, apart, 1))[index].flatten(1))
            out[c] = hash_rows(torch.cat(pieces, 1))
        EMULATED[0] += time.thread_time() - start
        return out

    kernels.available = lambda tensor: tensor.device.type in ("cpu", "cuda")
    kernels.hash_table_rows = table_rows


class SeedStyle:
    """The seed-002 approach: forward hooks on the tap's sublayer modules; per checkpoint
    gather the tapped rows and keep their weighted int64 row sums; one D2H per step."""

    def __init__(self, model: Any, rows: int) -> None:
        wanted = {t.partition(":")[2].rpartition(".")[0] for t in sublayer_targets(model, SUBLAYERS)}
        self.modules = [m for m in model.modules() if type(m).__qualname__ in wanted]
        self.rows, self.handles, self.hashes = rows, [], []
        self.index: torch.Tensor | None = None
        self.weights: dict[int, torch.Tensor] = {}
        self.checkpoints = 0

    def install(self, listen: bool = True) -> None:
        for module in self.modules:
            if type(module).__name__.endswith("DecoderLayer"):
                self.handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post))
        if listen:
            subscribe(on_begin=self.begin, on_end=self.end)

    def uninstall(self, listen: bool = True) -> None:
        if listen:
            unsubscribe(self.begin)
            unsubscribe(self.end)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if listen:
            self.index = None

    def begin(self, step: Step) -> None:
        self.padded = step.padded_tokens or len(step.rows)
        index = step.rows.token_index or list(range(len(step.rows)))
        self.index = torch.tensor(index[-self.rows:], device=DEVICE[0])
        self.hashes = []

    def end(self, step: Step) -> None:
        if self.hashes:
            torch.stack(self.hashes).cpu()
        self.checkpoints, self.index = len(self.hashes), None

    def hash(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or self.index is None or t.numel() % self.padded:
            return
        rows = t.reshape(self.padded, -1).index_select(0, self.index)
        words = rows.view(torch.int32) if rows.shape[1] * rows.element_size() % 4 == 0 \
            else rows.view(torch.uint8)
        weights = self.weights.get(words.shape[1])
        if weights is None:
            weights = self.weights[words.shape[1]] = word_weights(words.shape[1], words.device)
        self.hashes.append((words.to(torch.int64) * weights).sum(dim=1))

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.hash(args[0] if args else kwargs.get("hidden_states"))

    def post(self, module: Any, args: tuple, out: Any) -> None:
        for t in (out if isinstance(out, tuple) else (out,)):
            self.hash(t)


class BareHooks(SeedStyle):
    """Forward hooks on the same modules that do nothing: what a hook's call costs the
    host by itself (the per-checkpoint budget the tap is held to)."""

    def begin(self, step: Step) -> None:
        self.calls = 0

    def end(self, step: Step) -> None:
        self.checkpoints = self.calls

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.calls += 1

    def post(self, module: Any, args: tuple, out: Any) -> None:
        self.calls += 1


DEVICE = ["cpu"]

NOW = [time.thread_time_ns]
"""``--breakdown``'s clock: the engine thread's CPU time on a CPU; wall time on a GPU's
host (its thread clock was found inconsistent there; the parts it times run on the engine
thread with nothing of theirs to wait for)."""
DECODE = [True]
"""Whether the step under way is a decode step (``--breakdown`` counts only those)."""


def _decode(step: Step) -> None:
    DECODE[0] = step.mode == "decode"


UNDO: list[tuple[Any, str, Any]] = []
SPENT: dict[str, int] = {}
"""``--breakdown``: engine-thread CPU nanoseconds by part of the tap (emulated hash out)."""


def _timed(owner: Any, attr: str, label: str) -> None:
    """Time ``owner.attr`` (inclusive) under ``label`` (undone by :func:`breakdown_off`)."""
    original = getattr(owner, attr)
    UNDO.append((owner, attr, owner.__dict__.get(attr)))

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not DECODE[0]:
            return original(*args, **kwargs)
        start, emulated = NOW[0](), EMULATED[0]
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] = SPENT.get(label, 0) + NOW[0]() - start - int(
                (EMULATED[0] - emulated) * 1e9)

    setattr(owner, attr, timed)


TIMER = [0]
"""Nanoseconds the wrapper timing itself adds to a call's own time (calibrated)."""


def calibrate() -> None:
    """:data:`TIMER`: the own time the timing wrapper measures around a wrapper that only
    calls what it wraps (the thread clock is a system call here, ~0.5 us a read)."""
    def bare(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return wrapped(*args, **kwargs)

    from enginetap.tap.record import arming

    TIMER[0] = 0
    factory, arming.sublayer_wrapper = arming.sublayer_wrapper, lambda *a, **k: bare
    try:
        breakdown_on()
        timed = arming.sublayer_wrapper()
    finally:
        breakdown_off()
        arming.sublayer_wrapper = factory
    samples = []
    for _ in range(5):
        SPENT.clear()
        for _ in range(2000):
            timed(int, None, (), {})
        samples.append(SPENT["wrapper own"] / SPENT["wrapper calls"])
    TIMER[0] = int(statistics.median(samples))


def breakdown_on() -> None:
    """Time the tap's parts: the recorder's step begin (rows picked), a quick step's
    settle, step end (hash, transfer, record), the KV points, the sampler, and the sublayer
    wrappers' own time per call (less the module they wrap)."""
    from enginetap.engines.hf import tap as hf_tap
    from enginetap.tap.record import arming, recorder

    parts = [(recorder.TapRecorder, "begin", "step begin"),
             (recorder.TapRecorder, "_prepare", "rows picked"),
             (recorder.TapRecorder, "settle", "settle"), (recorder.TapRecorder, "end", "step end"),
             (hf_tap.CachePoints, "after", "KV points"),
             (recorder.TapRecorder, "note_logits", "sampler")]
    for owner, attr, label in parts:
        _timed(owner, attr, label)
    factory = arming.sublayer_wrapper

    def timed_factory(*args: Any, **kwargs: Any) -> Any:
        tap = factory(*args, **kwargs)

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not DECODE[0]:
                return tap(wrapped, instance, args, kwargs)
            start, inner = NOW[0](), [0]

            def call(*a: Any, **k: Any) -> Any:
                began = NOW[0]()
                try:
                    return wrapped(*a, **k)
                finally:
                    inner[0] += NOW[0]() - began

            try:
                return tap(call, instance, args, kwargs)
            finally:
                SPENT["wrapper calls"] = SPENT.get("wrapper calls", 0) + 1
                SPENT["wrapper own"] = SPENT.get("wrapper own", 0) + (
                    NOW[0]() - start - inner[0] - TIMER[0])

        wrapper.__enginetap_contained__ = True  # type: ignore[attr-defined]
        return wrapper

    UNDO.append((arming, "sublayer_wrapper", factory))
    arming.sublayer_wrapper = timed_factory
    UNDO.append((hf_tap, "sublayer_wrapper", hf_tap.sublayer_wrapper))
    hf_tap.sublayer_wrapper = timed_factory  # the attention wrappers, KV points inside


def breakdown_off() -> None:
    while UNDO:
        owner, attr, original = UNDO.pop()
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def run_variant(name: str, model: Any, reqs: list[Request], out: Path, rows: int,
                clock: Clock, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """One generate of ``name``; the recorder's (or seed's) checkpoints per step."""
    options = {"max_rows": rows}
    options.update(OPTIONS.get(name, {}))
    arm = None
    if name.startswith("tap"):  # tap-at-call: the default options
        arm = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out / name,
                        options={"tap": options, "step": {"record": False}})
    seed = {"seed-002": SeedStyle, "hooks": BareHooks}.get(name)
    seed = None if seed is None else seed(model, rows)
    info: dict[str, Any] = {}
    try:
        engine = HFEngine.from_loaded(model, prefix_cache_size=0, arm=arm)
        if name == "tap-at-call":
            engine.arming.context.notes["tap"].quick_steps = False
        if name == "tap-kv-staged":
            from enginetap.engines.hf import tap as hf_tap

            staged = hf_tap.CachePoints._defers
            hf_tap.CachePoints._defers = lambda self, tensor: False  # type: ignore
        if seed is not None:
            seed.install()
        subscribe(on_begin=clock.begin, on_end=clock.end, on_wait=clock.wait)
        gc.collect()
        if profile is not None:
            profile.enable()
        with no_plans(name == "tap-no-plan"):
            engine.generate(reqs)
        if profile is not None:
            profile.disable()
        if engine.arming is not None:
            recorder = engine.arming.context.notes["tap"]
            info["checkpoints"] = recorder.last_checkpoints
            info["quick"] = recorder.quick_count
        elif seed is not None:
            info["checkpoints"] = seed.checkpoints
    finally:
        if name == "tap-kv-staged":
            hf_tap.CachePoints._defers = staged  # type: ignore
        unsubscribe(clock.begin)
        unsubscribe(clock.end)
        unsubscribe(clock.wait)
        if seed is not None:
            seed.uninstall()
        disarm()
        close_all()
    return info


@contextlib.contextmanager
def no_plans(active: bool) -> Iterator[None]:
    """While ``active``: the recorder's quick steps make no plan (``tap-no-plan``)."""
    from enginetap.tap.record.quick import QuickPlan

    if not active:
        yield
        return
    make = QuickPlan.__dict__["make"]
    QuickPlan.make = staticmethod(lambda *args, **kwargs: None)  # type: ignore[method-assign]
    try:
        yield
    finally:
        QuickPlan.make = make  # type: ignore[method-assign]


class Paired:
    """``--paired``: one generate per variant and round whose decode steps take turns,
    two by two in a random order, between the variant on and off, so that a step with it
    and a step without it are always neighbours (this host's speed drifts over seconds,
    up to 2x between generates; two neighbouring steps see the same host).

    Off, a step runs as a disarmed engine's does: the variant's wrappers are taken off
    their classes (the tap's patches put back as they were before arming; the seed's hooks
    removed), its step listeners are not called and the engine reads no valid lengths.
    On, a tap step's record is formatted before the step's time closes (where the engine
    is host-bound, as here, the next step's device wait that formats it in a real run
    costs the same host time; here it cannot land on a neighbour that is off). A step's
    time: from its begin to the next step's, less the switching done at that begin.
    """

    def __init__(self, engine: HFEngine, seed: SeedStyle | None, rng: random.Random) -> None:
        self.engine, self.seed, self.rng = engine, seed, rng
        self.arming = engine.arming
        self.recorder = None if self.arming is None else self.arming.context.notes["tap"]
        self.patches = [p for handle in ([] if self.arming is None else self.arming.installed)
                        for p in getattr(getattr(handle, "patches", None), "patches", ())
                        if p._state == "installed"]
        self.decode = -1
        self.state = True  # the prefill runs with the variant on
        self.begins: list[float] = []
        self.switched: list[float] = []
        self.on: list[bool] = []
        self._order: list[bool] = []
        if self.recorder is not None:
            for listener in (self.recorder.begin, self.recorder.end, self.recorder.waiting):
                unsubscribe(listener)
        if seed is not None:
            unsubscribe(seed.begin)
            unsubscribe(seed.end)
        subscribe(on_begin=self.begin, on_end=self.end, on_wait=self.waiting)

    def close(self) -> None:
        self._switch(True)
        for listener in (self.begin, self.end, self.waiting):
            unsubscribe(listener)

    def _switch(self, on: bool) -> None:
        if on == self.state:
            return
        self.state = on
        for patch in self.patches:
            owner, attr = patch._owner, patch.target.attribute
            if on:
                setattr(owner, attr, patch._installed_wrapper)
            elif patch._owned:
                setattr(owner, attr, patch._original)
            else:
                delattr(owner, attr)
        if self.seed is not None:
            if on:
                self.seed.install(listen=False)
            else:
                self.seed.uninstall(listen=False)

    def _next_on(self) -> bool:
        if not self._order:
            first = self.rng.random() < 0.5
            self._order = [first, not first]
        return self._order.pop(0)

    def begin(self, step: Step) -> None:
        started = time.perf_counter()
        if step.mode == "decode":
            self.decode += 1
            self._switch(self._next_on())
            now = time.perf_counter()
            self.begins.append(now - EMULATED[0])  # (--emulate-defer: its hash left out)
            self.switched.append(now - started)
            self.on.append(self.state)
        if self.state:
            if self.recorder is not None:
                self.recorder.begin(step)
            if self.seed is not None:
                self.seed.begin(step)

    def waiting(self, step: Step) -> None:
        if self.state and self.recorder is not None:
            self.recorder.waiting(step)

    def end(self, step: Step) -> None:
        if self.state:
            if self.recorder is not None:
                self.recorder.end(step)
                self.recorder.sink.pump()
            if self.seed is not None:
                self.seed.end(step)
        # the engine reads valid lengths before the next step's begin: armed steps only
        self.engine.arming = self.arming if self._peek() else None

    def _peek(self) -> bool:
        if not self._order:
            first = self.rng.random() < 0.5
            self._order = [first, not first]
        return self._order[0]

    def pairs(self, skip: int = 2) -> list[tuple[float, float]]:
        """(on, off) step times of each block of two decode steps past the first
        ``skip`` steps (the last step has no next begin)."""
        times = [b - a - s for a, b, s in zip(self.begins, self.begins[1:], self.switched[1:])]
        out = []
        for i in range(skip - skip % 2, len(times) - 1, 2):
            (t0, on0), (t1, _) = (times[i], self.on[i]), (times[i + 1], self.on[i + 1])
            out.append((t0, t1) if on0 else (t1, t0))
        return out


def run_paired(name: str, model: Any, reqs: list[Request], out: Path, rows: int,
               rng: random.Random) -> tuple[list[tuple[float, float]], int]:
    """One generate of ``name`` with its decode steps on and off by turns (:class:`Paired`):
    (on, off) step times per block, and the checkpoints of its last step."""
    options: dict[str, Any] = {"max_rows": rows}
    options.update(OPTIONS.get(name, {}))
    arm = None
    if name.startswith("tap"):
        arm = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out / name,
                        options={"tap": options, "step": {"record": False}})
    kind = {"seed-002": SeedStyle, "hooks": BareHooks}.get(name)
    seed = None if kind is None else kind(model, rows)
    paired = None
    try:
        engine = HFEngine.from_loaded(model, prefix_cache_size=0, arm=arm)
        if name == "tap-at-call":
            engine.arming.context.notes["tap"].quick_steps = False
        if seed is not None:
            seed.install()
        paired = Paired(engine, seed, rng)
        gc.collect()
        with no_plans(name == "tap-no-plan"):
            engine.generate(reqs)
        recorder = paired.recorder
        count = recorder.last_checkpoints if recorder is not None else seed.checkpoints
        return paired.pairs(), count
    finally:
        if paired is not None:
            paired.close()
            engine.arming = paired.arming
        if seed is not None:
            seed.uninstall()
        disarm()
        close_all()


def bench_paired(model: Any, args: argparse.Namespace, batch: int, out: Path) -> None:
    """``--paired``: each variant against itself switched off, step by step."""
    reqs = requests_for(model, args, batch)
    run_variant("disarmed", model, reqs, out, args.rows, Clock())  # warm-up
    names = [v for v in args.variants if v != "disarmed"]
    ratios: dict[str, list[float]] = {v: [] for v in names}
    on_ms: dict[str, list[float]] = {v: [] for v in names}
    off_ms: dict[str, list[float]] = {v: [] for v in names}
    pooled: dict[str, list[float]] = {v: [] for v in names}
    counts: dict[str, int] = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            pairs, counts[name] = run_paired(name, model, reqs, out, args.rows,
                                             random.Random(f"{batch}/{r}/{name}"))
            per_block = [a / b for a, b in pairs]
            pooled[name] += per_block
            ratios[name].append(statistics.median(per_block))
            on_ms[name].append(statistics.median(a for a, _ in pairs))
            off_ms[name].append(statistics.median(b for _, b in pairs))
    print(f"\nbatch {batch}, context {args.context}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds, paired steps (each variant on vs off in neighbouring "
          f"decode steps of one generate); median [min-max] over rounds of each round's "
          f"median; pooled: the median over every block of every round")
    print(f"{'variant':<11} {'off step ms':>20} {'on step ms':>20} {'on / off':>22} "
          f"{'pooled':>8} blocks ckpts")
    for name in names:
        print(f"{name:<11} {spread(off_ms[name], 1e3):>20} {spread(on_ms[name], 1e3):>20} "
              f"{spread(ratios[name], fmt='{:.4f}'):>22} "
              f"{statistics.median(pooled[name]):8.4f} {len(pooled[name]):6} {counts[name]}")
    if "seed-002" in names:
        over = statistics.median(pooled["seed-002"]) - 1
        for name in (n for n in names if n.startswith("tap")):
            mine = statistics.median(pooled[name]) - 1
            times = f"{over / mine:.1f}x" if mine > 0 else "unbounded (no overhead seen)"
            print(f"seed-002 overhead / {name} overhead (pooled): {times} "
                  f"({over:+.2%} vs {mine:+.2%})")


def requests_for(model: Any, args: argparse.Namespace, batch: int) -> list[Request]:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, model.config.vocab_size, (batch, args.context),
                            generator=gen).tolist()
    return [Request(request_id=f"q{i}", prompt_ids=p, max_new_tokens=args.new_tokens)
            for i, p in enumerate(prompts)]


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return (f"{fmt.format(statistics.median(values) * scale)} "
            f"[{fmt.format(min(values) * scale)}-{fmt.format(max(values) * scale)}]")


def bench_batch(model: Any, args: argparse.Namespace, batch: int, out: Path) -> None:
    reqs = requests_for(model, args, batch)
    run_variant("disarmed", model, reqs, out, args.rows, Clock())  # warm-up
    names = ("step", "cpu", "launch")
    per_round: dict[str, dict[str, list[float]]] = {
        v: {k: [] for k in (*names, "ratio", "cpu ratio")} for v in args.variants}
    info: dict[str, Any] = {}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for name in order:
            clock = Clock()
            info[name] = run_variant(name, model, reqs, out, args.rows, clock)
            for key, values in zip(names, (clock.steps(), clock.cpu_steps(), clock.launch[2:])):
                per_round[name][key].append(statistics.median(values))
        base = per_round["disarmed"]
        for name in args.variants:
            mine = per_round[name]
            mine["ratio"].append(mine["step"][-1] / base["step"][-1])
            mine["cpu ratio"].append(mine["cpu"][-1] / base["cpu"][-1])
    print(f"\nbatch {batch}, context {args.context}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds; median [min-max] over rounds; cpu: the engine thread's CPU "
          f"time per decode step; us/ckpt: cpu over disarmed's per checkpoint")
    print(f"{'variant':<11} {'step ms':>20} {'vs disarmed':>20} {'cpu ms':>20} "
          f"{'cpu vs disarmed':>20} {'launch ms':>20} ckpts  us/ckpt")
    disarmed = statistics.median(per_round["disarmed"]["cpu"])
    for name in args.variants:
        mine, count = per_round[name], info[name].get("checkpoints")
        over = ((statistics.median(mine["cpu"]) - disarmed) / count * 1e6) if count else None
        print(f"{name:<11} {spread(mine['step'], 1e3):>20} "
              f"{spread(mine['ratio'], fmt='{:.3f}'):>20} {spread(mine['cpu'], 1e3):>20} "
              f"{spread(mine['cpu ratio'], fmt='{:.3f}'):>20} {spread(mine['launch'], 1e3):>20} "
              f"{'-' if count is None else count:>5} {'-' if over is None else f'{over:7.2f}'}"
              + (f" ({info[name]['quick']} quick)" if "quick" in info[name] else ""))
    key = "cpu ratio" if args.device == "cpu" else "ratio"
    if {"seed-002", "tap"} <= set(args.variants):
        for name in ("tap", "tap-fp"):
            if name in args.variants:
                over = [s - 1 for s in per_round["seed-002"][key]]
                mine = [t - 1 for t in per_round[name][key]]
                times = (f"{statistics.median(over) / statistics.median(mine):.1f}x"
                         if statistics.median(mine) > 0 else "unbounded (no overhead seen)")
                print(f"seed-002 overhead / {name} overhead ({key}): {times} (overheads "
                      f"{statistics.median(over):+.1%} vs {statistics.median(mine):+.1%})")
    if args.breakdown:
        calibrate()
        print(f"\nwhere the tap's engine-thread time goes (CPU: thread time; GPU: wall; one "
              f"more generate each, batch {batch}, decode steps only), us per decode step "
              f"(wrapper own: the sublayer wrappers' time less the modules they wrap, the KV "
              f"points and the timing's own {TIMER[0] / 1e3:.2f} us; checkpoints taken at "
              f"the call inside it):")
        for name in [v for v in args.variants if v.startswith("tap")]:
            breakdown_on()
            SPENT.clear()
            clock = Clock()
            subscribe(on_begin=_decode)
            try:
                run_variant(name, model, reqs, out, args.rows, clock)
            finally:
                unsubscribe(_decode)
                DECODE[0] = True
                breakdown_off()
            steps = len(clock.cpu)  # decode steps only
            calls = SPENT.pop("wrapper calls", 1)
            SPENT["wrapper own"] = SPENT.get("wrapper own", 0) - SPENT.get("KV points", 0)
            parts = ", ".join(f"{k} {v / 1e3 / steps:.0f}" for k, v in SPENT.items())
            print(f"  {name}: {parts}; wrapper own per call "
                  f"{SPENT.get('wrapper own', 0) / calls / 1e3:.2f} us over {calls // steps} "
                  f"calls a step")
    if args.profile:
        profile = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: a shared host
        run_variant(args.profile, model, reqs, out, args.rows, Clock(), profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile_lines)
        print(f"\ncProfile of one generate of {args.profile} (batch {batch}), by own time:")
        print("\n".join(text.getvalue().splitlines()[:args.profile_lines + 12]))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(
            "enginetap", args.profile_lines)
        print(f"\nthe same, enginetap's functions by cumulative time:")
        print("\n".join(text.getvalue().splitlines()[:args.profile_lines + 12]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--profile", default="", choices=("", *VARIANTS))
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--breakdown", action="store_true", help="time the tap's parts")
    parser.add_argument("--paired", action="store_true", help="each variant on vs off in "
                        "neighbouring decode steps of one generate (see Paired)")
    parser.add_argument("--emulate-defer", action="store_true", help="CPU: the tap's GPU "
                        "path (deferred checkpoints, quick steps), see emulate_deferral")
    args = parser.parse_args()
    if "disarmed" not in args.variants:
        args.variants.insert(0, "disarmed")
    DEVICE[0] = args.device
    if args.device != "cpu":
        NOW[0] = time.perf_counter_ns
    if args.device == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    if args.emulate_defer:
        emulate_deferral()
    model = build(args.hidden, args.layers, args.device, dtype, args.vocab)
    print(f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}),"
          f" torch {torch.__version__}, random Llama hidden {args.hidden}, {args.layers} layers,"
          f" {dtype}, vocab {args.vocab}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
          + (", deferral emulated on the CPU" if args.emulate_defer else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            (bench_paired if args.paired else bench_batch)(model, args, batch, Path(tmp))


if __name__ == "__main__":
    main()
