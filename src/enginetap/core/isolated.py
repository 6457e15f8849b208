"""A Python child process for code that may end the process running it.

User candidates, trusted dataset code and modules imported only to be hashed can call
``sys.exit``, raise ``KeyboardInterrupt``, call ``os._exit`` or crash the interpreter. Run in
a :class:`Child`, none of that can end enginetap's process: an exception becomes an
``{"error": ...}`` reply, a dead child a :class:`ChildDied` for the request it was serving.

The child's ``sys.path`` is exactly the parent's at :meth:`Child.start`: ``python -I``
starts it without the current directory (which ``-c`` and ``-m`` would put first), so a
module planted in the directory the user runs from (a dataset's, say) is never imported.
Requests and replies are JSON objects, one per line, over two private pipes; the child's
stdout is pointed at its stderr so that prints from user code cannot corrupt the channel.
Nothing is pickled: bulk data travels through files the two sides name in their messages.

The child calls the server named by ``entry`` (``"package.module:function"``, a function
taking one request dict and returning the reply dict) for every request.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from enginetap.core.patching import resolve

__all__ = ["Child", "ChildDied", "one_line"]

# Runs before anything can be imported from the path: the first statement replaces it.
_BOOT = ("import sys; sys.path[:] = sys.argv[4:]; "
         "from enginetap.core.isolated import _serve; "
         "_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))")


class ChildDied(RuntimeError):
    """The child process ended while serving a request (its code ended the process)."""

    def __init__(self, returncode: int | None, why: str | None = None) -> None:
        self.returncode = returncode
        super().__init__(why or _ended(returncode))


def _ended(returncode: int | None) -> str:
    if returncode is None:
        return "the process running it stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the process running it was killed by {name}"
    return f"the process running it ended with exit code {returncode} (sys.exit or os._exit)"


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (never a traceback)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Child:
    """One child process serving ``entry``; started on first use, again after it died."""

    def __init__(self, entry: str, sys_path: Sequence[str] | None = None) -> None:
        self.entry = entry
        self.sys_path = list(sys.path if sys_path is None else sys_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._send: IO[str] | None = None
        self._receive: IO[str] | None = None
        self.starts = 0
        """Processes started so far: a new one has lost what the ones before it loaded."""

    @property
    def running(self) -> bool:
        """A process is up (the next request does not start one)."""
        return self._process is not None

    def request(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send one request and return the reply; ``timeout`` seconds at most (None: no
        limit), after which the child is killed.

        Raises:
            ChildDied: the child ended (or was killed for ``timeout``) before replying; it
                is restarted by the next request.
        """
        if self._process is None:
            self._start()
        assert self._send is not None and self._receive is not None
        try:
            self._send.write(json.dumps(message) + "\n")
            self._send.flush()
            # One reply line per request: nothing is left buffered between requests, so
            # the pipe's descriptor says when the reply starts.
            if timeout is not None and not select.select([self._receive], [], [], timeout)[0]:
                assert self._process is not None
                self._process.kill()
                self._reap()
                raise ChildDied(None, f"no reply within {timeout:g} s (a hang, or too slow "
                                      "for --timeout): its process was killed")
            line = self._receive.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = ""
        if not line:
            raise ChildDied(self._reap())
        return json.loads(line)

    def close(self) -> None:
        """End the child (closing its request pipe ends its loop) and wait for it."""
        if self._process is not None:
            self._reap()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, self.entry, str(child_read),
                 str(child_write), *self.sys_path],
                pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent())
        finally:
            os.close(child_read)
            os.close(child_write)
        self.starts += 1
        self._send = os.fdopen(parent_write, "w", encoding="utf-8")
        self._receive = os.fdopen(parent_read, "r", encoding="utf-8")

    def _reap(self) -> int | None:
        process, self._process = self._process, None
        for stream in (self._send, self._receive):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass  # the child already closed its end: nothing left to flush
        self._send = self._receive = None
        if process is None:
            return None
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, a function for ``preexec_fn`` that has the child killed when the process
    that started it dies: a replay killed with SIGKILL (no chance to close the pipe) leaves
    no candidate or reference spinning in a hanging import or loop. ``None`` elsewhere.

    The death signal follows the *thread* that forked: children are started from the
    replay's own thread, which outlives them."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def _serve(entry: str, read_fd: int, write_fd: int) -> None:
    """The child's loop: one reply per request until the parent closes the pipe."""
    replies = os.fdopen(write_fd, "w", encoding="utf-8")
    requests = os.fdopen(read_fd, "r", encoding="utf-8")
    os.dup2(2, 1)  # user code's prints go to stderr, never into the reply channel
    handle: Callable[[dict[str, Any]], dict[str, Any]] = resolve(entry)
    for line in requests:
        try:
            reply = handle(json.loads(line))
        except BaseException as exc:  # noqa: BLE001 (SystemExit and KeyboardInterrupt too:
            # they come from the code this child exists to contain)
            reply = {"error": one_line(exc)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
