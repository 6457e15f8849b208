"""Flushing what enginetap holds when the process ends: at exit, and on SIGTERM/SIGINT.

A part that holds unwritten records (the capture writer, a deferred record sink)
registers a flush here (:func:`on_exit`) and takes it back when it closes
(:func:`forget`). Each flush runs at interpreter exit, in the order ``atexit`` gives
(the last registered first). With ``signals=True`` SIGTERM and SIGINT, while any such
flush is registered, are turned into an orderly exit: the engine thread's stack unwinds
(every lock it held is released) and the exit runs the flushes. Flushing in the signal
handler itself, in the middle of whatever the engine thread was doing, could deadlock
on a lock it holds.

The handlers chain: the one found when the first flush asked for signals is called
after ours (SIGINT's default raises KeyboardInterrupt); with none, the signal ends the
process with ``128 + signum``; a signal the process ignores (a background job's SIGINT)
stays ignored. The handlers found are put back exactly when the last such flush is taken
back. Handlers can be installed only from the main thread: from another, a flush still
runs at exit.

After a signal, a watchdog waits for the main thread to finish; if the process is still
there :data:`EXIT_GRACE_S` later, its shutdown is stuck (an exception raised by the
signal inside a lock's critical section can leave the lock held): it runs every
registered ``stuck`` flush (one that takes no lock the engine thread may hold) and ends
the process. A program that caught the interrupt and went on is never touched: its
main thread stays alive.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("enginetap.shutdown")

__all__ = ["EXIT_GRACE_S", "forget", "on_exit"]

EXIT_GRACE_S = 20.0
"""How long a shutdown after SIGTERM/SIGINT may take before the watchdog ends it."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)

Flush = Callable[[], Any]


@dataclass(frozen=True)
class _Entry:
    at_exit: Flush
    stuck: Flush
    signals: bool


class _Registry:
    """The process's one registry (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Flush, _Entry] = {}
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    def add(self, entry: _Entry) -> None:
        with self._lock:
            if entry.at_exit in self._entries:
                return
            self._entries[entry.at_exit] = entry
            atexit.register(entry.at_exit)
            if entry.signals and not self._previous:
                self._install()

    def remove(self, at_exit: Flush) -> None:
        with self._lock:
            entry = self._entries.pop(at_exit, None)
            if entry is None:
                return
            atexit.unregister(at_exit)
            if entry.signals and not any(e.signals for e in self._entries.values()):
                for signum, handler in self._previous.items():
                    signal.signal(signum, handler)
                self._previous.clear()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Unwind the main thread (the exit flushes), after the handler found before."""
        previous = self._previous.get(signum)
        if previous == signal.SIG_IGN:  # the process ignores it (a background job's SIGINT)
            return
        self._start_watchdog(signum)
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def _start_watchdog(self, signum: int) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._exit_watchdog, args=(signum,),
                                              name="enginetap-exit", daemon=True)
            self._watchdog.start()

    def _exit_watchdog(self, signum: int) -> None:
        main = threading.main_thread()
        while main.is_alive():
            time.sleep(0.05)
        time.sleep(EXIT_GRACE_S)
        logger.error("enginetap: the process did not exit within %.0f s of its shutdown "
                     "after signal %d; flushing what enginetap holds and ending it",
                     EXIT_GRACE_S, signum)
        for entry in reversed(list(self._entries.values())):
            try:
                entry.stuck()
            except Exception:  # noqa: BLE001 - the others still flush, the process still ends
                logger.exception("enginetap: a flush at a stuck exit failed")
        os._exit(128 + signum)


_REGISTRY = _Registry()


def on_exit(at_exit: Flush, *, stuck: Flush | None = None, signals: bool = True) -> None:
    """Run ``at_exit`` when the process exits; with ``signals``, make SIGTERM and SIGINT
    an orderly exit while it is registered. ``stuck`` (default ``at_exit``) is what the
    watchdog runs when that exit is stuck: it must take no lock the engine thread may
    hold. Registering ``at_exit`` again does nothing."""
    _REGISTRY.add(_Entry(at_exit, stuck or at_exit, signals))


def forget(at_exit: Flush) -> None:
    """Take back what :func:`on_exit` registered (nothing if it is not registered); the
    last flush with ``signals`` puts back the signal handlers it found."""
    _REGISTRY.remove(at_exit)
