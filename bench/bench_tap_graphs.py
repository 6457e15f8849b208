"""The tap's cost in the built-in engine's CUDA-graph decode mode, through its own loop.

    PYTHONPATH=src python bench/bench_tap_graphs.py --hidden 5120 --layers 48 \
        --context 512 --batch 64 8 --rounds 5 --steps 40 [--json out.json]

A random-weight Llama of the given width is built on the device once. Each round runs,
per batch size and per variant (interleaved, so machine noise hits all alike), one
``HFEngine.from_loaded(model, mode="graphs").generate`` call of ``batch`` prompts of
``context`` random tokens and ``steps`` new tokens (greedy, no EOS):

- ``disarmed``: nothing installed;
- ``tap``: the tap armed with its default options; its checkpoints are hashed inside the
  captured graphs (``enginetap::tap_hash_rows_fixed``), the sampler's top-2 after replay.

A decode step is the host interval between consecutive decode steps' begins (the
engine's sampling waits for the device each step, so it is the replayed step's time);
the first two decode steps of a call are left out (the capture of its bucket). Prints per
batch and variant the median over rounds of the per-call median step, the spread
(min-max of those) and the tap's overhead; the tokens of the tap and disarmed calls of
the same round are compared, and each disarmed call's with the first round's (whether
the engine itself repeats its tokens run to run at this batch). The device time of
each replay (CUDA events around it) splits the tap's cost into device and host; ``--breakdown`` times the tap's host parts in one more
call per batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from enginetap.config import ArmConfig
from enginetap.core.context import Step, subscribe, unsubscribe
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm


def build(hidden: int, layers: int, device: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = hidden // 128
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 27 // 10,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=min(8, heads), vocab_size=32000,
                         max_position_embeddings=4096, eos_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


class Clock:
    """Host time of each decode step's begin."""

    def __init__(self) -> None:
        self.begins: list[float] = []

    def __call__(self, step: Step) -> None:
        if step.mode == "decode":
            self.begins.append(time.perf_counter())

    def intervals(self, skip: int = 2) -> list[float]:
        times = self.begins[skip:]
        return [b - a for a, b in zip(times, times[1:])]


