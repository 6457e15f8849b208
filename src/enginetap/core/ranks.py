"""Ranks: who am I in the process group, per-rank file names, agreement across ranks.

Works with any initialized ``torch.distributed`` group (gloo or NCCL) and degrades to a
single rank when none is initialized. Engine adapters may register a resolver for the
engine's own tensor-parallel group (see :func:`set_group_resolver`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["agree", "rank_path", "rank_world", "set_group_resolver"]

_GROUP_RESOLVER: Callable[[], Any] | None = None


def set_group_resolver(resolver: Callable[[], Any] | None) -> None:
    """Make ``resolver()`` the default group (e.g. vLLM's tensor-parallel device group)."""
    global _GROUP_RESOLVER
    _GROUP_RESOLVER = resolver


def _dist() -> Any | None:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def default_group() -> Any | None:
    if _GROUP_RESOLVER is not None:
        try:
            return _GROUP_RESOLVER()
        except Exception:  # the engine's group is not up yet (early in start-up)
            return None
    return None


def rank_world(group: Any | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (default group), env vars, or ``(0, 1)``."""
    dist = _dist()
    if dist is not None:
        group = group if group is not None else default_group()
        return dist.get_rank(group), dist.get_world_size(group)
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        return int(rank), int(world)
    return 0, 1


def rank_path(path: str | Path, rank: int) -> Path:
    """``out/tap.jsonl`` → ``out/tap-rank1.jsonl``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-rank{rank}{path.suffix}")


def _device_for(dist: Any, group: Any | None) -> str:
    backend = dist.get_backend(group)
    if backend == "nccl":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def agree(flag: bool, group: Any | None = None) -> bool:
    """Logical AND of ``flag`` over every rank of ``group``; ``flag`` itself when alone.

    Every rank of the group must call this the same number of times (it is a collective).
    """
    dist = _dist()
    if dist is None:
        return bool(flag)
    import torch

    group = group if group is not None else default_group()
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device_for(dist, group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())
