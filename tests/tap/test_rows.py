"""Which rows a step taps and what is recorded about each (``tap/record/rows.py``)."""

from __future__ import annotations

from enginetap.core.context import Step, StepRows
from enginetap.tap.record.rows import row_records, select_rows


def step_of(ids: list[str], **columns: list[int]) -> Step:
    n = len(ids)
    rows = StepRows(request_ids=ids, positions=list(range(n)), token_ids=[7] * n,
                    query_start=list(range(n)), computed_host=[0] * n, **columns)
    return Step("transformers", 1, "decode", rows, padded_tokens=n)


def test_select_rows_keeps_the_last_max_rows_that_pass_every_filter() -> None:
    step = step_of(["a1", "b1", "a2", "b2", "a3"])
    assert select_rows(step, [None, None], 64) == [0, 1, 2, 3, 4]
    assert select_rows(step, ["", None], 3) == [2, 3, 4]  # an empty filter is no filter
    assert select_rows(step, ["a", None], 2) == [2, 4]
    assert select_rows(step, ["a", "3"], 64) == [4]
    assert select_rows(step, ["c", None], 64) == []


def test_row_records_read_each_column_and_leave_absent_ones_none() -> None:
    step = step_of(["r0", "r1", "r2"], kv_slots=[10, 11, 12], token_index=[0, 4, 8])
    records = row_records(step, [1, 2], [None, 5, None])
    assert [list(r) for r in records] == [[
        "row", "key", "request_id", "pos", "tok", "computed_host", "computed_device",
        "kv_slot", "state_slot", "token_index", "planned", "query_len", "seq_len",
        "prefix"]] * 2
    assert records[0] == {"row": 1, "key": "r1", "request_id": "r1", "pos": 1, "tok": 7,
                          "computed_host": 0, "computed_device": None, "kv_slot": 11,
                          "state_slot": None, "token_index": 4, "planned": None,
                          "query_len": None, "seq_len": None, "prefix": "0000000000000005"}
    assert (records[1]["kv_slot"], records[1]["token_index"], records[1]["prefix"]) == (
        12, 8, None)
