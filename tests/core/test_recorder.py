"""The step recorder: lines at step end, or at the next device wait once the engine
announces them; an output directory it cannot write gives one error, then it stops and
the engine's step goes on."""

from __future__ import annotations

import logging

import pytest

from enginetap.core.context import Step, StepRows, device_wait, publish
from enginetap.core.recorder import StepRecorder


def _step(n: int) -> Step:
    return Step("test", n, "decode", StepRows(["a"], [n], [1], [0], [n]))


@pytest.mark.parametrize("waits", [False, True], ids=["at-step-end", "deferred"])
def test_unwritable_output_is_said_once_and_recording_stops(tmp_path, caplog, waits):
    """Written at step end (a CPU engine) or at the next device wait (a GPU engine)."""
    (tmp_path / "file").write_text("not a directory")
    recorder = StepRecorder(tmp_path / "file" / "out", rank=0).install()
    ran = []
    try:
        with caplog.at_level(logging.ERROR, logger="enginetap.recorder"):
            for n in range(4):
                with publish(_step(n)):
                    if waits:
                        device_wait()  # from step 1 on, the step before is written here
                    ran.append(n)
    finally:
        recorder.uninstall()
    errors = [r for r in caplog.records if r.name == "enginetap.recorder"]
    assert ran == [0, 1, 2, 3] and recorder.deferring == waits  # every step ran
    assert len(errors) == 1 and "step recording stops" in errors[0].getMessage()
    assert errors[0].exc_info is None  # one line, no traceback


def _lines(path) -> list[int]:
    import json

    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.exists() else []


def test_once_the_engine_announces_device_waits_a_line_is_written_at_the_next_wait(tmp_path):
    recorder = StepRecorder(tmp_path, rank=0).install()
    try:
        with publish(_step(0)):  # no wait announced (a CPU engine): written at step end
            pass
        assert _lines(recorder.path) == [0] and not recorder.deferring
        with publish(_step(1)):
            device_wait()  # the step's forward is queued: nothing pending yet
        assert _lines(recorder.path) == [0] and recorder.deferring
        for n in (2, 3):
            with publish(_step(n)):
                device_wait()
                assert _lines(recorder.path) == list(range(n))  # the step before, now
            assert _lines(recorder.path) == list(range(n))  # this step's waits
        device_wait()  # outside a step: no listener runs
        assert _lines(recorder.path) == [0, 1, 2]
    finally:
        recorder.uninstall()
    assert _lines(recorder.path) == [0, 1, 2, 3]  # disarm writes what was pending


def test_only_selected_steps_are_written_when_asked(tmp_path):
    """``options.step.record: "selected"``: a step is written only if a capability
    called ``Step.select`` for it (capture does, for the steps it captures)."""
    from enginetap.core.context import subscribe, unsubscribe

    def pick(step: Step) -> None:
        if step.step % 3 == 0:
            step.select("test")
            step.select("test")  # once is enough

    subscribe(on_begin=pick)
    recorder = StepRecorder(tmp_path, rank=0, only_selected=True).install()
    try:
        for n in range(7):
            with publish(_step(n)) as step:
                assert step.selected == (n % 3 == 0)
    finally:
        recorder.uninstall()
        unsubscribe(pick)
    assert _lines(recorder.path) == [0, 3, 6]
