"""Kernel-level tap points of the built-in engine (:meth:`HFHooks.tap_points`): read from
transformers' dense caches around the attention and gated-delta modules that own them.

- ``Lk.attn.kv_written``: the key and value of each tapped row, read back from the cache
  (``past_key_values``) after the layer wrote them; ``Lk.attn.kv_prev``: the cache column
  of the row's previous position, re-read at this step (it must equal that position's
  ``kv_written``);
- ``Lk.gdn.state_before`` / ``state_after`` (and ``conv_before`` / ``conv_after``): the
  recurrent and convolution state (``cache_params``) of each tapped row's request around
  the step.

The points ride on the sublayer wrapper of their module's class
(:func:`~enginetap.tap.record.points.sublayer_wrapper` with ``around=``), so they are recorded
right after the module's output, in execution order. The cache rows a step reads are the
same for every layer: their flat indices are built once per step on the host and sent in
one copy; each layer then costs two gathers and one concatenation. Where every token row
is tapped in a decode step (up to ``max_rows`` requests, one column each) and the device
defers, no torch op runs per layer: each point is the cache column as it lies, hashed in
place at step end by the step's one table kernel with the other deferred checkpoints
(:meth:`~enginetap.tap.record.checkpointer.Checkpointer.keep_cache`; gathered too in
verification steps). A prefill whose every row is tapped keeps the concatenated rows as
the points' tensors; otherwise they are concatenated into staging slots.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from enginetap.core.scope import SCOPE, sublayer_targets
from enginetap.engines.hf.targets import SUBLAYERS
from enginetap.tap.record import TapRecorder, kernels
from enginetap.tap.record.deferred import CacheColumns, DeferredHashes, cache_layout
from enginetap.tap.record.points import sublayer_wrapper

__all__ = ["CachePoints", "tap_points"]

Factory = Callable[[TapRecorder, Any], Callable[..., Any]]


def tap_points(model: Any) -> list[tuple[str, Factory]]:
    """The sublayer targets of ``model``'s attention and gated-delta classes, each with a
    sublayer wrapper that also reads the caches around the module's forward."""
    sublayers = set(sublayer_targets(model, SUBLAYERS))
    targets = set()
    for module in model.modules():
        short = SCOPE.short(module)
        if short is not None and short.rpartition(".")[2] in ("attn", "gdn"):
            cls = type(module)
            targets.add(f"{cls.__module__}:{cls.__qualname__}.forward")
    return [(target, _factory) for target in sorted(targets & sublayers)]


def _factory(recorder: TapRecorder, names: Any) -> Callable[..., Any]:
    around = CachePoints(recorder) if recorder.options.continuity else None
    return sublayer_wrapper(recorder, names, around=around)


