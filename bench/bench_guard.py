"""Overhead of an ExactPatch after the first call per key (the proof is not timed).

    python bench/bench_guard.py [--repeats 7] [--device cuda]

For a small and a larger RMSNorm input it times, in one run and on the same inputs:
the stock function alone; the guarded call where the proof chose the patched path (the
patched function is the stock math, so only the guard's cost shows); the guarded call
where the proof chose the stock path. The three loops are interleaved so that machine
noise hits them alike. Prints medians per call and the ratios to stock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from enginetap.guard import ExactPatch


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


def norm_a(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rms(x, weight)


def norm_b(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rms(x, weight)


def rms_norm_inexact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Squares summed in the input dtype: never bit-exact, so the proof keeps the stock path.
    var = x.pow(2).sum(dim=-1, keepdim=True).float() / x.shape[-1]
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _loop(fn: Callable[[], object], calls: int, device: str) -> float:
    # On a GPU the loop is synchronized at both ends: time per call includes the launch
    # and the kernel, which is what a caller of the patched function waits for.
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def _case(rows: int, width: int, calls: int, repeats: int, device: str) -> list[float]:
    """Median seconds per call: stock, guarded→patched, guarded→stock (interleaved loops)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16).to(device)
    module = sys.modules[__name__]
    stock = norm_a  # the function object itself, taken before the patch replaces the name
    exact = ExactPatch(f"{__name__}:norm_a", _rms, mode="check")
    inexact = ExactPatch(f"{__name__}:norm_b", rms_norm_inexact, mode="check")
    with exact, inexact:
        for patch, fn in ((exact, module.norm_a), (inexact, module.norm_b)):
            fn(x, w)  # the proof, not timed
            (decision,) = patch.decisions.values()
            assert decision.patched is (patch is exact), decision.reason
        runs = [lambda: stock(x, w), lambda: module.norm_a(x, w), lambda: module.norm_b(x, w)]
        samples: list[list[float]] = [[], [], []]
        for _ in range(repeats):
            for run, sink in zip(runs, samples):
                sink.append(_loop(run, calls, device))
    return [statistics.median(s) for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 thread"
    print(f"torch {torch.__version__}, {where}, medians of {args.repeats} interleaved loops; "
          "overhead = guarded→patched - stock")
    print(f"{'input (bf16)':>16} {'stock':>10} {'guarded→patched':>16} {'ratio':>6} "
          f"{'guarded→stock':>14} {'ratio':>6} {'overhead':>9}")
    for rows, width, calls in ((4, 128, 2000), (64, 1024, 400), (1024, 4096, 8)):
        stock, patched, kept = _case(rows, width, calls, args.repeats, args.device)
        print(f"{f'{rows}x{width}':>16} {stock * 1e6:>8.1f}us {patched * 1e6:>14.1f}us "
              f"{patched / stock:>6.2f} {kept * 1e6:>12.1f}us {kept / stock:>6.2f} "
              f"{(patched - stock) * 1e6:>7.1f}us")

if __name__ == "__main__":
    main()
