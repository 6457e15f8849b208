"""Host time of one tapped module call against a forward hook's (issue 29: per checkpoint
host work at or below a forward hook's).

    PYTHONPATH=src python bench/tap_call_cost.py [--calls 20000] [--rounds 7]

One decoder layer and one sublayer module of a tiny random-weight Llama (the forwards
replaced by an identity, so only the call machinery is timed), called in a loop on the
engine thread's CPU clock, in four ways rotated round by round: ``bare``; ``hook`` (a
forward hook that does nothing: PyTorch's hook dispatch); ``wrapt`` (a pass-through
enginetap patch on the class's forward: the patching layer); ``tap`` (the tap's sublayer
wrapper on that patch, with the recorder in a quick step, the state a settled decode step
runs in: a layer lists its input and output, a sublayer its output). Prints the median
microseconds per call and each one's cost over ``bare``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from typing import Any

import torch

from enginetap.core.patching import Patch, PatchSet
from enginetap.tap.record.points import CheckpointNames, ModuleNames, sublayer_wrapper


class Layer(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class Sublayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def quick_recorder() -> Any:
    """The recorder attributes a sublayer wrapper reads, as in a quick step."""
    options = types.SimpleNamespace(inputs="layers", depth="sublayers")
    return types.SimpleNamespace(step=object(), quick=[], at_call=set(), options=options,
                                 wrapper_failed=print)


def per_call(module: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        module(x)
    return (time.thread_time_ns() - start) / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recorder, names = quick_recorder(), CheckpointNames()
    modules = {"layer": Layer(), "sublayer": Sublayer()}
    names._names[id(modules["layer"])] = ModuleNames(("L0", "L0.in", "L0.out", "L0", True))
    names._names[id(modules["sublayer"])] = ModuleNames(
        ("L0.mlp", "L0.mlp.in", "L0.mlp.out", "mlp", False))
    targets = [f"{__name__}:{cls.__qualname__}.forward" for cls in (Layer, Sublayer)]
    ways = ("bare", "hook", "wrapt", "tap")
    found: dict[tuple[str, str], list[float]] = {}
    x = torch.zeros(8, 1, 128)
    with torch.inference_mode():
        for r in range(args.rounds):
            for way in ways[r % 4:] + ways[:r % 4]:
                handles, patches = [], None
                if way == "hook":
                    handles = [m.register_forward_hook(lambda *a: None) for m in modules.values()]
                elif way in ("wrapt", "tap"):
                    wrapper = (sublayer_wrapper(recorder, names) if way == "tap"
                               else lambda w, i, a, k: w(*a, **k))
                    patches = PatchSet("bench", [Patch(t, wrapper) for t in targets]).install()
                try:
                    for kind, module in modules.items():
                        recorder.quick.clear()
                        found.setdefault((way, kind), []).append(per_call(module, x, args.calls))
                finally:
                    for handle in handles:
                        handle.remove()
                    if patches is not None:
                        patches.uninstall()
    print(f"torch {torch.__version__}, {args.rounds} rounds of {args.calls} calls; median "
          f"us per call [min-max over rounds], and over bare")
    for kind in modules:
        bare = statistics.median(found[("bare", kind)])
        for way in ways:
            times = found[(way, kind)]
            print(f"  {kind:<9} {way:<6} {statistics.median(times):6.2f} "
                  f"[{min(times):.2f}-{max(times):.2f}]  +{statistics.median(times) - bare:.2f}")


if __name__ == "__main__":
    main()