class CachePoints:
    """Reads a module's cache rows before and after its forward, for one recorder.

    Runs once per attention (gated-delta) layer per step, so what does not change between
    calls is looked up once: a module's point names and cache layer index (on first
    sight), the step's cache-row indices (on the step's first layer)."""

    def __init__(self, recorder: TapRecorder) -> None:
        self.recorder = recorder
        self._points: dict[str, _Points] = {}
        self._step: Any = None
        self._index: dict[tuple[Any, ...], torch.Tensor] = {}
        self._deferring: dict[torch.device, bool] = {}
        self._settled: _Settled | None = None
        """The step's settled KV path (:meth:`_kv_settled`), made at its first layer."""

    def before(self, name: str, kind: str, module: Any, hidden: Any, kwargs: dict) -> None:
        if kind == "gdn":
            self._states(self._of(name, module), hidden, kwargs, before=True)

    def after(self, name: str, kind: str, module: Any, hidden: Any, kwargs: dict) -> None:
        if kind == "attn":
            self._kv(self._of(name, module), hidden, kwargs)
        elif kind == "gdn":
            self._states(self._of(name, module), hidden, kwargs, before=False)

    def _of(self, name: str, module: Any) -> _Points:
        found = self._points.get(name)
        if found is None or found.module is not module:
            found = self._points[name] = _Points(name, module)
        return found

    def _defers(self, tensor: torch.Tensor) -> bool:
        """Whether the recorder keeps ``tensor``'s device's checkpoints to hash in place
        at step end (Triton there, deferral on, no vector dumps)."""
        found = self._deferring.get(tensor.device)
        if found is None:
            options = self.recorder.options
            found = self._deferring[tensor.device] = bool(
                options.defer and options.vectors == "off" and kernels.available(tensor))
        return found

    def _cached(self, key: tuple[Any, ...], make: Callable[[], list[int]],
                device: torch.device) -> torch.Tensor:
        """An index tensor on ``device`` built once per step and ``key``."""
        if self._step is not self.recorder.step:
            self._step, self._index = self.recorder.step, {}
        found = self._index.get(key)
        if found is None:
            found = torch.tensor(make(), dtype=torch.int64).to(device, non_blocking=True)
            self._index[key] = found
        return found

    def _kv(self, points: _Points, hidden: Any, kwargs: dict) -> None:
        recorder = self.recorder
        settled = self._settled
        if settled is not None and settled.step is recorder.step \
                and self._kv_settled(settled, points, kwargs):
            return
        layer = _cache_layer(kwargs.get("past_key_values"), points.layer_idx, hidden, recorder)
        if layer is None:
            return
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) \
                or keys.dim() != 4 or values.shape != keys.shape \
                or keys.shape[0] != hidden.shape[0]:
            return
        columns = hidden.shape[1]
        rows = len(recorder.token_index)
        whole = rows == recorder.padded and self._defers(keys)
        if whole and columns == 1 and cache_layout(keys, values):
            self._kv_in_place(points, keys, values, rows)
            if settled is None or settled.step is not recorder.step:
                self._settle(kwargs.get("past_key_values"), points, keys, rows)
            return
        k, v = self._gather(keys, values, range(rows) if whole else recorder.token_index,
                            columns, whole)
        if whole:
            # Every token row is tapped, not as cache columns (a prefill's rows, a cache
            # of another layout): the gathered rows, in token order, are the points'
            # tensors, kept and hashed at step end with the step's other deferred
            # checkpoints (no staging slot); a quick step lists them in order, as the
            # sublayer wrappers do.
            both, quick = torch.cat([k, v], 2), recorder.quick
            for i, point in enumerate(points.kv):
                if quick is not None and point not in recorder.at_call:
                    quick.append((point, both[i]))
                else:
                    recorder.take(point, both[i])
            return
        width, dtype = 2 * keys.shape[1] * keys.shape[3], keys.dtype
        for i, point in enumerate(points.kv):
            slot = recorder.row_slot(point, dtype, width, keys.device)
            if slot is not None:
                torch.cat([k[i], v[i]], 1, out=slot)

    def _kv_in_place(self, points: _Points, keys: torch.Tensor, values: torch.Tensor,
                     rows: int) -> None:
        """A decode step whose every token row is tapped (row ``i`` is batch row ``i``)
        on a deferring device: each point is the cache pair's column kept as it lies, to
        hash in place at step end (no torch call); the rows are gathered into a staging
        slot only where the checkpointer asks (verification, a demoted name, the byte
        budget spent)."""
        recorder = self.recorder
        length = keys.shape[2]
        # written: the last column; previous: the one before it
        fill = recorder.checkpointer.keep_cache(recorder.ledger, points.kv, keys, values,
                                                (length - 1, max(length - 2, 0)))
        if fill:
            k, v = self._gather(keys, values, range(rows), 1, True)
            for i, slot in fill:
                torch.cat([k[i], v[i]], 1, out=slot)

    def _settle(self, cache: Any, points: _Points, keys: torch.Tensor, rows: int) -> None:
        """After a layer's columns were kept in place: the step's later layers whose cache
        pair has this one's shape, dtype and strides take :meth:`_kv_settled`, where the
        device defers, the points are recorded (not refused under tracing or capture)
        and this step verifies nothing in full (else none do)."""
        recorder = self.recorder
        checkpointer = recorder.checkpointer
        deferred = checkpointer.fast.get(keys.get_device())
        self._settled = None if deferred is None or deferred.full or cache is None \
            or not checkpointer.allowed(points.kv[0]) else _Settled(
                recorder.step, weakref.ref(cache), keys.shape, keys.dtype,
                CacheColumns.of(keys, rows), deferred, keys.device)

    def _kv_settled(self, settled: _Settled, points: _Points, kwargs: dict) -> bool:
        """:meth:`_kv_in_place` for a layer of a step whose first kept layer made
        ``settled``, with the checks it shares with that layer made once: the same cache,
        a pair of the same layout on the same device, both names settled (verified as
        often as asked, not demoted, not yet seen this step) and the budget not spent.
        False (nothing done) where any of that fails: the caller takes the checked path."""
        cache = kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        index = points.layer_idx
        if cache is None or settled.cache() is not cache or index is None \
                or layers is None or index >= len(layers):
            return False
        layer = layers[index]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return False
        shape, stride, dtype = settled.shape, settled.layout.stride, settled.dtype
        if keys.shape != shape or values.shape != shape or keys.stride() != stride \
                or values.stride() != stride or keys.dtype != dtype or values.dtype != dtype \
                or keys.device != settled.device or values.device != settled.device \
                or (keys.data_ptr() | values.data_ptr()) % 4:
            return False
        written, previous = names = points.kv
        deferred, ledger = settled.deferred, self.recorder.ledger
        counts = ledger.counts
        if written in counts or previous in counts or not deferred.settled(written) \
                or not deferred.settled(previous) or written in deferred.demoted \
                or previous in deferred.demoted:
            return False
        slots = deferred.keep_settled_columns(names, keys, values, settled.layout, shape[2])
        if slots is None:
            return False
        counts[written] = counts[previous] = 1
        ledger.record(settled.device, written, -1 - slots[0])
        ledger.record(settled.device, previous, -1 - slots[1])
        return True

    def _gather(self, keys: torch.Tensor, values: torch.Tensor, tokens: Sequence[int],
                columns: int, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value heads of the rows ``tokens`` at their written and previous
        columns: ``[2, rows, heads * dim]`` each, one gather each (the flat row indices
        built once per step)."""
        _, heads, length, dim = keys.shape
        device, rows = keys.device, len(tokens)
        index = self._cached(("kv", whole, heads, length, columns, device),
                             lambda: _kv_rows(tokens, heads, length, columns), device)
        return (keys.reshape(-1, dim).index_select(0, index).view(2, rows, heads * dim),
                values.reshape(-1, dim).index_select(0, index).view(2, rows, heads * dim))

    def _states(self, points: _Points, hidden: Any, kwargs: dict, before: bool) -> None:
        recorder = self.recorder
        layer = _cache_layer(kwargs.get("cache_params"), points.layer_idx, hidden, recorder)
        if layer is None:
            return
        columns = hidden.shape[1]
        names = points.before if before else points.after
        for point, states in zip(names, ("recurrent_states", "conv_states")):
            state = (getattr(layer, states, None) or {}).get(0)
            if not isinstance(state, torch.Tensor) or state.shape[0] != hidden.shape[0]:
                continue
            # one state per request, however many of its rows are tapped (a prefill's)
            batch = self._cached(("requests", columns, state.device), lambda: [
                t // columns for t in recorder.request_token_index], state.device)
            slot = recorder.request_slot(point, state.dtype, state[0].numel(), state.device)
            if slot is not None:
                torch.index_select(state.reshape(state.shape[0], -1), 0, batch, out=slot)


class _Settled(NamedTuple):
    """What a step's later layers share with its first layer kept in place
    (:meth:`CachePoints._settle`)."""

    step: Any
    cache: Callable[[], Any]
    shape: torch.Size
    dtype: torch.dtype
    layout: CacheColumns
    deferred: DeferredHashes
    device: torch.device


class _Points:
    """One module's point names and cache layer index, made on its first call."""

    __slots__ = ("module", "layer_idx", "kv", "before", "after")

    def __init__(self, name: str, module: Any) -> None:
        self.module = module
        self.layer_idx = getattr(module, "layer_idx", None)
        self.kv = (f"{name}.kv_written", f"{name}.kv_prev")
        self.before = (f"{name}.state_before", f"{name}.conv_before")
        self.after = (f"{name}.state_after", f"{name}.conv_after")


def _cache_layer(cache: Any, layer_idx: int | None, hidden: Any, recorder: TapRecorder) -> Any:
    """Layer ``layer_idx`` of ``cache``, or None (no cache, no tapped row, an input that
    is not ``[batch, columns, ...]``)."""
    if cache is None or not recorder.live:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx is None or not isinstance(hidden, torch.Tensor) \
            or hidden.dim() < 3 or layer_idx >= len(layers):
        return None
    return layers[layer_idx]


def _kv_rows(token_index: Iterable[int], heads: int, length: int, columns: int) -> list[int]:
    """Flat ``[batch * heads * length]`` row indices of a ``[batch, heads, length, dim]``
    cache: every head of each tapped row's written column, then of its previous column."""
    written, previous = [], []
    for token in token_index:
        batch, column = divmod(token, columns)
        col = length - columns + column
        base = batch * heads * length
        written += [base + h * length + col for h in range(heads)]
        previous += [base + h * length + max(col - 1, 0) for h in range(heads)]
    return written + previous
