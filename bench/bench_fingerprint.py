"""Whole-tensor fingerprint bandwidth: Triton kernel vs torch chunked vs a device copy.

    python bench/bench_fingerprint.py [--gib 1] [--repeats 20]     # needs CUDA

A state or KV cache is fingerprinted between steps to catch rows something else
overwrote. Side by side in one run, medians of CUDA-event timings over the same bf16
tensor: ``copy`` (``clone``: read + write, the device's practical bandwidth), ``triton``
(:func:`enginetap.tap.record.kernels.fingerprint_tensor`) and ``torch chunked`` (int64 words
times weights, 4 Mi words per chunk: the approach of seed 004's checksum). Bandwidth is
the tensor's bytes read per second (for ``copy``, read + write). Also checks that the
two fingerprints agree.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` by CUDA events (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    from enginetap.tap.record import kernels
    from enginetap.tap.record.fingerprint import fingerprint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not kernels.available(torch.zeros(1, device="cuda")):
        raise SystemExit("bench_fingerprint needs CUDA and Triton")
    n = int(args.gib * (1 << 30)) // 2
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    saved = kernels.triton

    def torch_chunked() -> int:
        kernels.triton = None
        try:
            return fingerprint(x)
        finally:
            kernels.triton = saved

    agree = kernels.fingerprint_tensor(x) == torch_chunked()
    rows = {"copy": (timed(lambda: x.clone(), args.repeats), 2 * nbytes),
            "triton": (timed(lambda: kernels.fingerprint_tensor(x), args.repeats), nbytes),
            "torch chunked": (timed(torch_chunked, args.repeats), nbytes)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {kernels.triton.__version__}, tensor {nbytes / (1 << 30):.2f} GiB bf16, "
          f"fingerprints agree: {agree}")
    base = rows["triton"][0]
    for name, (seconds, moved) in rows.items():
        print(f"  {name:14s} {seconds * 1e3:8.3f} ms  {moved / seconds / 1e12:6.3f} TB/s"
              f"  x{seconds / base:7.2f} of triton")


if __name__ == "__main__":
    main()
