"""Test helper: records pending in a deferred sink until a signal comes.

    python sink_until_signal.py OUT RECORDS [previous|ignore|stuck|none]

Submits RECORDS records to a deferred sink whose fallback writer never runs (so any
record on disk was flushed at exit), prints "ready", then waits. ``previous``: a
SIGTERM handler of the program's own is set before the sink (it prints "previous" and
exits 7); ``ignore``: SIGTERM is ignored (the program goes on and prints "still here");
``stuck``: a thread that never ends keeps the exit from reaching the flush, and the
watchdog's grace is 1 s.
"""

import signal
import sys
import time
from pathlib import Path

import threading

from enginetap.core import shutdown, sink
from enginetap.core.jsonl import RankJsonl

out, records, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sink.IDLE_S = 1e9
if mode == "previous":
    def previous(signum, frame):
        print("previous", flush=True)
        raise SystemExit(7)

    signal.signal(signal.SIGTERM, previous)
elif mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "stuck":
    shutdown.EXIT_GRACE_S = 1.0
    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
records_sink = sink.RecordSink(RankJsonl(out, 0), deferred=True)
for i in range(records):
    records_sink.submit(lambda i=i: {"i": i}, i)
print("ready", flush=True)
deadline = time.monotonic() + (3 if mode == "ignore" else 120)
while time.monotonic() < deadline:
    time.sleep(0.01)
print("still here", flush=True)
