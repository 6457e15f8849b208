"""Where the tap's host time per decode step goes, layer by layer of its wrapping (a
diagnostic beside ``bench_tap.py``, whose model, decode loop and variants it reuses).

    python bench/tap_host_breakdown.py --device cuda --hidden 5120 --layers 48 --batch 64 \
        --context 512 --dtype bfloat16
    python bench/tap_host_breakdown.py                     # built-in tiny llama on the CPU

Variants, rotated round by round in one process: ``disarmed``; ``scope`` (only the module
scope's wrappers: the tap armed alone installs none since ``1eba9af``, and left them shut
before); ``tap-empty`` (the tap armed, its recorder's ``take`` replaced by a function
that returns at once: the wrappers' own cost); ``tap-keep`` (the checkpoint only keeps each
tensor alive until step end, as a deferred checkpoint does: what holding hundreds of
activations costs the rest of the forward, e.g. the caching allocator's work); ``tap`` (as
armed, fingerprints only, but every checkpoint examined at its call: the recorder's quick
steps off, as in the three before it); ``tap-quick`` (as armed: in settled steps the
wrappers only list the checkpoints, examined in one loop at the device wait);
``seed-002``. (An earlier ``tap-nopoll``, without the record sink's idle-writer thread,
showed no effect and was dropped.) Prints per variant the median decode step, the host
time to launch the forward and the engine thread's own CPU time in it, the Python
threads alive, and the host time per call of the recorder's ``take`` in the full
tap variant. The differences between consecutive lines are the cost of each layer:
scope − disarmed the scope's wrappers (which the tap no longer runs), tap-empty − scope
the tap's wrapper, tap-keep − tap-empty what keeping the tensors costs, tap − tap-empty
the checkpoints themselves, tap-quick − tap what listing them instead saves.

To compare two versions of enginetap on one machine start, run it twice back to back
with ``PYTHONPATH`` pointing at each tree's ``src``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tap as bt  # noqa: E402

from enginetap.tap.record import TapRecorder  # noqa: E402
from enginetap.core.context import subscribe, unsubscribe  # noqa: E402
from enginetap.core.sink import RecordSink  # noqa: E402

CHECKPOINT = TapRecorder.take
SETTLE = TapRecorder.settle
IDLE_WRITER = RecordSink._idle_writer
SPENT: dict[str, list[float]] = {}
"""Host seconds per checkpoint call, by variant."""


class ScopeOnly(bt.TapVariant):
    """The module scope's wrappers alone (``capabilities=["scope"]``)."""

    def install(self) -> None:
        from enginetap.capabilities import arm
        from enginetap.config import ArmConfig
        from enginetap.engines.hf.arming import HFHooks

        config = ArmConfig(enabled=True, capabilities=["scope"], out_dir=self.out,
                           options={"step": {"record": False}})
        self.arming = arm(config, HFHooks())
        self.arming.hooks.model_loaded(self.model)

    def uninstall(self) -> None:
        self.arming.uninstall()


KEPT: list[Any] = []
"""The ``tap-keep`` variant's tensors of the current step."""


def _release(step: Any) -> None:
    KEPT.clear()


