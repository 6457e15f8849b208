"""Quick steps: a settled step's checkpoints are only listed during the forward and
examined in one loop at the device wait or step end.

The sublayer wrappers list each deferrable checkpoint's tensor (``recorder.quick``, the
step ledger's :attr:`~.ledger.StepLedger.listed`); :meth:`QuickSteps.settle` examines the
list where the host would otherwise wait for the device, and a list that matches the last
quick step's of its kind is kept whole by its :class:`QuickPlan` (a few C-level passes). A
step is quick once its kind is settled: its last step verified nothing
(:mod:`enginetap.tap.record.deferred`). Quick steps read and write the step's ledger and
the deferring device's state, nothing else of the recorder's.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from enginetap.tap.record.fingerprint import token_rows
from enginetap.tap.record.checkpointer import call_key, outputs_of
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.ledger import StepLedger

__all__ = ["QuickPlan", "QuickSteps"]

Deferring = Mapping[int, DeferredHashes]
"""The devices whose checkpoints are deferred, by ``Tensor.get_device()`` index."""


def _sole(fast: Deferring) -> DeferredHashes | None:
    """The deferred state of the one device that defers (quick steps need exactly one);
    None otherwise."""
    return next(iter(fast.values())) if len(fast) == 1 else None


class QuickSteps:
    """Which steps run quick, and what was learned across steps to decide it: the step
    kinds settled, the names examined at their call, each kind's plan."""

    __slots__ = ("at_call", "later", "settled", "plans", "demotions", "cuda")

    def __init__(self) -> None:
        self.at_call: set[str] = set()
        """Checkpoint names examined as they come even in a quick step: those gathered
        rather than deferred (demoted, or of a layout deferral does not take). The
        sublayer wrappers test it per call; it only changes at a step's begin."""
        self.later: set[str] = set()
        """Names the steps since the last begin found to examine at their call (their
        ledgers' :attr:`~.ledger.StepLedger.call_later`), for :attr:`at_call` at the next."""
        self.settled: set[str] = set()
        """Step kinds whose last step verified nothing: their next steps may run quick."""
        self.plans: dict[str, QuickPlan] = {}
        """By step kind: the plan of its last quick step's list (see :class:`QuickPlan`)."""
        self.demotions = 0
        self.cuda = torch.cuda.is_available()

    def forget(self) -> None:
        """A model was loaded: its checkpoint names are verified before any quick step."""
        self.settled.clear()
        self.plans.clear()

    def start(self, mode: str, fast: Deferring, enabled: bool, split: bool) -> bool:
        """Whether a step of kind ``mode`` runs quick: every checkpoint deferrable is only
        listed by the sublayer wrappers and examined in one loop at the device wait or
        step end (:meth:`settle`), where the same Python costs several times less than
        between a forward's launches (BENCHMARKS.md, host cost per operation).

        A step is quick when quick steps are ``enabled``, its kind is settled (the last
        step of its kind verified nothing, so every name it met is verified), it is no
        full verification step, one device defers, no graph capture or compile tracing is
        on, and no patch splits forwards' rows across ranks (``split``, sp_prefill: whether
        a step is quick is decided per rank, and a row shard is joined by a collective at
        its call).
        Names gathered rather than deferred are in :attr:`at_call` and still examined at
        their call; a name a quick step cannot defer when examined (new, or of another
        layout) is left out of that step's record (listed under ``"dropped"``) and
        examined at its call, or verified, from the next step on."""
        if self.later:
            self.at_call.update(self.later)
            self.later.clear()
        deferred = _sole(fast)
        if deferred is None or split:
            return False  # (split rows are joined by a collective: at their call on every rank)
        if len(deferred.demoted) != self.demotions:
            self.at_call.update(call_key(n) for n in list(deferred.demoted)[self.demotions:])
            self.demotions = len(deferred.demoted)
        return (enabled and mode in self.settled and not deferred.full
                and not torch.compiler.is_compiling()
                and not (self.cuda and torch.cuda.is_current_stream_capturing()))

    def learn(self, mode: str, quick: bool, fast: Deferring) -> None:
        """After a step of kind ``mode`` that was not ``quick``: its kind is settled when
        it deferred checkpoints and verified none (every name it met had been verified)."""
        deferred = None if quick else _sole(fast)
        if deferred is not None and deferred.names and not deferred.checks and not deferred.full:
            self.settled.add(mode)

    def settle(self, ledger: StepLedger, listed: list[tuple[str | None, Any]],
               fast: Deferring) -> bool:
        """Examine the checkpoints a quick step ``listed``, in order, into its ``ledger``
        (see :meth:`start`); later checkpoints of the step are examined at their call.
        Where the list matches the plan of the last quick step of its kind
        (:class:`QuickPlan`) it is kept whole (True); otherwise one by one, and a new plan
        made."""
        deferred = _sole(fast)
        plan = self.plans.get(ledger.mode)
        if deferred is not None and plan is not None:
            if plan.keep(ledger, deferred, listed):
                return True
            del self.plans[ledger.mode]
        start, dropped, later = len(ledger.names), len(ledger.late_dropped), len(ledger.call_later)
        names, slots, late = ledger.names, ledger.slots, self._late
        for name, value in listed:
            if name is None:
                device, unique, slot = value
                names.append((device, unique))
                slots.append(slot)
            elif isinstance(value, torch.Tensor):
                late(ledger, fast, name, value)
            elif isinstance(value, (tuple, list)):
                base = name[:-4]  # "<base>.out": a tuple's tensors are out, out1, ...
                for suffix, tensor in outputs_of(value):
                    late(ledger, fast, f"{base}.{suffix}", tensor)
        if (deferred is not None and len(ledger.late_dropped) == dropped
                and len(ledger.call_later) == later):
            made = QuickPlan.make(ledger, deferred, fast, listed, start)
            if made is not None:
                self.plans[ledger.mode] = made
        return False

    def _late(self, ledger: StepLedger, fast: Deferring, name: str, tensor: Any) -> None:
        """The checkpointer's ``take`` for a checkpoint listed by a quick step, examined
        after the forward: deferred as it would have been at its call (a contiguous tensor
        as it is, another through its row view), else left out of this step (its bytes at
        the call are gone) and examined at its call from the next step."""
        if not isinstance(tensor, torch.Tensor):
            return
        deferred = fast.get(tensor.get_device())
        if deferred is None or tensor.requires_grad:  # the call would have gathered it
            if token_rows(tensor, ledger.padded) is not None:
                self._leave_out(ledger, ledger.unique(name), at_call=True)
            else:
                ledger.call_later.add(call_key(name))
            return
        words = ledger.row_words(tensor) if tensor.is_contiguous() else 0
        source = None if words else token_rows(tensor, ledger.padded)
        if source is None and not words:  # no token rows (or a row shard): as at the call
            ledger.call_later.add(call_key(name))
            return
        unique = ledger.unique(name)
        if not deferred.settled(unique):  # new to this kind of step: verify it first
            self._leave_out(ledger, unique, at_call=False)
            return
        if not tensor.is_inference() and tensor._version != deferred.seen_version.get(unique):
            deferred.demote_moved(unique)  # the same code path wrote it after its call
            self._leave_out(ledger, unique, at_call=True)
            return
        if words:
            slot = deferred.keep(unique, tensor, words, tensor.nbytes)
        else:
            assert source is not None
            slot = deferred.add(unique, source) if deferred.accepts(unique, source) else -1
        if slot < 0:  # demoted, or the byte budget is spent, or rows it cannot read
            self._leave_out(ledger, unique, at_call=True)
            return
        ledger.names.append((deferred.device, unique))
        ledger.slots.append(-1 - slot)

    def _leave_out(self, ledger: StepLedger, unique: str, at_call: bool) -> None:
        ledger.late_dropped.append(unique)
        if at_call:
            ledger.call_later.add(call_key(unique))
        else:
            self.settled.discard(ledger.mode)


