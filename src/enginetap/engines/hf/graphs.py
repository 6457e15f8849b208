"""CUDA-graph decode for the built-in engine (``HFEngine(..., mode="graphs")``).

As production engines decode: the KV cache is static (one ``[rows, kv heads, columns,
head dim]`` tensor per layer, allocated for the largest batch and context seen), and the
decoder stack's decode forward is captured once per batch-size bucket (1, 2, 4, 8, then
multiples of 16) and replayed with its inputs copied into static buffers. A batch of B
requests runs in the smallest bucket >= B; the rows past B are padding, as a real engine
pads them: a pad token at position 0 whose mask lets it see only its own column, output
computed and never read (the tap never records them). The LM head and sampling run
eagerly on the replay's output rows of real requests.

Prefill runs eagerly into the same static cache (one call per batch, its mask made here
as a 4D additive mask, so transformers builds none). A graph is captured on the first
decode step of its bucket, after that step's inputs are loaded: the warm-up run writes
the same KV column the replay then writes again. When the cache must grow (a larger
batch or a longer context than before) it is reallocated and the graphs are captured
again.

Recurrent (linear-attention) models have no static cache here: graphs mode refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from enginetap.errors import ConfigError

__all__ = ["GraphDecoder", "StaticKV", "bucket_of"]

_BUCKETS = (1, 2, 4, 8)


def bucket_of(batch: int) -> int:
    """The captured batch size a batch of ``batch`` rows runs in."""
    for size in _BUCKETS:
        if batch <= size:
            return size
    return -(-batch // 16) * 16


class StaticKV:
    """A static KV cache in transformers' cache interface (``update`` per layer): keys and
    values written at :attr:`columns` (a device tensor; one column in decode) of the
    call's first rows, all ``capacity`` columns of those rows returned for attention
    (the mask hides the rest)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 columns: torch.Tensor) -> None:
        self.keys, self.values, self.columns = keys, values, columns
        self.layers: list[Any] = []  # no transformers layers: no prefix reuse

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = key_states.shape[0]  # the batch's (prefill) or its bucket's (decode)
        keys, values = self.keys[layer_idx][:rows], self.values[layer_idx][:rows]
        keys.index_copy_(2, self.columns, key_states)
        values.index_copy_(2, self.columns, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.columns[-1]) + 1

    def reorder_cache(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (finished requests leave the batch), compacted to the top."""
        n = index.numel()
        for tensor in (*self.keys, *self.values):
            tensor[:n] = tensor.index_select(0, index)


def additive_mask(mask: torch.Tensor, queries: int, width: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, 1, queries, width]``: 0 where a query may attend, the dtype's minimum
    elsewhere. ``mask`` is the engine's ``[rows, columns]`` 0/1 mask; its last ``queries``
    columns are the queries' own, each seeing the columns up to its own."""
    rows, columns = mask.shape
    column = torch.arange(width, device=mask.device)
    own = torch.arange(columns - queries, columns, device=mask.device)
    padded = torch.zeros((rows, width), dtype=torch.bool, device=mask.device)
    padded[:, :columns] = mask.bool()
    allowed = padded[:, None, :] & (column[None, None, :] <= own[None, :, None])
    low = torch.finfo(dtype).min
    made = torch.where(allowed, 0.0, low).to(dtype)[:, None]
    if out is None:
        return made
    out.copy_(made)
    return out


class GraphDecoder:
    """The static cache and the captured decode graphs of one engine's decoder stack.

    ``on_capture(rows)`` is told before a capture (``None`` after it): the tap's graph
    checkpoints read that shape's static row index (:meth:`CompiledTap.capturing`).
    """

    def __init__(self, model: Any, on_capture: Callable[[int | None], None] | None = None
                 ) -> None:
        config = model.config
        if "linear_attention" in (getattr(config, "layer_types", None) or []):
            raise ConfigError("graphs mode cannot run this model", f"{config.model_type} "
                              "has recurrent layers (no static cache for their state here)",
                              "run it with mode='eager' or mode='compile'")
        self.model = model
        self.decoder = model.model
        self.on_capture = on_capture
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.rows = self.width = 0
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)
        """The decode step's cache column (one for every row: prompts are left-padded)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.captures = 0
        """Graphs captured so far (tests, benchmarks)."""

    # -- the cache -------------------------------------------------------------------

    def cache_for(self, rows: int, capacity: int) -> StaticKV:
        """The static cache for a batch of ``rows`` requests and ``capacity`` columns,
        reallocated (graphs captured again) where it is too small."""
        need = bucket_of(rows)
        if need > self.rows or capacity > self.width:
            self._allocate(max(need, self.rows), max(capacity, self.width))
        return self.cache

    def _allocate(self, rows: int, width: int) -> None:
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (rows, heads, width, dim)
        layers = config.num_hidden_layers
        self.graphs.clear()
        self.pool = None
        self.cache = StaticKV([torch.zeros(shape, dtype=self.dtype, device=self.device)
                               for _ in range(layers)],
                              [torch.zeros(shape, dtype=self.dtype, device=self.device)
                               for _ in range(layers)], self.column)
        self.rows, self.width = rows, width
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.mask = torch.zeros((rows, 1, 1, width), dtype=self.dtype, device=self.device)
        self.hidden = torch.zeros((rows, 1, config.hidden_size), dtype=self.dtype,
                                  device=self.device)

    # -- steps -----------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, StaticKV]:
        """The eager prefill into the static cache: last-column logits ``[rows, 1, V]``."""
        width = ids.shape[1]
        self.cache.columns = torch.arange(width, device=self.device)
        attention = additive_mask(mask, width, self.width, self.dtype)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache.columns = self.column
        return out.logits, self.cache

    def load(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             pad_id: int) -> int:
        """Copy a decode step's inputs into the static buffers of its bucket (padding rows
        as described in the module docstring); returns the bucket."""
        batch, columns = mask.shape
        size = bucket_of(batch)
        self.column.fill_(columns - 1)
        self.cache.columns = self.column
        self.ids[:batch].copy_(ids)
        self.ids[batch:size].fill_(pad_id)
        self.positions[:batch].copy_(positions)
        self.positions[batch:size].zero_()
        additive_mask(mask, 1, self.width, self.dtype, self.mask[:batch])
        if size > batch:
            self.mask[batch:size].fill_(torch.finfo(self.dtype).min)
            self.mask[batch:size, :, :, columns - 1] = 0
        return size

    def ready(self, size: int) -> bool:
        """Capture the graph of bucket ``size`` if it is not yet (after :meth:`load`);
        True when it was captured now."""
        if size in self.graphs:
            return False
        if self.on_capture is not None:
            self.on_capture(size)
        try:
            self._capture(size)
        finally:
            if self.on_capture is not None:
                self.on_capture(None)
        return True

    def _forward(self, size: int) -> torch.Tensor:
        out = self.decoder(input_ids=self.ids[:size], attention_mask=self.mask[:size],
                           position_ids=self.positions[:size], past_key_values=self.cache,
                           use_cache=True)
        return out.last_hidden_state

    def _capture(self, size: int) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(size)  # warm-up: the same writes the replay makes
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[:size].copy_(self._forward(size))
        except RuntimeError as exc:
            raise ConfigError("graphs mode cannot capture this model's decode step",
                              str(exc).splitlines()[0],
                              "run it with mode='eager' or mode='compile'") from exc
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph
        self.captures += 1

    def decode(self, size: int, batch: int) -> tuple[torch.Tensor, StaticKV]:
        """Replay bucket ``size`` (loaded and ready); the real rows' logits
        ``[batch, 1, V]`` from the LM head, run eagerly."""
        self.graphs[size].replay()
        head = self.model.get_output_embeddings()
        return head(self.hidden[:batch]), self.cache