class Altered(bt.TapVariant):
    """The tap with one part changed while it is installed (``what``: ``empty``, the
    checkpoint returns at once; ``keep``, it only keeps the tensor until step end;
    ``nopoll``, no idle-writer thread; ``timed``, the checkpoint timed per call)."""

    def __init__(self, model: Any, out: Path, options: dict[str, Any], what: str,
                 label: str) -> None:
        super().__init__(model, out, options)
        self.what, self.label = what, label
        self.quick = what == "quick"

    def install(self) -> None:
        if self.what == "quick":
            TapRecorder.settle = self._timed_settle()  # type: ignore[method-assign]
        elif self.what == "empty":
            TapRecorder.take = lambda self, name, tensor: None  # type: ignore[method-assign]
        elif self.what == "keep":  # only what a deferred checkpoint holds: the tensor
            TapRecorder.take = (  # type: ignore[method-assign]
                lambda self, name, tensor: KEPT.append(tensor))
            subscribe(on_end=_release)
        else:
            TapRecorder.take = self._timed()  # type: ignore[method-assign]
        if self.what == "nopoll":
            RecordSink._idle_writer = lambda self: None  # type: ignore[method-assign]
        super().install()

    def uninstall(self) -> None:
        try:
            super().uninstall()
        finally:
            unsubscribe(_release)
            KEPT.clear()
            TapRecorder.take = CHECKPOINT  # type: ignore[method-assign]
            TapRecorder.settle = SETTLE  # type: ignore[method-assign]
            RecordSink._idle_writer = IDLE_WRITER  # type: ignore[method-assign]

    def _timed(self) -> Any:
        """The recorder's checkpoint, timed per call under this variant's label."""
        spent = SPENT.setdefault(self.label, [])

        def timed(recorder: TapRecorder, name: str, tensor: Any) -> None:
            start = time.perf_counter()
            try:
                CHECKPOINT(recorder, name, tensor)
            finally:
                spent.append(time.perf_counter() - start)

        return timed

    def _timed_settle(self) -> Any:
        """The recorder's settle (a quick step's checkpoints examined), timed per step."""
        spent = SPENT.setdefault("settle", [])

        def timed(recorder: TapRecorder) -> None:
            listed = recorder.quick
            start = time.perf_counter()
            try:
                SETTLE(recorder)
            finally:
                if listed:
                    spent.append(time.perf_counter() - start)

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bt.model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per variant "
                        "per round (after 4 untimed: the tap's quick steps start at the fifth)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bt.DEVICE = args.device
    model = bt.build(args)
    out = Path(tempfile.mkdtemp(prefix="tap-breakdown-"))
    base = bt.make_variants(model, out, args.rows)
    options = {"max_rows": args.rows, "continuity": False, "sampler": False}
    variants: dict[str, Any] = {
        "disarmed": base["disarmed"], "scope": ScopeOnly(model, out / "scope", {}),
        "tap-empty": Altered(model, out / "empty", options, "empty", "tap-empty"),
        "tap-keep": Altered(model, out / "keep", options, "keep", "tap-keep"),
        "tap": Altered(model, out / "tap", options, "timed", "tap"),
        "tap-quick": Altered(model, out / "quick", options, "quick", "tap-quick"),
        "seed-002": base["seed-002"]}
    steps = args.rounds * len(variants) * (args.steps + 4) + 10
    loop = bt.Loop(model, args.batch, args.context, args.device, args.context + steps + 8)
    found: dict[str, list[tuple[float, float, float, int]]] = {}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            variant.install()
            threads = threading.active_count()
            try:
                for _ in range(4):
                    loop.decode()
                for _ in range(args.steps):
                    step = loop.decode()
                    found.setdefault(name, []).append((step, loop.launched, loop.launched_cpu,
                                                       threads))
            finally:
                variant.uninstall()
    model_name = f"llama hidden {args.hidden} x {args.layers}" if args.hidden else args.model
    print(f"device {args.device}, model {model_name}, batch {args.batch}, context "
          f"{args.context}, {args.rounds}x{args.steps} steps per variant, torch "
          f"{torch.__version__}")
    disarmed = statistics.median(s for s, *_ in found["disarmed"])
    for name, rows in found.items():
        step = statistics.median(s for s, *_ in rows)
        launch = statistics.median(r[1] for r in rows)
        cpu = statistics.median(r[2] for r in rows)
        print(f"  {name:10s} step {step * 1e3:7.2f} ms ({(step - disarmed) * 1e3:+6.2f}; min "
              f"{min(s for s, *_ in rows) * 1e3:7.2f})  launch {launch * 1e3:7.2f} ms (engine "
              f"thread CPU {cpu * 1e3:7.2f} ms)  Python threads {rows[0][3]}")
    for name, spent in SPENT.items():
        ordered = sorted(spent)
        what = "a quick step's settle" if name == "settle" else f"checkpoint in {name}"
        if not spent:  # e.g. no quick step settled: the CPU without Triton gathers at the call
            print(f"  {what}: no calls")
            continue
        print(f"  {what}: median {statistics.median(spent) * 1e6:.2f} us, mean "
              f"{statistics.fmean(spent) * 1e6:.2f} us, p90 "
              f"{ordered[len(ordered) * 9 // 10] * 1e6:.2f} us over {len(spent)} calls")


if __name__ == "__main__":
    main()