@dataclass(slots=True)
class QuickPlan:
    """How a quick step's list was kept when every checkpoint in it was kept as it is
    (contiguous inference tensors of token rows, one deferred slot each), so that the
    next quick step of its kind that lists the same is kept in one call. The same means:
    the same names in the same order (checkpoints examined at their call in the same
    places), tensors of the same shapes on the deferring device (the hash reads bytes:
    their dtype does not matter), contiguous, made in inference mode (no version counter
    to compare), at 4-byte aligned addresses, within the byte budget, the same number of
    token rows, no name demoted since. Each of those is one C-level pass over the list,
    where examining the checkpoints one by one costs a dozen Python operations each
    (BENCHMARKS.md: the settle loop). A list that differs in anything is examined one by
    one, as without a plan, and planned anew."""

    listed: list[str | None]
    """The list's names in order (None where a checkpoint taken at its call sits)."""
    shapes: list[torch.Size]
    uniques: list[str]
    """Each kept tensor's checkpoint name (with its repeat count)."""
    words: list[int]
    """Each kept tensor's 32-bit words per token row."""
    nbytes: int
    padded: int
    demotions: int
    first: int
    """The deferred slot of the first kept tensor."""
    device_index: int
    counts: dict[str, int]
    """Calls per checkpoint name in the list (the ledger's repeat counts)."""
    order: list[tuple[torch.device, str] | None]
    slots: list[int | None]
    """What the ledger's names and slots get, None where a checkpoint taken at its call
    sits (filled from the list's marker)."""
    markers: list[tuple[int, int]]
    """(place in the list, place in ``order``) of each checkpoint taken at its call."""

    @classmethod
    def make(cls, ledger: StepLedger, deferred: DeferredHashes, fast: Deferring,
             listed: list[tuple[str | None, Any]], start: int) -> QuickPlan | None:
        """The plan of ``listed``, just examined one by one into the ledger's names and
        slots from ``start`` on with nothing left out (``deferred``: the one device's in
        ``fast`` that defers); None where any checkpoint in it was kept otherwise than as
        it is (a row view, a version counter to compare, staged)."""
        names, slots = ledger.names[start:], ledger.slots[start:]
        flat: list[torch.Tensor] = []
        uniques: list[str] = []
        words: list[int] = []
        kept: list[int] = []
        counts: dict[str, int] = {}
        markers: list[tuple[int, int]] = []
        j = 0
        for i, (name, value) in enumerate(listed):
            if name is None:
                if j >= len(names) or names[j] != value[:2]:
                    return None
                markers.append((i, j))
                j += 1
                continue
            if isinstance(value, torch.Tensor):
                called = [(name, value)]
            elif isinstance(value, (tuple, list)):
                called = [(f"{name[:-4]}.{suffix}", t) for suffix, t in outputs_of(value)]
            else:
                continue
            for call, tensor in called:
                row_words = ledger.row_words(tensor)
                if j >= len(names) or slots[j] >= 0 or not tensor.is_contiguous() \
                        or not tensor.is_inference() or tensor.requires_grad or not row_words:
                    return None
                counts[call] = counts.get(call, 0) + 1
                uniques.append(names[j][1])
                words.append(row_words)
                kept.append(slots[j])
                flat.append(tensor)
                j += 1
        if j != len(names) or not flat:
            return None
        first = -1 - kept[0]
        if kept != list(range(-1 - first, -1 - first - len(kept), -1)) \
                or len(deferred.tensors) != first + len(kept):
            return None
        index = flat[0].get_device()
        if any(t.get_device() != index for t in flat) or fast.get(index) is not deferred:
            return None
        order: list[tuple[torch.device, str] | None] = list(names)
        planned_slots: list[int | None] = list(slots)
        for _, position in markers:
            order[position] = planned_slots[position] = None
        return cls(listed=[name for name, _ in listed], shapes=[t.shape for t in flat],
                   uniques=uniques, words=words,
                   nbytes=sum(t.nbytes for t in flat), padded=ledger.padded,
                   demotions=len(deferred.demoted), first=first, device_index=index,
                   counts=counts, order=order, slots=planned_slots, markers=markers)

    def keep(self, ledger: StepLedger, deferred: DeferredHashes,
             listed: list[tuple[str | None, Any]]) -> bool:
        """Keep ``listed`` whole as planned, into ``deferred`` and the ledger's names and
        slots; False (nothing kept) where it differs from the plan."""
        if (len(listed) != len(self.listed) or ledger.padded != self.padded
                or len(deferred.demoted) != self.demotions
                or len(deferred.tensors) != self.first
                or [name for name, _ in listed] != self.listed):
            return False
        flat: list[torch.Tensor] = []
        add = flat.append
        for name, value in listed:
            if isinstance(value, torch.Tensor):
                add(value)
            elif name is not None and isinstance(value, (tuple, list)):  # outputs_of's
                flat += [v for v in value if isinstance(v, torch.Tensor)]  # tensors, unnamed
        if (len(flat) != len(self.uniques) or list(map(_SHAPE, flat)) != self.shapes
                or not all(map(torch.Tensor.is_contiguous, flat))
                or not all(map(torch.Tensor.is_inference, flat)) or any(map(_GRAD, flat))
                or list(map(torch.Tensor.get_device, flat)).count(self.device_index)
                != len(flat)):
            return False
        addresses = list(map(torch.Tensor.data_ptr, flat))
        if functools.reduce(operator.or_, addresses, 0) & 3 \
                or deferred.held + self.nbytes > deferred.budget:
            return False
        deferred.keep_listed(self.uniques, flat, addresses, self.words, self.nbytes)
        ledger.counts.update(self.counts)
        order, slots = self.order, self.slots
        if self.markers:
            order, slots = order.copy(), slots.copy()
            for i, j in self.markers:
                device, unique, slot = listed[i][1]
                order[j], slots[j] = (device, unique), slot
        ledger.names += order  # type: ignore[arg-type]
        ledger.slots += slots  # type: ignore[arg-type]
        return True


_SHAPE = operator.attrgetter("shape")
_GRAD = operator.attrgetter("requires_grad")
