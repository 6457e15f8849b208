"""Candidate solutions for the rmsnorm example, used by the replay tests (by file path)."""

from __future__ import annotations

import torch


def _rmsnorm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # A different formulation from the reference: divide by the root instead of
    # multiplying by rsqrt, and weight before the division.
    x = hidden_states.float()
    root = torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return (x * weight.float() / root).to(hidden_states.dtype)


def correct(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rmsnorm(hidden_states, weight, eps)


def no_weight(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rmsnorm(hidden_states, torch.ones_like(weight), eps)


def one_nan(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = _rmsnorm(hidden_states, weight, eps)
    out[0, 3] = float("nan")
    return out


def raising(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise ValueError("kernel not built for this shape\nsecond line of detail")


_FIRST_SEEN: dict[float, float] = {}


def mutating(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scribbles over its input after use, and raises if it is ever given such an input."""
    key, seen = float(weight.float().sum()), float(hidden_states.float().sum())
    if _FIRST_SEEN.setdefault(key, seen) != seen:
        raise RuntimeError("called with inputs an earlier call modified")
    out = _rmsnorm(hidden_states, weight, eps)
    hidden_states.mul_(-3.0)
    return out


def into(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float,
         output: torch.Tensor) -> None:
    output.copy_(_rmsnorm(hidden_states, weight, eps))


def into_all_but_last_row(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float,
                          output: torch.Tensor) -> None:
    output[:-1].copy_(_rmsnorm(hidden_states[:-1], weight, eps))


def exiting(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import os

    os._exit(3)  # as a crashed CUDA context or a segfault ends the process: no exception


_POISONED: list[bool] = []


def poisons_its_process(hidden_states: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Fails once and leaves its process unusable, as a CUDA error leaves the context."""
    if _POISONED:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    _POISONED.append(True)
    raise RuntimeError("CUDA error: an illegal memory access was encountered (first)")


def cuda_device_assert(hidden_states: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """A real CUDA fault: an out-of-range gather trips a device-side assert, after which
    the process's CUDA context refuses every later call (GPU tests only)."""
    out = _rmsnorm(hidden_states, weight, eps)
    wild = torch.full((1,), hidden_states.shape[0] + 10**6, device=out.device)
    out[0] = out[wild][0]
    torch.cuda.synchronize()
    return out


def hanging(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A kernel that never returns."""
    import time

    time.sleep(3600)
    return _rmsnorm(hidden_states, weight, eps)