class ReplayTimer:
    """Device time of each graph replay (CUDA events around ``CUDAGraph.replay``): the
    tap's device share of the step, apart from its host work."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []
        original = torch.cuda.CUDAGraph.replay

        def replay(graph: Any) -> None:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            original(graph)
            end.record()
            self.pairs.append((start, end))

        torch.cuda.CUDAGraph.replay = replay  # this benchmark's process only

    def take(self, skip: int = 2) -> float:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in self.pairs[skip:]]
        self.pairs.clear()
        return statistics.median(times)


TIMER: ReplayTimer | None = None

PARTS: dict[str, float] = {}
"""``--breakdown``: wall seconds of each timed part over the decode steps of one call."""
DECODE = [False]


def _decode(step: Step) -> None:
    DECODE[0] = step.mode == "decode"


def breakdown_on() -> list[tuple[Any, str, Any]]:
    """Time (wall, decode steps only) the tap's parts in graphs mode: the recorder's step
    begin (rows picked, the static index checked), the LM head's sampler hook, the device
    wait (the buffer queued, the last record written), the step end; and the engine's
    armed-only valid-length read and fill. Returns what to undo."""
    from enginetap.engines.hf import engine as hf_engine
    from enginetap.tap.record.compiled import CompiledTap
    from enginetap.tap.record.recorder import TapRecorder

    undo = []
    for owner, attr, label in ((TapRecorder, "begin", "step begin"),
                               (TapRecorder, "end", "step end"),
                               (TapRecorder, "waiting", "device wait"),
                               (CompiledTap, "queue", "queue (in the wait)"),
                               (CompiledTap, "_head_hook", "sampler hook"),
                               (hf_engine, "fill_valid_lengths", "valid lengths filled"),
                               (hf_engine, "read_valid_lengths", "valid lengths read")):
        original = getattr(owner, attr)
        undo.append((owner, attr, original))

        def timed(*args: Any, _original: Any = original, _label: str = label,
                  **kwargs: Any) -> Any:
            if not DECODE[0]:
                return _original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                PARTS[_label] = PARTS.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)
    return undo


def one_call(model: Any, prompts: list[list[int]], steps: int, armed: bool,
             out: Path) -> tuple[float, float, list[list[int]]]:
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"step": {"record": False}}) if armed else None
    clock = Clock()
    subscribe(on_begin=clock)
    try:
        engine = HFEngine.from_loaded(model, arm=config, mode="graphs", prefix_cache_size=0)
        reqs = [Request(request_id=f"q{i}", prompt_ids=p, max_new_tokens=steps)
                for i, p in enumerate(prompts)]
        with torch.inference_mode():
            tokens = [c.output_ids for c in engine.generate(reqs)]
    finally:
        unsubscribe(clock)
        disarm()
        close_all()
    del engine
    torch.cuda.empty_cache()
    assert TIMER is not None
    return statistics.median(clock.intervals()), TIMER.take(), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--breakdown", action="store_true",
                        help="one more tap call per batch with the tap's parts timed")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    model = build(args.hidden, args.layers, "cuda")
    global TIMER
    TIMER = ReplayTimer()
    generator = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {"machine_start": started, "args": vars(args) | {"json": None},
                               "gpu": torch.cuda.get_device_name(), "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            prompts = torch.randint(3, 32000, (batch, args.context), generator=generator)
            per: dict[str, list[float]] = {"disarmed": [], "tap": []}
            replay: dict[str, list[float]] = {"disarmed": [], "tap": []}
            same, repeat, first_disarmed = [], [], None
            for r in range(args.rounds):
                order = ["disarmed", "tap"] if r % 2 == 0 else ["tap", "disarmed"]
                got = {}
                for variant in order:
                    step, graph, tokens = one_call(model, prompts.tolist(), args.steps,
                                            variant == "tap", Path(tmp) / f"{batch}-{r}")
                    per[variant].append(step * 1e3)
                    replay[variant].append(graph)
                    got[variant] = tokens
                same.append(got["tap"] == got["disarmed"])
                if first_disarmed is None:
                    first_disarmed = got["disarmed"]
                else:  # is the engine itself run-to-run deterministic here?
                    repeat.append(got["disarmed"] == first_disarmed)
            off, on = statistics.median(per["disarmed"]), statistics.median(per["tap"])
            row = {v: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                       "rounds": t} for v, t in per.items()}
            row["overhead_pct"] = 100 * (on - off) / off
            r_off, r_on = statistics.median(replay["disarmed"]), statistics.median(replay["tap"])
            row["replay_ms"] = {"disarmed": replay["disarmed"], "tap": replay["tap"]}
            row["replay_overhead_ms"] = r_on - r_off
            row["tokens_equal_per_round"] = same
            row["disarmed_equal_to_round0"] = repeat
            results["batches"][str(batch)] = row
            print(f"batch {batch}: disarmed {off:.2f} ms [{min(per['disarmed']):.2f}-"
                  f"{max(per['disarmed']):.2f}], tap {on:.2f} ms [{min(per['tap']):.2f}-"
                  f"{max(per['tap']):.2f}], overhead {row['overhead_pct']:+.2f} %; graph "
                  f"replay (device) disarmed {r_off:.3f} ms, tap {r_on:.3f} ms "
                  f"({r_on - r_off:+.3f} ms), "
                  f"tokens tap==disarmed per round {same}, disarmed==its round 0 {repeat}",
                  flush=True)
            if args.breakdown:
                undo = breakdown_on()
                PARTS.clear()
                subscribe(on_begin=_decode)
                try:
                    one_call(model, prompts.tolist(), args.steps, True, Path(tmp) / f"{batch}-b")
                finally:
                    unsubscribe(_decode)
                    for owner, attr, original in undo:
                        setattr(owner, attr, original)
                steps = args.steps - 1  # decode steps (the prefill gives the first token)
                parts = ", ".join(f"{k} {v / steps * 1e6:.0f}" for k, v in PARTS.items())
                print(f"batch {batch}, where the tap's host time goes (one more call, wall, "
                      f"us per decode step; the wait's own work overlaps the replay): {parts}",
                      flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
