"""Prefix reuse: a small LRU of recent prompts' key/value tensors.

Only plain attention caches can be reused: each layer keeps keys and values per position,
so the first ``n`` positions of a stored prompt are exactly the cache of its ``n``-token
prefix. Recurrent layers (Qwen3-Next's gated delta net) keep one state that has already
folded in every token; it cannot be cut back to a shorter prefix, so models with such
layers (and DeepSeek-V3.2, whose indexer keeps its own key cache) never reuse.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["LayerKV", "PrefixCache"]

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each ``[heads, tokens, head_dim]`` for one prompt."""


class PrefixCache:
    """Maps recent prompts (token ids) to their per-layer keys and values."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], LayerKV] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, prompt: list[int], kv: LayerKV) -> None:
        key = tuple(prompt)
        self._entries[key] = kv
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, prompt: list[int]) -> tuple[int, LayerKV | None]:
        """Longest reusable prefix of ``prompt`` and the cache it comes from.

        At most ``len(prompt) - 1`` tokens are reused: the last prompt token must be
        computed to give the logits of the first new token.
        """
        best, best_kv, best_key = 0, None, None
        for key, kv in self._entries.items():
            shared = _shared_length(key, prompt, len(prompt) - 1)
            if shared > best:
                best, best_kv, best_key = shared, kv, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best, best_kv

    def clear(self) -> None:
        self._entries.clear()


def _shared_length(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b[:limit]):
        if x != y:
            break
        n += 1
    return n
