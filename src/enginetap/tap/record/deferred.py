"""Deferred checkpoints: hashed at step end, in place, by one kernel for the whole step.

The staged path (:class:`~enginetap.tap.record.staging.StepStaging`) costs one gather launch
per checkpoint. On a GPU a decode step has hundreds of checkpoints, and those launches (and
the host time around them) are most of what a tap costs. A deferred checkpoint instead
keeps a reference to the tensor and its version counter; at step end one Triton kernel
reads the tapped rows of every deferred tensor through a table of base pointers
(:func:`enginetap.tap.record.kernels.hash_table_rows`). The hash is the same function of the
same bytes, so records do not say which path made them.

That is only right if the bytes are still those the checkpoint saw. These rules make
sure they are, or that nothing is recorded:

- **Verified before trusted.** The first ``verify`` times a checkpoint name is seen in a
  step of a kind (prefill, decode, mixed), and in every ``verify_every``-th step (plus
  ``lag`` more times each, where the flags reach the host a step later), it is
  staged as before *and* deferred; the record carries the staged hash, and the two are
  compared when the step's hashes reach the host. A difference means something writes
  that tensor later in the step (an in-place kernel, e.g. vLLM's fused add+norm on its
  residual): the name is demoted to the staged path for good, and logged once. Engines
  write in place by code path, so a write seen once is seen at the first step of its kind.
- **Version counters.** A deferred tensor that tracks versions and whose counter moved
  since its checkpoint (an in-place torch op on it or on any view of its storage) is
  dropped from that step's record (listed under ``"dropped"``), and its name is demoted.
  Tensors made under ``torch.inference_mode`` (the engines' forwards) track no version:
  for them verification is the guard.
- **A byte budget.** Kept tensors stay alive until step end; once the tensors kept this
  step would exceed ``budget`` bytes (a long prefill), further checkpoints are staged.

What deferral cannot see: a write after a checkpoint, into an inference tensor, that only
some steps of a kind make, between two verification steps. ``defer=False`` (options.tap)
rules that out at the gather path's cost.

Deferral needs Triton on the tensor's device (CUDA; Triton's interpreter on a CPU in the
tests) and rows of 32-bit words at a 4-byte aligned address; anything else is staged.

A checkpoint's row may also be read in pieces: a KV cache column (:meth:`DeferredHashes.
keep_cache`, the built-in engine's decode steps) is every head's key then every head's
value, read from the cache tensors where they lie, with no gather or concatenation per
layer. The cache tensors are referenced until step end like any kept tensor and verified
like one (a write into the cache after the layer and before step end is caught in
verification steps; in others it is in the bytes hashed); the byte budget counts the
bytes hashed, not the caches' size.
"""

from __future__ import annotations

import logging
import operator
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

logger = logging.getLogger("enginetap.tap")

__all__ = ["DeferredHashes", "cache_layout"]


