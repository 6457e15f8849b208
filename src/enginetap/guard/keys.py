"""Keys of the exactness proof: which calls share one decision.

A key must be rank-invariant: every rank of the group computes the same key sequence, so
that all ranks reach the first call of a key — and its collective — together. Shapes,
dtypes and device kinds qualify in tensor parallelism (every rank sees the same shapes);
data values, ranks, timings and request ids do not.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

KeyFunction = Callable[[tuple, dict], Hashable]
"""``key(args, kwargs) -> hashable``; ``args`` exclude ``self`` / ``cls``."""

__all__ = ["KeyFunction", "describe_key", "shape_key"]


def _signature(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple([_signature(v) for v in value])
    return type(value)


def shape_key(args: tuple, kwargs: dict) -> Hashable:
    """Default key: shape, dtype and device of each tensor argument, by position and name.

    ``None`` and nested tuples / lists keep their place; any other value counts only by
    its type, so scalars that vary from call to call do not multiply proofs.
    """
    # Hot path: list comprehensions, not generators (about half the cost per call).
    key = tuple([(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else _signature(a)
                 for a in args])
    if kwargs:
        key += tuple([(name, _signature(v)) for name, v in kwargs.items()])
    return key


def describe_key(key: Any) -> str:
    """A short text for a key in logs: ``(bfloat16[44, 128], None)`` for a shape key."""
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], torch.Size):
        shape, dtype, device = key
        where = "" if device.type == "cpu" else f"@{device}"
        return f"{str(dtype).removeprefix('torch.')}{list(shape)}{where}"
    if isinstance(key, tuple):
        inner = ", ".join(describe_key(k) for k in key)
        return f"({inner},)" if len(key) == 1 else f"({inner})"
    if isinstance(key, type):
        return key.__name__
    return repr(key)
