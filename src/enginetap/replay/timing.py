"""Median wall time of a call: warm-up runs first, then timed repeats.

Each run gets fresh arguments from ``prepare`` (input clones, output buffers), made outside
the timed region. On CUDA the time is measured between two CUDA events around the call,
after a synchronize, so it is device time of the queued kernels; on the CPU it is
``time.perf_counter_ns`` around the call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["median_ms"]

Prepared = tuple[tuple[Any, ...], dict[str, Any]]


def median_ms(call: Callable[..., Any], prepare: Callable[[], Prepared], *, device: str,
              warmup: int, repeats: int) -> float | None:
    """Median milliseconds of ``call(*args, **kwargs)`` over ``repeats`` runs (None if 0).

    Raises whatever ``call`` raises.
    """
    for _ in range(warmup):
        args, kwargs = prepare()
        call(*args, **kwargs)
    timer = _cuda_ms if device.startswith("cuda") else _cpu_ms
    samples = []
    for _ in range(repeats):
        args, kwargs = prepare()
        samples.append(timer(call, args, kwargs))
    return statistics.median(samples) if samples else None


def _cpu_ms(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    start = time.perf_counter_ns()
    call(*args, **kwargs)
    return (time.perf_counter_ns() - start) / 1e6


def _cuda_ms(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Work queued before (input clones) must not be counted in this call's time.
    torch.cuda.synchronize()
    start.record()
    call(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))
