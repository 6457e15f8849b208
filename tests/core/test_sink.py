"""The record sink: deferred records are written at the next pump, in order, or by the
idle writer; an inline sink writes at once; an owner's error handler can stop it."""

from __future__ import annotations

import json
import time

from enginetap.core.jsonl import RankJsonl
from enginetap.core.sink import IDLE_S, RecordSink


def test_the_deferred_sink_writes_at_the_next_pump_in_order(tmp_path) -> None:
    path = tmp_path / "t-rank0.jsonl"

    def written() -> list[int]:
        return [json.loads(line)["i"] for line in path.read_text().splitlines()] \
            if path.exists() else []

    sink = RecordSink(RankJsonl(tmp_path / "t.jsonl", 0), deferred=True)
    sink.submit(lambda: {"i": 0}, 0)
    assert written() == [] and sink.pending == 1  # waits for the next step's pump
    sink.submit(lambda: {"i": 1}, 1)
    sink.pump()
    assert written() == [0, 1] and sink.pending == 0
    for i in range(2, 50):
        sink.submit(lambda i=i: {"i": i}, i)
        if i % 7 == 0:
            sink.pump()
    sink.drain()
    assert written() == list(range(50))
    sink.submit(lambda: {"i": 50}, 50)  # no next step comes: the idle writer writes it
    deadline = time.monotonic() + 20 * IDLE_S
    while sink.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert written() == list(range(51))
    sink.close()


def test_the_inline_sink_writes_at_once(tmp_path) -> None:
    sink = RecordSink(RankJsonl(tmp_path / "t.jsonl", 0), deferred=False)
    sink.submit(lambda: {"i": 0}, 0)
    assert sink.pending == 0 and (tmp_path / "t-rank0.jsonl").read_text().count("\n") == 1
    sink.close()


def test_an_error_handler_sees_the_failure_and_can_stop_the_sink(tmp_path) -> None:
    seen: list[Exception] = []
    sink = RecordSink(RankJsonl(tmp_path / "t.jsonl", 0), deferred=True)

    def failed(exc: Exception) -> None:
        seen.append(exc)
        sink.stop()

    sink.on_error = failed

    def broken() -> dict:
        raise OSError(28, "No space left on device")

    sink.submit(broken, 0)
    sink.submit(lambda: {"i": 1}, 1)
    sink.pump()
    assert [type(e) for e in seen] == [OSError] and sink.pending == 0
    sink.submit(lambda: {"i": 2}, 2)  # stopped: later records are ignored
    sink.drain()
    assert sink.pending == 0 and not (tmp_path / "t-rank0.jsonl").exists()
    sink.close()