def cache_layout(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether a ``[batch, heads, length, dim]`` key and value cache pair can be kept as
    it is (:meth:`DeferredHashes.keep_cache`): the same shape, dtype and strides, each
    head's ``dim`` contiguous, every stride and ``dim`` whole 32-bit words, 4-byte
    aligned."""
    stride = keys.stride()
    if len(stride) != 4 or stride[3] != 1 or values.stride() != stride \
            or values.shape != keys.shape or values.dtype != keys.dtype:
        return False
    # x * size is a multiple of 4 for each x exactly when it is for their bitwise or
    return not ((stride[0] | stride[1] | stride[2] | keys.shape[3]) * keys.element_size() % 4
                or (keys.data_ptr() | values.data_ptr()) % 4)


class CacheColumns(NamedTuple):
    """A ``[batch, heads, length, dim]`` key and value cache pair's layout as
    :meth:`DeferredHashes.keep_cache` keeps its columns (``rows`` batch rows): the
    strides (elements), one column's offset (bytes), the row stride, head width and
    head stride (32-bit words), the heads, and the bytes a column's rows hold."""

    stride: tuple[int, ...]
    at: int
    row: int
    width: int
    apart: int
    heads: int
    nbytes: int

    @staticmethod
    def of(keys: torch.Tensor, rows: int) -> CacheColumns:
        _, heads, _, dim = keys.shape
        size, stride = keys.element_size(), keys.stride()
        return CacheColumns(stride, stride[2] * size, stride[0] * size // 4, dim * size // 4,
                            stride[1] * size // 4, heads, rows * 2 * heads * dim * size)


@dataclass
class DeferredHashes:
    """One device's deferred checkpoints of the current step, and what was learned about
    each checkpoint name across steps (verification count, demotions)."""

    device: torch.device
    budget: int
    verify: int = 2
    verify_every: int = 50
    lag: int = 0
    """Steps between a verification and its flags reaching the engine's thread (1 where
    the step's hashes are copied without waiting, on a GPU): that many more steps are
    verified after each verification, so that a name whose check failed is demoted
    before any unverified step relies on its deferred hash."""
    mode: str = ""
    full: bool = False
    """This step verifies every deferred checkpoint (every ``verify_every``-th step)."""
    tensors: list[torch.Tensor] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    strides: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    """Per kept tensor: address, row stride and row width in 32-bit words (the hash
    kernel's table, taken when the tensor is kept; flat lists: one buffer copy makes the
    table). A KV cache column (:meth:`keep_cache`) has the width of one head here."""
    pieces: dict[int, tuple[int, int, int, torch.Tensor, int | None]] = field(
        default_factory=dict)
    """Slots kept as a KV cache column (:meth:`keep_cache`): their heads, the heads'
    stride in words, the values' address, the values tensor and its version counter (the
    keys are the slot's tensor). Other slots are one segment with no second piece."""
    counted_values: bool = False
    """Some cache column's values track a version counter (see :meth:`moved`)."""
    checks: list[tuple[str, int, int]] = field(default_factory=list)
    """(name, staged slot, deferred slot) of the checkpoints verified this step."""
    held: int = 0
    spent: bool = False
    """The last :meth:`keep` or :meth:`accepts` refused only for the byte budget."""
    hashed_bytes: int = 0
    """Bytes of tapped rows the last :meth:`hashes` read."""
    verified: dict[tuple[str, str], int] = field(default_factory=dict)
    demoted: dict[str, str] = field(default_factory=dict)
    """Checkpoint name → why it is staged from now on."""
    seen_version: dict[str, int] = field(default_factory=dict)
    """Checkpoint name → the version counter its tensor had when last kept (tensors that
    track versions): a checkpoint examined only at step end (the recorder's quick steps)
    must show the same count, else something wrote it after its checkpoint."""

    def reset(self, mode: str = "", step: int = 1) -> None:
        """Start step number ``step`` of kind ``mode``."""
        self.tensors, self.versions, self.names, self.checks = [], [], [], []
        self.addresses, self.strides, self.widths, self.pieces = [], [], [], {}
        self.counted_values = False
        self.mode = mode
        self.full = self.verify_every > 0 and step % self.verify_every <= self.lag
        self.held = self.hashed_bytes = 0

    def accepts(self, name: str, source: torch.Tensor) -> bool:
        """Whether ``source`` (``[rows, width]``, last dim contiguous) can be deferred."""
        self.spent = False
        if name in self.demoted:
            return False
        nbytes = source.shape[1] * source.element_size()
        if nbytes % 4 or source.data_ptr() % 4 or source.stride(0) * source.element_size() % 4:
            return False
        size = source.shape[0] * source.stride(0) * source.element_size()
        if self.held + size > self.budget:
            self.spent = True
            return False
        self.held += size
        return True

    def needs_check(self, name: str) -> bool:
        """True the first ``verify`` times ``name`` is deferred in a step of this kind, and
        in full verification steps (it is then staged too)."""
        if self.full:
            return True
        key = (self.mode, name)
        seen = self.verified.get(key, 0)
        if seen >= self.verify + self.lag:
            return False
        self.verified[key] = seen + 1
        return True

    def settled(self, name: str) -> bool:
        """Whether ``name`` needs no verification in this step (read-only: unlike
        :meth:`needs_check`, it counts nothing)."""
        return not self.full and self.verified.get((self.mode, name), 0) >= self.verify + self.lag

    def add(self, name: str, source: torch.Tensor) -> int:
        """Keep ``source`` (accepted by :meth:`accepts`) to hash at step end; its slot
        among this step's deferred."""
        size = source.element_size()
        return self._append(name, source, source.data_ptr(), source.stride(0) * size // 4,
                            source.shape[1] * size // 4)

    def keep(self, name: str, tensor: torch.Tensor, words: int, nbytes: int) -> int:
        """:meth:`accepts` and :meth:`add` in one call for a contiguous ``tensor`` of
        ``nbytes`` whose token rows are ``words`` 32-bit words each, at a 4-byte aligned
        address (the caller checked): its slot, or -1 if it must be staged instead. The
        checkpoint's fast path: no view of the tensor is made (a view is a tensor object,
        microseconds per checkpoint)."""
        if name in self.demoted or self.held + nbytes > self.budget:
            self.spent = name not in self.demoted
            return -1
        self.spent = False
        self.held += nbytes
        return self._append(name, tensor, tensor.data_ptr(), words, words)

    def keep_listed(self, names: list[str], tensors: list[torch.Tensor], addresses: list[int],
                    words: list[int], nbytes: int) -> int:
        """:meth:`keep` for many contiguous inference tensors at once (a quick step's
        planned checkpoints, see :class:`~enginetap.tap.record.quick.QuickPlan`; the caller
        checked their layout, that no name is demoted and that ``nbytes`` fits the
        budget): the slot of the first."""
        first = len(self.tensors)
        self.held += nbytes
        self.addresses += addresses
        self.strides += words
        self.widths += words
        self.tensors += tensors
        self.versions += [None] * len(tensors)
        self.names += names
        return first

    def keep_cache(self, names: list[str], keys: torch.Tensor, values: torch.Tensor,
                   columns: tuple[int, ...], rows: int) -> list[int]:
        """Keep, under each of ``names``, its column (``columns``) of batch rows
        ``0..rows-1`` of a ``[batch, heads, length, dim]`` key and value cache pair (the same
        layout, checked by the caller with :func:`cache_layout`) to hash in place at step
        end, with no copy: row ``i``'s words are every head's key at that column, then
        every head's value, as the gathered ``[k heads..., v heads...]`` row. Each name's
        slot, or -1 where it must be gathered instead (demoted, or over the byte budget:
        the bytes hashed count, the caches live on). One call for a layer's points: what
        they share is read once."""
        layout = CacheColumns.of(keys, rows)
        vversion = self._values_version(values)
        slots = []
        for name, column in zip(names, columns):
            if name in self.demoted or self.held + layout.nbytes > self.budget:
                self.spent = name not in self.demoted
                slots.append(-1)
                continue
            self.spent = False
            self.held += layout.nbytes
            slots.append(self._keep_column(name, keys, values, vversion, layout, column))
        return slots

    def keep_settled_columns(self, names: tuple[str, str], keys: torch.Tensor,
                             values: torch.Tensor, layout: CacheColumns, length: int
                             ) -> tuple[int, int] | None:
        """:meth:`keep_cache` of a layer's written (``length - 1``) and previous column
        where nothing about them needs a decision this step: ``layout`` is the step's
        first cache pair's, which ``keys`` and ``values`` share; neither name is demoted
        or due for verification (the caller checked both with :meth:`settled`). The
        slots, or None where the budget is spent (nothing kept: the caller takes
        :meth:`keep_cache`'s path)."""
        if self.held + 2 * layout.nbytes > self.budget:
            return None
        self.spent = False
        self.held += 2 * layout.nbytes
        vversion = self._values_version(values)
        return (self._keep_column(names[0], keys, values, vversion, layout, length - 1),
                self._keep_column(names[1], keys, values, vversion, layout,
                                  max(length - 2, 0)))

    def _values_version(self, values: torch.Tensor) -> int | None:
        """A cache pair's values' version counter (None for inference tensors), noted in
        :attr:`counted_values`."""
        version = None if values.is_inference() else values._version
        if version is not None:
            self.counted_values = True
        return version

    def _keep_column(self, name: str, keys: torch.Tensor, values: torch.Tensor,
                     vversion: int | None, layout: CacheColumns, column: int) -> int:
        """Keep ``name`` as column ``column`` of the cache pair (budget and demotion
        decided by the caller): its slot, with the values as its second piece."""
        offset = column * layout.at
        slot = self._append(name, keys, keys.data_ptr() + offset, layout.row, layout.width)
        self.pieces[slot] = (layout.heads, layout.apart, values.data_ptr() + offset, values,
                             vversion)
        return slot

    def _append(self, name: str, tensor: torch.Tensor, address: int, stride: int,
                width: int) -> int:
        self.addresses.append(address)
        self.strides.append(stride)
        self.widths.append(width)
        self.tensors.append(tensor)
        version = None if tensor.is_inference() else tensor._version
        if version is not None:
            self.seen_version[name] = version
        self.versions.append(version)
        self.names.append(name)
        return len(self.tensors) - 1

    def moved(self) -> list[int]:
        """Slots whose tensor was modified in place since its checkpoint (demoted)."""
        versions = self.versions
        if versions.count(None) == len(versions) and not self.counted_values:
            return []  # inference tensors (the engines' forwards): no counter to compare
        moved = [i for i, (t, v) in enumerate(zip(self.tensors, versions))
                 if v is not None and t._version != v]
        if self.counted_values:  # a cache column's values: their own version counter
            moved = sorted({*moved, *(i for i, (_, _, _, values, v) in self.pieces.items()
                                      if v is not None and values._version != v)})
        for i in moved:
            self.demote_moved(self.names[i])
        return moved

    def demote_moved(self, name: str) -> None:
        """Stage ``name`` from now on: its tensor's version counter moved after its
        checkpoint."""
        self._demote(name, "modified in place after its checkpoint, before the step ended "
                           "(its version counter moved)")

    def arrange(self, order: list[int]) -> None:
        """Put the kept tensors in ``order`` (a permutation of their slots): slot ``i``
        becomes the one that was ``order[i]``, so that :meth:`hashes` returns them in that
        order. No-op where ``order`` is already theirs (the usual case)."""
        if len(order) < 2 or order == list(range(len(order))):
            return
        pick = operator.itemgetter(*order)
        self.tensors, self.versions, self.names = (
            list(pick(self.tensors)), list(pick(self.versions)), list(pick(self.names)))
        self.addresses, self.strides, self.widths = (
            list(pick(self.addresses)), list(pick(self.strides)), list(pick(self.widths)))
        if self.pieces:
            position = dict(zip(order, range(len(order))))
            self.pieces = {position[slot]: piece for slot, piece in self.pieces.items()}

    def hashes(self, index: torch.Tensor) -> torch.Tensor:
        """``[deferred, rows]`` int64 hashes of rows ``index`` of every kept tensor, one
        launch; the references are dropped (the kernel is queued after the step's work on
        the same stream, so the caching allocator cannot hand their memory out before)."""
        from enginetap.tap.record import kernels

        if not self.tensors:
            return torch.zeros((0, index.numel()), dtype=torch.int64, device=self.device)
        widths, n = self.widths, len(self.widths)
        words = sum(widths)
        segments, segment_strides, seconds = [1] * n, [0] * n, [0] * n
        for slot, (heads, apart, second, _, _) in self.pieces.items():
            segments[slot], segment_strides[slot], seconds[slot] = heads, apart, second
            words += (2 * heads - 1) * widths[slot]
        widest = max(1, max(w * c for w, c in zip(widths, segments)) if self.pieces
                     else max(widths))
        self.hashed_bytes += words * 4 * index.numel()
        table = torch.frombuffer(array("q", self.addresses + self.strides + widths + segments
                                       + segment_strides + seconds),
                                 dtype=torch.int64).view(6, n)
        out = kernels.hash_table_rows(table.to(self.device, non_blocking=True), index, widest)
        self.tensors, self.addresses, self.strides, self.widths = [], [], [], []
        self.pieces = {}
        return out

    def compare_flags(self, equal: torch.Tensor, names: list[str] | None = None) -> None:
        """A step's verifications as host flags (1: the deferred hash of every tapped row
        equals the staged one), in the order of that step's checks: ``names``, or this
        step's :attr:`checks` (flags read in the step that made them); a 0 demotes the
        name. Flags read a step late must come with their own step's names: by then
        :attr:`checks` holds the next step's, which differ once a name was demoted."""
        if names is None:
            names = [name for name, _, _ in self.checks]
        for name, same in zip(names, equal.tolist(), strict=True):
            if not same:
                self._demote(name, "its bytes at step end differ from those at its "
                                   "checkpoint (something writes the tensor later in the "
                                   "step)")

    def _demote(self, name: str, why: str) -> None:
        if name not in self.demoted:
            self.demoted[name] = why
            logger.info("tap: %s is hashed at its checkpoint from now on: %s", name, why)
