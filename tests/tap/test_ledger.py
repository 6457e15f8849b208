"""The recorder's parts on their own: a step's ledger, the checkpointer writing to it, the
quick steps examining a listed step into it (on the CPU, no engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from enginetap.tap.options import TapOptions
from enginetap.tap.record.checkpointer import Checkpointer
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.record.fingerprint import hash_rows
from enginetap.tap.record.ledger import StepLedger
from enginetap.tap.record.quick import QuickSteps

CPU = torch.device("cpu")


def _rows(*pairs: tuple[str, int]) -> list[dict[str, Any]]:
    """Tapped row records: (request key, token index) each."""
    return [{"key": key, "token_index": index} for key, index in pairs]


def test_ledger_is_slotted_and_counts_repeats() -> None:
    ledger = StepLedger()
    assert not hasattr(ledger, "__dict__")
    with pytest.raises(AttributeError):
        ledger.extra = 1  # type: ignore[attr-defined]
    assert [ledger.unique(n) for n in ("a", "b", "a", "a")] == ["a", "b", "a#2", "a#3"]
    assert StepLedger().counts == {}  # nothing carried over to another step's ledger


def test_ledger_records_in_order_or_lists_in_a_quick_step() -> None:
    ledger = StepLedger()
    ledger.record(CPU, "x", 0)
    ledger.record(CPU, "y", -1)
    ledger.listed = []
    ledger.record(CPU, "z", -2)  # a quick step not yet examined: listed in its place
    assert ledger.names == [(CPU, "x"), (CPU, "y")] and ledger.slots == [0, -1]
    assert ledger.listed == [(None, (CPU, "z", -2))]
    assert ledger.deferred_count == 1


def test_ledger_picks_rows_and_makes_device_lists_once() -> None:
    ledger = StepLedger()
    ledger.pick(_rows(("p", 3), ("q", 5), ("p", 7), ("r", 9)))
    assert ledger.token_index == [3, 5, 7, 9]
    assert ledger.request_of_row == [0, 1, 0, 2]  # requests by their last tapped row
    assert ledger.request_token_index == [7, 5, 9]
    rows = ledger.device_list("rows", CPU)
    assert rows.tolist() == [3, 5, 7, 9] and rows.dtype == torch.int64
    assert ledger.device_list("rows", CPU) is rows
    assert ledger.device_list("inverse", CPU).tolist() == [0, 1, 0, 2]
    assert ledger.device_list("requests", CPU).tolist() == [7, 5, 9]


def test_ledger_row_words_reads_only_token_major_word_rows() -> None:
    ledger = StepLedger(padded=4)
    assert ledger.row_words(torch.zeros(4, 8)) == 8
    assert ledger.row_words(torch.zeros(2, 2, 4, dtype=torch.bfloat16)) == 2  # [batch, seq]
    assert ledger.row_words(torch.zeros(3, 8)) == 0  # not the step's rows
    assert ledger.row_words(torch.zeros(4, 3, dtype=torch.bool)) == 0  # 3-byte rows
    assert ledger.row_words(torch.zeros(4 * 8 + 1, dtype=torch.uint8)[1:].view(4, 8)) == 0


class _Picker:
    """The recorder's row picking, for a checkpointer on its own."""

    def __init__(self, ledger: StepLedger, rows: list[dict[str, Any]]) -> None:
        self.ledger, self.rows, self.calls = ledger, rows, 0

    def __call__(self) -> None:
        self.calls += 1
        self.ledger.pending = None
        self.ledger.pick(self.rows)


def _gathering(padded: int, rows: list[dict[str, Any]]) -> tuple[Checkpointer, StepLedger,
                                                                  _Picker]:
    ledger = StepLedger(pending=object(), mode="decode", padded=padded)  # type: ignore[arg-type]
    picker = _Picker(ledger, rows)
    checkpointer = Checkpointer(TapOptions(defer=False), pick=picker)
    checkpointer.start("decode", 1)
    return checkpointer, ledger, picker


