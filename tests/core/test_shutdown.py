"""The flush-at-exit registry: SIGTERM flushes what is registered, then the signal goes
on to the handler found before (or ends the process); an ignored signal stays ignored;
a stuck exit is flushed and ended by the watchdog; the handlers found are put back
exactly once the last flush is taken back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from enginetap.core import shutdown

HELPER = Path(__file__).with_name("sink_until_signal.py")


def _lines(path: Path) -> list[int]:
    return [json.loads(line)["i"] for line in path.read_text().splitlines()] \
        if path.exists() else []


def _signalled(tmp_path: Path, mode: str, records: int = 300) -> tuple[int, str, list[int]]:
    out = tmp_path / "t.jsonl"
    proc = subprocess.Popen([sys.executable, str(HELPER), str(out), str(records), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=60)[1]
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"no exit after SIGTERM: {proc.communicate()[1][-3000:]}") from None
    return proc.returncode, stdout + stderr, _lines(tmp_path / "t-rank0.jsonl")


def test_sigterm_flushes_a_deferred_sink_and_ends_the_process(tmp_path):
    code, _, written = _signalled(tmp_path, "none")
    assert code == 128 + signal.SIGTERM
    assert written == list(range(300))  # none was written before the signal


def test_sigterm_goes_on_to_the_handler_found_before(tmp_path):
    code, output, written = _signalled(tmp_path, "previous")
    assert code == 7 and "previous" in output
    assert written == list(range(300))


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    code, output, written = _signalled(tmp_path, "ignore")
    assert code == 0 and "still here" in output
    assert written == list(range(300))  # flushed at the program's own exit


def test_a_stuck_exit_is_flushed_and_ended_by_the_watchdog(tmp_path):
    # the interpreter waits for a thread that never ends before it runs the exit
    # handlers: the watchdog writes what the sink holds and ends the process
    code, output, written = _signalled(tmp_path, "stuck")
    assert code == 128 + signal.SIGTERM
    assert "did not exit within 1 s" in output
    assert written == list(range(300))


def test_the_handlers_found_are_put_back_when_the_last_flush_goes():
    def mine(signum, frame):  # pragma: no cover - never called
        pass

    found_int = signal.getsignal(signal.SIGINT)
    found_term = signal.signal(signal.SIGTERM, mine)
    calls: list[str] = []

    def first() -> None:
        calls.append("first")

    def second() -> None:
        calls.append("second")

    try:
        shutdown.on_exit(first)
        ours = signal.getsignal(signal.SIGTERM)
        assert ours is not mine and signal.getsignal(signal.SIGINT) == ours
        shutdown.on_exit(second, signals=False)
        shutdown.on_exit(first)  # again: nothing more
        shutdown.forget(first)
        assert signal.getsignal(signal.SIGTERM) is mine  # no flush asks for signals now
        assert signal.getsignal(signal.SIGINT) is found_int
        shutdown.on_exit(first)
        assert signal.getsignal(signal.SIGTERM) == ours
        shutdown.forget(second)
        assert signal.getsignal(signal.SIGTERM) == ours  # first still asks for them
        shutdown.forget(first)
        shutdown.forget(first)  # not registered: nothing
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is found_int
        assert calls == []
    finally:
        signal.signal(signal.SIGTERM, found_term)
