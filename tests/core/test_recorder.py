"""The step recorder with an output directory it cannot write: one error, then it stops;
the engine's step goes on."""

from __future__ import annotations

import logging

from enginetap.core.context import Step, StepRows, publish
from enginetap.core.recorder import StepRecorder


def _step(n: int) -> Step:
    return Step("test", n, "decode", StepRows(["a"], [n], [1], [0], [n]))


def test_unwritable_output_is_said_once_and_recording_stops(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    recorder = StepRecorder(tmp_path / "file" / "out", rank=0).install()
    ran = []
    try:
        with caplog.at_level(logging.ERROR, logger="enginetap.recorder"):
            for n in range(4):
                with publish(_step(n)):
                    ran.append(n)
    finally:
        recorder.uninstall()
    errors = [r for r in caplog.records if r.name == "enginetap.recorder"]
    assert ran == [0, 1, 2, 3]  # every step ran
    assert len(errors) == 1 and "step recording stops" in errors[0].getMessage()
    assert errors[0].exc_info is None  # one line, no traceback
