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
- ``seed-002``: the seed's approach on those checkpoints, written here: forward hooks on
  the same sublayer modules (decoder layers' inputs, every sublayer's output), per
  checkpoint the tapped rows gathered, weighted int64 row sums kept on the device; at step
  end one stack and one device-to-host copy.

A decode step is the host interval between two consecutive decode steps' begins (the first
two of each run are left out: warm-up). Per variant: the median step over its runs in each
round; printed are the median over rounds and the spread (min-max) of the per-round
medians, and of the per-round ratio to ``disarmed``. The host time of the forward's launch
(step begin to the device wait the engine announces; CPU: to step end) is printed too:
that is where per-checkpoint host work shows. ``--profile VARIANT`` runs one more
generate of that variant under cProfile and prints where its host time went.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import tempfile
import time
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

VARIANTS = ("disarmed", "tap", "tap-fp", "tap-at-call", "seed-002")


def build(hidden: int, layers: int, device: str, dtype: torch.dtype) -> Any:
    """A random-weight Llama of width ``hidden`` (head dim 128, 8 KV heads) on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = max(1, hidden // 128)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 27 // 10,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=min(8, heads), vocab_size=32000,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Clock:
    """Per decode step: when it began and how long the host took to launch its forward."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.launch: list[float] = []
        self._began = 0.0
        self._waited = False

    def begin(self, step: Step) -> None:
        self._began, self._waited = time.perf_counter(), False
        if step.mode == "decode":
            self.begins.append(self._began)

    def wait(self, step: Step) -> None:
        if step.mode == "decode" and not self._waited:
            self._waited = True
            self.launch.append(time.perf_counter() - self._began)

    def end(self, step: Step) -> None:
        if step.mode == "decode" and not self._waited:
            self.launch.append(time.perf_counter() - self._began)

    def steps(self, skip: int = 2) -> list[float]:
        return [b - a for a, b in zip(self.begins[skip:], self.begins[skip + 1:])]


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

    def install(self) -> None:
        for module in self.modules:
            if type(module).__name__.endswith("DecoderLayer"):
                self.handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post))
        subscribe(on_begin=self.begin, on_end=self.end)

    def uninstall(self) -> None:
        unsubscribe(self.begin)
        unsubscribe(self.end)
        for handle in self.handles:
            handle.remove()
        self.handles, self.index = [], None

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


DEVICE = ["cpu"]


def run_variant(name: str, model: Any, reqs: list[Request], out: Path, rows: int,
                clock: Clock, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """One generate of ``name``; the recorder's (or seed's) checkpoints per step."""
    options = {"max_rows": rows}
    if name == "tap-fp":
        options.update(continuity=False, sampler=False)
    arm = None
    if name.startswith("tap"):  # tap-at-call: the default options
        arm = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out / name,
                        options={"tap": options, "step": {"record": False}})
    seed = SeedStyle(model, rows) if name == "seed-002" else None
    info: dict[str, Any] = {}
    try:
        engine = HFEngine.from_loaded(model, prefix_cache_size=0, arm=arm)
        if name == "tap-at-call":
            engine.arming.context.notes["tap"].quick_steps = False
        if seed is not None:
            seed.install()
        subscribe(on_begin=clock.begin, on_end=clock.end, on_wait=clock.wait)
        gc.collect()
        if profile is not None:
            profile.enable()
        engine.generate(reqs)
        if profile is not None:
            profile.disable()
        if engine.arming is not None:
            recorder = engine.arming.context.notes["tap"]
            info["checkpoints"] = f"{recorder.last_checkpoints} ({recorder.quick_count} quick)"
        elif seed is not None:
            info["checkpoints"] = seed.checkpoints
    finally:
        unsubscribe(clock.begin)
        unsubscribe(clock.end)
        unsubscribe(clock.wait)
        if seed is not None:
            seed.uninstall()
        disarm()
        close_all()
    return info


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return (f"{fmt.format(statistics.median(values) * scale)} "
            f"[{fmt.format(min(values) * scale)}-{fmt.format(max(values) * scale)}]")


def bench_batch(model: Any, args: argparse.Namespace, batch: int, out: Path) -> None:
    gen = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, args.context), generator=gen).tolist()
    reqs = [Request(request_id=f"q{i}", prompt_ids=p, max_new_tokens=args.new_tokens)
            for i, p in enumerate(prompts)]
    run_variant("disarmed", model, reqs, out, args.rows, Clock())  # warm-up
    per_round: dict[str, list[float]] = {v: [] for v in args.variants}
    launch: dict[str, list[float]] = {v: [] for v in args.variants}
    ratios: dict[str, list[float]] = {v: [] for v in args.variants}
    info: dict[str, Any] = {}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for name in order:
            clock = Clock()
            info[name] = run_variant(name, model, reqs, out, args.rows, clock)
            per_round[name].append(statistics.median(clock.steps()))
            launch[name].append(statistics.median(clock.launch[2:]))
        for name in args.variants:
            ratios[name].append(per_round[name][-1] / per_round["disarmed"][-1])
    print(f"\nbatch {batch}, context {args.context}, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds; median [min-max] over rounds")
    print(f"{'variant':<11} {'step ms':>22} {'vs disarmed':>24} {'launch ms':>22} checkpoints")
    for name in args.variants:
        print(f"{name:<11} {spread(per_round[name], 1e3):>22} "
              f"{spread(ratios[name], fmt='{:.3f}'):>24} {spread(launch[name], 1e3):>22} "
              f"{info[name].get('checkpoints', '-')}")
    if {"seed-002", "tap"} <= set(args.variants):
        for name in ("tap", "tap-fp"):
            if name in args.variants:
                over = [s - 1 for s in ratios["seed-002"]]
                mine = [t - 1 for t in ratios[name]]
                times = (f"{statistics.median(over) / statistics.median(mine):.1f}x"
                         if statistics.median(mine) > 0 else "unbounded (no overhead seen)")
                print(f"seed-002 overhead / {name} overhead: {times} (overheads "
                      f"{statistics.median(over):+.1%} vs {statistics.median(mine):+.1%})")
    if args.profile:
        profile = cProfile.Profile()
        run_variant(args.profile, model, reqs, out, args.rows, Clock(), profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile_lines)
        print(f"\ncProfile of one generate of {args.profile} (batch {batch}), by own time:")
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
    args = parser.parse_args()
    if "disarmed" not in args.variants:
        args.variants.insert(0, "disarmed")
    DEVICE[0] = args.device
    if args.device == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = build(args.hidden, args.layers, args.device, dtype)
    print(f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}),"
          f" torch {torch.__version__}, random Llama hidden {args.hidden}, {args.layers} layers,"
          f" {dtype}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            bench_batch(model, args, batch, Path(tmp))


if __name__ == "__main__":
    main()
