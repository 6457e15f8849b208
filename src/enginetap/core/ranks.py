"""Ranks: who am I in the process group, per-rank files, agreement and gathering across ranks.

Works with any initialized ``torch.distributed`` group (gloo or NCCL) and degrades to a
single rank when none is initialized. Engine adapters may register a resolver for the
engine's own tensor-parallel group (see :func:`set_group_resolver`).

Each rank writes its own ``<name>-rank<r>.jsonl``; :func:`merge_rank_files` joins them into
one file ordered by ``(step, rank)``. :func:`gather_shards` rebuilds a logical tensor from
its tensor-parallel shards.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginetap.errors import EnginetapError

if TYPE_CHECKING:
    import torch

__all__ = ["agree", "gather_shards", "merge_rank_files", "rank_files", "rank_path", "rank_world",
           "set_group_resolver"]

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


def gather_shards(tensor: torch.Tensor, dim: int, group: Any | None = None,
                  dst: int = 0) -> torch.Tensor | None:
    """Rebuild the logical tensor whose shards the ranks of ``group`` hold, on rank ``dst``.

    Shards are concatenated along ``dim`` in rank order; their lengths along ``dim`` may
    differ (they are exchanged first, shards are padded to the longest, gathered, trimmed).
    Every other dimension must match. Collective: every rank calls it with its shard.

    Args:
        tensor: this rank's shard (any device the group's backend accepts).
        dim: the sharded dimension (negative counts from the end).
        group: process group; default the registered engine group, else the world.
        dst: rank *within the group* that receives the result.

    Returns:
        The full tensor on rank ``dst`` (same device and dtype as ``tensor``), None on the
        other ranks; ``tensor`` itself when no process group is initialized.

    Raises:
        ValueError: ``tensor`` is 0-d or has more than 8 dimensions, ``dst`` is not a rank
            of the group, or the shards' shapes differ outside ``dim`` (every rank raises).
    """
    dist = _dist()
    if dist is None:
        return tensor
    group = group if group is not None else default_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= dst < world:
        raise ValueError(f"gather_shards: dst={dst} is not a rank of a group of {world}")
    if tensor.dim() == 0:
        raise ValueError("gather_shards: a 0-d tensor has no dimension to gather along")
    dim = dim % tensor.dim()
    sizes = _exchange_shapes(dist, tensor, group, world)
    _check_shapes(sizes, dim)
    lengths = [shape[dim] for shape in sizes]
    wire = _to_wire(_pad_along(tensor, dim, max(lengths)).to(_device_for(dist, group)))
    buffers = [wire.new_empty(wire.shape) for _ in range(world)] if rank == dst else None
    root = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather(wire, buffers, dst=root, group=group)
    if buffers is None:
        return None
    import torch

    parts = [_from_wire(b, tensor.dtype).narrow(dim, 0, n) for b, n in zip(buffers, lengths)]
    return torch.cat(parts, dim=dim).to(tensor.device)


_MAX_DIMS = 8


def _exchange_shapes(dist: Any, tensor: torch.Tensor, group: Any, world: int) -> list[list[int]]:
    import torch

    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"gather_shards: {tensor.dim()} dimensions, at most {_MAX_DIMS}")
    # The number of dimensions travels too, so that every rank sees any mismatch alike.
    pad = [0] * (_MAX_DIMS - tensor.dim())
    mine = torch.tensor([tensor.dim(), *tensor.shape, *pad],
                        dtype=torch.int64, device=_device_for(dist, group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [row[1:1 + int(row[0])].tolist() for row in (t.cpu() for t in everyone)]


def _check_shapes(shapes: list[list[int]], dim: int) -> None:
    def outside(shape: list[int]) -> list[int]:
        return shape[:dim] + shape[dim + 1:]

    if any(len(s) != len(shapes[0]) or outside(s) != outside(shapes[0]) for s in shapes):
        raise ValueError(f"gather_shards: shard shapes {shapes} differ outside dim {dim}")


def _pad_along(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    tensor = tensor.contiguous()
    if tensor.shape[dim] == length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return padded


def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """Bool and 1-byte float types travel as uint8 (not every backend reduces/gathers them)."""
    import torch

    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8):
        return tensor.view(torch.uint8)
    return tensor


def _from_wire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch

    if dtype == torch.bool:
        return tensor.to(torch.bool)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def rank_files(path: str | Path) -> dict[int, Path]:
    """The per-rank files of ``path`` by rank (``out/a.jsonl`` → ``{0: out/a-rank0.jsonl}``)."""
    path = Path(path)
    pattern = re.compile(rf"{re.escape(path.stem)}-rank(\d+){re.escape(path.suffix)}")
    found = {}
    for candidate in path.parent.glob(f"{path.stem}-rank*{path.suffix}"):
        match = pattern.fullmatch(candidate.name)
        if match:
            found[int(match.group(1))] = candidate
    return dict(sorted(found.items()))


def merge_rank_files(path: str | Path, out: str | Path | None = None) -> Path:
    """Merge the per-rank JSONL files of ``path`` into one file ordered by ``(step, rank)``.

    Each line is a JSON object with an integer ``step``; within one rank's file steps must
    not decrease (each rank writes its steps in order). Ties keep each file's line order.

    Args:
        path: the un-ranked name, e.g. ``out/steps.jsonl`` for ``out/steps-rank<r>.jsonl``.
        out: where to write; default ``path`` itself.

    Returns:
        The merged file's path (written to a temporary sibling, then renamed).

    Raises:
        EnginetapError: no per-rank file exists, or a line is not a JSON object with an
            integer ``step``, or a rank's steps go backwards.
    """
    path = Path(path)
    files = rank_files(path)
    if not files:
        raise EnginetapError(f"no per-rank files for {path}",
                             f"nothing matches {path.stem}-rank<r>{path.suffix} in {path.parent}",
                             "point at the un-ranked name of files an armed engine wrote")
    target = Path(out) if out is not None else path
    partial = target.with_name(f".{target.name}.partial")
    streams = [_ranked_lines(file, rank) for rank, file in files.items()]
    try:
        with partial.open("w", encoding="utf-8") as sink:
            for _, _, _, line in heapq.merge(*streams):
                sink.write(line if line.endswith("\n") else line + "\n")
        partial.replace(target)  # inside: a refused rename must not leave the partial file
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return target


def _ranked_lines(file: Path, rank: int) -> Iterator[tuple[int, int, int, str]]:
    last = None
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            step = _step_of(line, file, number)
            if last is not None and step < last:
                raise EnginetapError(f"{file}:{number}: step {step} after step {last}",
                                     "a rank's file must list its steps in order",
                                     "write each run to a fresh output directory")
            last = step
            yield step, rank, number, line


def _step_of(line: str, file: Path, number: int) -> int:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EnginetapError(f"{file}:{number} is not JSON", str(exc),
                             "merge only files written by enginetap") from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise EnginetapError(f"{file}:{number} has no integer 'step'",
                             "lines are ordered by (step, rank)",
                             "merge only per-step records")
    return step
