"""Checkpoints: where the tapped rows of each checkpoint go during a step.

A checkpoint (:meth:`Checkpointer.take`) is kept for the step-end hash in place
(deferred, :mod:`enginetap.tap.record.deferred`) where the device allows, else its
tapped rows are gathered into the step's staging buffer
(:class:`~enginetap.tap.record.staging.StepStaging`); engines' kernel-level points fill a
staging slot themselves (:meth:`Checkpointer.row_slot`) or hand rows over
(:meth:`Checkpointer.checkpoint_rows`). Every checkpoint is added to the step's ordered
list of names and slots (:meth:`Checkpointer._record`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from enginetap.core.rowsplit import join_rows
from enginetap.tap.record.fingerprint import token_rows
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.staging import StepStaging

logger = logging.getLogger("enginetap.tap")

__all__ = ["Checkpointer", "outputs_of"]


class Checkpointer:
    """Checkpoint routing of the recorder (a mixin of :class:`~.recorder.TapRecorder`)."""

    def _record(self, device: torch.device, unique: str, slot: int) -> None:
        """Add checkpoint ``unique`` (its staging or deferred ``slot``) to the step, in
        order: in a quick step, among the checkpoints listed for later."""
        if self.quick is not None:
            self.quick.append((None, (device, unique, slot)))
        else:
            self.names.append((device, unique))
            self.slots.append(slot)

    def index(self, device: torch.device) -> torch.Tensor:
        """The tapped rows' token indices on ``device`` (built once per step)."""
        return self._device_list("rows", device)

    def request_index(self, device: torch.device) -> torch.Tensor:
        """Token index of each tapped request's last tapped row (one per request)."""
        return self._device_list("requests", device)

    def _device_list(self, what: str, device: torch.device) -> torch.Tensor:
        if self._pending is not None:
            self._prepare()
        found = self._index.get((what, device))
        if found is None:
            values = {"rows": self.token_index, "requests": self.request_token_index,
                      "inverse": self.request_of_row}[what]
            found = torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
            self._index[(what, device)] = found
        return found

    def allowed(self, name: str) -> bool:
        """False (and noted once) inside compile tracing or graph capture unless forced."""
        if self._forced or not (torch.compiler.is_compiling()
                                or (self._cuda and torch.cuda.is_current_stream_capturing())):
            return True
        if name not in self.refused:
            self.refused.add(name)
            logger.warning("tap: %s not recorded under torch.compile / CUDA-graph capture "
                           "(hooks would be traced into the graph; set options.tap.force)",
                           name)
        return False

    def take(self, name: str, tensor: Any) -> None:
        """Stage the tapped rows of ``tensor`` (a token-major tensor of the step's
        forward) under ``name``; tensors of another layout are skipped. Runs once per
        checkpoint, hundreds of times per step: the usual case (a contiguous tensor on a
        device whose checkpoints are deferred) is a few attribute reads and a kept
        reference, with no tensor object made; the rest takes :meth:`_checkpoint`."""
        if self.step is None or not isinstance(tensor, torch.Tensor) or not self.allowed(name):
            return  # allowed() first: under compile tracing nothing else may run here
        fast = self._fast
        deferred = fast.get(tensor.get_device()) if fast else None
        if deferred is None or tensor.requires_grad or not tensor.is_contiguous():
            self._checkpoint(name, tensor)
            return
        words = self._row_words(tensor)
        if not words:
            self._checkpoint(name, tensor)
            return
        unique = self._unique(name)
        slot = deferred.keep(unique, tensor, words, tensor.nbytes)
        if slot >= 0 and not deferred.needs_check(unique):
            self._record(deferred.device, unique, -1 - slot)
            return
        source = token_rows(tensor, self.padded)
        assert source is not None  # the row layout was checked above
        self._stage_named(unique, source, slot, deferred)

    def _row_words(self, tensor: torch.Tensor) -> int:
        """32-bit words per token row of a contiguous ``tensor`` whose leading dims are
        the step's token rows, at a 4-byte aligned address; 0 for any other layout."""
        shape, padded = tensor.shape, self.padded
        nbytes = tensor.nbytes
        if not (shape and (shape[0] == padded or (len(shape) > 1
                                                    and shape[0] * shape[1] == padded))
                and nbytes and not nbytes % (4 * padded) and not tensor.data_ptr() % 4):
            return 0
        return nbytes // padded // 4

    def _checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """:meth:`take` (past :meth:`allowed`) for what its fast path does not
        take (non-contiguous or grad-tracking tensors, row shards of a sequence-parallel
        forward): a view of the rows, deferred where the device allows, else gathered."""
        if tensor.requires_grad:  # only outside inference mode; a view costs little
            tensor = tensor.detach()
        source = token_rows(tensor, self.padded)
        if source is None:
            # A row shard of a sequence-parallel forward: fingerprint every rank's rows.
            joined = join_rows(tensor, self.padded)
            source = None if joined is None else token_rows(joined, self.padded)
        if source is None:
            return
        device = source.device
        unique = self._unique(name)
        check, deferred = -1, None
        if self._defer:
            deferred = self._deferred.get(device, False)
            if deferred is False:
                deferred = self._deferred_for(source)
            if deferred is not None and deferred.accepts(unique, source):
                check = deferred.add(unique, source)
                if not deferred.needs_check(unique):
                    self._record(device, unique, -1 - check)
                    return
        self._stage_named(unique, source, check, deferred)

    def _stage_named(self, unique: str, source: torch.Tensor, check: int,
                     deferred: DeferredHashes | None) -> None:
        """Gather ``source``'s tapped rows under ``unique``; with ``check`` >= 0 the same
        checkpoint is also deferred (slot ``check``) and the two hashes are compared."""
        if self._pending is not None:
            self._prepare()
            if self.step is None:
                return
        slot = self._stage(source)
        if check >= 0 and deferred is not None:
            deferred.checks.append((unique, slot, check))
        elif self._fast and not (deferred is not None and deferred.spent):
            # gathered, not deferred: examined at its call in quick steps (not where only
            # this step's byte budget was spent: a long prefill's size says nothing about
            # the name, and its decode steps would all be examined at the call)
            self._at_call_next.add(_call_key(unique))
        self._record(source.device, unique, slot)

    def _stage(self, source: torch.Tensor) -> int:
        """Gather the tapped rows of ``source`` into a staging slot; the slot's place in
        its device's staging order."""
        device = source.device
        staging = self._staging.get(device) or self._staging_for(device)
        index = self._index.get(("rows", device))
        staging.stage(source, self.index(device) if index is None else index)
        return len(staging.order) - 1

    def _deferred_for(self, source: torch.Tensor) -> DeferredHashes | None:
        from enginetap.tap.record import kernels

        found = None
        if kernels.available(source):
            found = DeferredHashes(source.device, self.options.defer_bytes,
                                   verify_every=self.options.defer_verify_every,
                                   lag=int(source.device.type == "cuda"
                                           and self.vectors is None))
            if self.step is not None:
                found.reset(self.step.mode, self.step.step)
        self._deferred[source.device] = found
        if found is not None:
            self._fast[source.get_device()] = found
        return found

    def checkpoint_rows(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped row, already gathered) under ``name``."""
        self._hand_over(name, rows, per_request=False)

    def checkpoint_requests(self, name: str, rows: torch.Tensor) -> None:
        """Stage ``rows`` (one per tapped request, in :meth:`request_index` order) under
        ``name``; every tapped row of a request gets its request's hash."""
        self._hand_over(name, rows, per_request=True)

    def row_slot(self, name: str, dtype: torch.dtype, width: int,
                 device: torch.device) -> torch.Tensor | None:
        """A ``[tapped rows, width]`` staging slot of checkpoint ``name`` for the caller
        to fill (one gather with ``out=``: rows it reads itself, a cache's); None where
        the step taps nothing or the point is refused (see :meth:`allowed`)."""
        if not self.live or not self.allowed(name):
            return None
        return self._slot(name, dtype, width, device, per_request=False)

    def request_slot(self, name: str, dtype: torch.dtype, width: int,
                     device: torch.device) -> torch.Tensor | None:
        """:meth:`row_slot` with one row per tapped request (in :meth:`request_index`
        order): every tapped row of a request gets its request's hash."""
        if not self.live or not self.allowed(name):
            return None
        return self._slot(name, dtype, width, device, per_request=True)

    def _hand_over(self, name: str, rows: torch.Tensor, per_request: bool) -> None:
        if not self.live or not self.allowed(name):
            return
        count = len(self.request_token_index) if per_request else len(self.rows)
        source = rows.detach().reshape(count, -1)
        if source.dtype == torch.bool:
            source = source.view(torch.uint8)
        self._slot(name, source.dtype, source.shape[1], source.device, per_request
                   ).copy_(source)

    def _slot(self, name: str, dtype: torch.dtype, width: int, device: torch.device,
              per_request: bool) -> torch.Tensor:
        staging = self._staging_for(device)
        slot = staging.slot(dtype, width,
                            rows=len(self.request_token_index) if per_request else None)
        self._record(device, self._unique(name), len(staging.order) - 1)
        return slot

    def note_logits(self, logits: torch.Tensor) -> None:
        """Top-2 logits of each tapped row (``logits`` is ``[tapped rows, vocab]``)."""
        if not self.options.sampler or not self.live or not self.allowed("sampler"):
            return
        values, ids = torch.topk(logits.detach().float(), 2, dim=-1)
        packed = torch.cat([ids.to(torch.int64), values.double().view(torch.int64)], dim=1)
        self.sampler.append((packed.device, packed))

    def _unique(self, name: str) -> str:
        """``name``, or ``name#2``, ``name#3``... for a module run again in one step."""
        seen = self.counts.get(name, 0) + 1
        self.counts[name] = seen
        return name if seen == 1 else f"{name}#{seen}"

    def _staging_for(self, device: torch.device) -> StepStaging:
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = StepStaging(len(self.rows), device)
            staging.reset(len(self.rows), self._device_list("inverse", device))
        return staging


def outputs_of(value: Any) -> list[tuple[str, Any]]:
    """``out`` for a tensor; ``out``, ``out1``, ... for the tensors of a tuple (a router's
    logits, weights and expert ids)."""
    if isinstance(value, (tuple, list)):
        return [("out" if i == 0 else f"out{i}", v) for i, v in enumerate(value)
                if isinstance(v, torch.Tensor)]
    return [("out", value)]


_REPEAT = re.compile(r"#\d+$")
_OUTPUT = re.compile(r"\.out\d+$")


def _call_key(name: str) -> str:
    """The name a sublayer wrapper tests against :attr:`TapRecorder.at_call` for
    checkpoint ``name``: without a repeat count (``#2``), and a tuple output's tensors
    (``.out1``, ``.out2``...) under the tuple's ``.out``."""
    return _OUTPUT.sub(".out", _REPEAT.sub("", name))