def test_checkpointer_gathers_the_tapped_rows_into_the_ledger() -> None:
    checkpointer, ledger, picker = _gathering(6, _rows(("a", 1), ("b", 4)))
    hidden = torch.randn(6, 16)
    checkpointer.take(ledger, "L0.in", hidden)
    checkpointer.take(ledger, "L0.in", hidden.t().contiguous().t())  # non-contiguous rows
    checkpointer.take(ledger, "L0.mask", torch.zeros(5, 2))  # not the step's rows
    checkpointer.take(ledger, "L0.meta", (hidden,))  # not a tensor
    assert picker.calls == 1  # the rows are picked once, by the first gather
    assert ledger.names == [(CPU, "L0.in"), (CPU, "L0.in#2")] and ledger.slots == [0, 1]
    staged = checkpointer.staging[CPU].hashes()
    assert torch.equal(staged[0], hash_rows(hidden[[1, 4]]))
    assert torch.equal(staged[1], staged[0])
    assert not ledger.call_later  # no device defers: nothing to examine at the call later


def test_checkpointer_takes_rows_handed_over_per_request() -> None:
    checkpointer, ledger, picker = _gathering(6, _rows(("a", 1), ("b", 4), ("a", 5)))
    picker()  # the recorder picks before any handed-over rows
    state = torch.arange(8, dtype=torch.int32).view(2, 4)  # one row per request (b, a)
    checkpointer.hand_over(ledger, "L0.state", state, per_request=True)
    checkpointer.hand_over(ledger, "L0.kv", torch.ones(3, 2, dtype=torch.bool),
                           per_request=False)
    assert [name for _, name in ledger.names] == ["L0.state", "L0.kv"]
    staged = checkpointer.staging[CPU].hashes()
    expected = hash_rows(state)[torch.tensor(ledger.request_of_row)]
    assert torch.equal(staged[0], expected)  # each row takes its request's hash


def _deferring(verified: list[str]) -> tuple[DeferredHashes, dict[int, DeferredHashes]]:
    deferred = DeferredHashes(CPU, budget=1 << 20, verify=1)
    deferred.reset("decode", 1)
    for name in verified:
        deferred.needs_check(name)
    return deferred, {torch.zeros(1).get_device(): deferred}


def test_quick_steps_settle_a_listed_step_into_its_ledger_and_plan_the_next() -> None:
    quick = QuickSteps()
    deferred, fast = _deferring(["L0.in", "L0.out"])
    assert not quick.start("decode", fast, enabled=True, split=False)  # not settled yet
    deferred.names = ["L0.in"]  # a step that deferred and verified nothing settles its kind
    quick.learn("decode", quick=False, fast=fast)
    assert quick.start("decode", fast, enabled=True, split=False)
    assert not quick.start("decode", fast, enabled=True, split=True)
    assert not quick.start("decode", fast, enabled=False, split=False)
    deferred.reset("decode", 2)
    with torch.inference_mode():
        first = [torch.randn(4, 8), torch.randn(4, 8)]
    ledger = StepLedger(mode="decode", padded=4)
    listed = [("L0.in", first[0]), (None, (CPU, "L0.norm", 0)), ("L0.out", first[1])]
    assert not quick.settle(ledger, list(listed), fast)  # examined one by one: planned
    assert ledger.names == [(CPU, "L0.in"), (CPU, "L0.norm"), (CPU, "L0.out")]
    assert ledger.slots == [-1, 0, -2] and deferred.tensors == first
    assert "decode" in quick.plans

    deferred.reset("decode", 3)
    with torch.inference_mode():
        second = [torch.randn(4, 8), torch.randn(4, 8)]
    again = StepLedger(mode="decode", padded=4)
    listed = [("L0.in", second[0]), (None, (CPU, "L0.norm", 0)), ("L0.out", second[1])]
    assert quick.settle(again, listed, fast)  # kept whole by the plan
    assert again.names == ledger.names and again.slots == ledger.slots
    assert again.counts == {"L0.in": 1, "L0.out": 1} and deferred.tensors == second


def test_quick_steps_leave_out_what_they_cannot_defer() -> None:
    quick = QuickSteps()
    deferred, fast = _deferring(["L0.in"])
    quick.settled.add("decode")
    with torch.inference_mode():
        kept, new = torch.randn(4, 8), torch.randn(4, 8)
    ledger = StepLedger(mode="decode", padded=4)
    listed = [("L0.in", kept), ("L1.in", new), ("L1.mask", torch.zeros(3))]
    assert not quick.settle(ledger, listed, fast)
    assert ledger.names == [(CPU, "L0.in")]
    assert ledger.late_dropped == ["L1.in"]  # new to the kind: verified at its call first
    assert "decode" not in quick.settled and not quick.plans
    assert ledger.call_later == {"L1.mask"}  # no token rows: examined at its call
