"""The step context: publish/current/subscribe, and listener failures stay contained."""

from __future__ import annotations

import pytest

from enginetap.core import context
from enginetap.core.context import Step, StepRows, current_step, publish, subscribe


def _step(n: int) -> Step:
    rows = StepRows(request_ids=["a", "a", "b"], positions=[0, 1, 5], token_ids=[7, 8, 9],
                    query_start=[0, 0, 2], computed_host=[0, 0, 5])
    return Step(engine="test", step=n, mode=Step.mode_of(2, 1), rows=rows)


def test_publish_sets_current_and_notifies_in_order():
    events = []
    subscribe(on_begin=lambda s: events.append(("begin", s.step, current_step() is s)),
              on_end=lambda s: events.append(("end", s.step, current_step() is s)))
    assert current_step() is None
    with publish(_step(3)) as step:
        assert current_step() is step and step.mode == "mixed"
    assert current_step() is None
    assert events == [("begin", 3, True), ("end", 3, True)]


def test_current_cleared_when_step_raises_and_listener_errors_contained(caplog):
    subscribe(on_begin=lambda s: 1 / 0)
    with pytest.raises(KeyError):
        with publish(_step(1)):
            raise KeyError("engine failure")
    assert current_step() is None
    assert "listener" in caplog.text


def test_rows_must_have_equal_lengths():
    with pytest.raises(ValueError, match="positions"):
        StepRows(request_ids=["a"], positions=[0, 1], token_ids=[1], query_start=[0],
                 computed_host=[0])


def test_rows_of_and_modes():
    step = _step(0)
    assert step.rows.rows_of("a") == [0, 1] and len(step.rows) == 3
    assert Step.mode_of(4, 0) == "prefill" and Step.mode_of(0, 3) == "decode"
    assert step.to_json()["rows"]["token_ids"] == [7, 8, 9]


def test_unsubscribe():
    seen = []
    listener = seen.append
    subscribe(on_begin=listener, on_end=listener)
    context.unsubscribe(listener)
    with publish(_step(0)):
        pass
    assert seen == []
