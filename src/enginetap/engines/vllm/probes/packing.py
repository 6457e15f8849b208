"""Reading vLLM CPU's ISA-packed tensors back in their plain layout.

vLLM CPU stores its KV cache and its MoE weights packed for the kernel of the machine's ISA
(AMX tiles, VNNI pairs, AVX-512 or AVX2 vectors), and the packing differs between Intel
AMX and AMD machines. Rather than re-implementing each packing (and drifting from it),
the adapters *learn* it once per shape from the engine's own packing op: pack a tensor
whose elements encode their own index (in base-256 digits, exact in bfloat16), read the
packed result back, and obtain the permutation. A packing that is not a permutation (it
moved, dropped or changed values) raises, which disables the probe by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

__all__ = ["kv_unpacker", "moe_weight_unpacker", "learn_permutation", "unpack"]


def learn_permutation(shape: tuple[int, ...], pack: Callable[[torch.Tensor], torch.Tensor],
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``perm`` with ``packed.flatten()[p] == plain.flatten()[perm[p]]`` for ``pack``.

    Raises:
        ValueError: ``pack`` is not a permutation of its input's elements.
    """
    count = 1
    for size in shape:
        count *= size
    index = torch.arange(count, dtype=torch.long)
    perm = torch.zeros(count, dtype=torch.long)
    rest, weight = index.clone(), 1
    while True:
        digits = (rest % 256).to(dtype).reshape(shape)
        packed = pack(digits).reshape(-1)
        if packed.numel() != count:
            raise ValueError(f"packing {shape} gave {packed.numel()} elements, not {count}")
        perm += packed.to(torch.long) * weight
        rest, weight = rest // 256, weight * 256
        if weight >= count:
            break
    if not torch.equal(perm.sort().values, index):
        raise ValueError(f"the engine's packing of {shape} is not a permutation of elements")
    return perm


def unpack(packed: torch.Tensor, perm: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Plain ``[n, *shape]`` from ``n`` packed items (``packed`` is ``[n, ...]``)."""
    flat = packed.reshape(packed.shape[0], -1)
    plain = torch.empty_like(flat)
    plain[:, perm] = flat
    return plain.reshape(packed.shape[0], *shape)


@lru_cache(maxsize=64)
def kv_unpacker(isa: str, heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                which: str) -> torch.Tensor:
    """Permutation of one packed cache block (``[heads, block_size, head_dim]`` view of
    the key or value half) from the NHD block ``[block_size, heads, head_dim]``."""
    from vllm import _custom_ops as ops

    def pack(tokens: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(1, heads, 2 * block_size, head_dim, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(tokens, tokens.clone(), key_cache, value_cache,
                                       torch.arange(block_size, dtype=torch.long), isa)
        return (key_cache if which == "key" else value_cache).reshape(-1)

    return learn_permutation((block_size, heads, head_dim), pack, dtype)


@lru_cache(maxsize=16)
def moe_weight_unpacker(isa: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Permutation of one expert's prepacked weight (``[rows, cols]`` plain)."""
    from vllm import _custom_ops as ops

    return learn_permutation((1, rows, cols), lambda w: ops.cpu_prepack_moe_weight(w, isa),
                             dtype)
