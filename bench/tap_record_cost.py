"""Host cost of a tap step record: formatting it (``transfer._format``), encoding it, and
the deferred sink's path on a GPU (submitted at step end, written at the next step's
device wait: ``RecordSink(deferred=True)`` submit + pump), on the engine's thread.

A synthetic record of ``--rows`` tapped rows x ``--checkpoints`` checkpoints (385: a
48-layer model's default tap) with sampler values, one record per ``--pause-ms`` (a
decode step: caches as cold as between steps). Times are the calling thread's CPU time
(``time.thread_time``), median and p10-p90 over ``--records``.

    PYTHONPATH=src python bench/tap_record_cost.py --rows 64 --checkpoints 385
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from enginetap.core.jsonl import RankJsonl, encode_line_bytes
from enginetap.core.sink import RecordSink
from enginetap.tap.record.transfer import _format


def record_parts(rows: int, checkpoints: int) -> tuple[dict[str, Any], list[Any]]:
    """A step's head and its host hashes + sampler words, as step end hands them over."""
    names = [f"model.layers.{i // 8}.sub{i % 8}.out" for i in range(checkpoints)]
    records = [{"row": i, "key": f"p{i}", "request_id": f"req-{i}", "pos": 512 + i,
                "tok": 500 + i, "computed_host": 511 + i, "computed_device": None,
                "kv_slot": 4096 + i, "state_slot": None, "token_index": i, "planned": 1,
                "query_len": 1, "seq_len": 513 + i,
                "prefix": f"{(i * 0x9E3779B97F4A7C15) % (1 << 61):016x}"} for i in range(rows)]
    head = {"kind": "step", "mode": "decode", "engine": "transformers", "rows": records,
            "checkpoints": names, "sampled": {f"req-{i}": 7 * i for i in range(rows)}}
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(-2**62, 2**62, (checkpoints * rows + 4 * rows,), dtype=torch.int64,
                         generator=gen)
    logits = torch.tensor([[3.25, 2.5]] * rows, dtype=torch.float64).view(torch.int64)
    flat[checkpoints * rows:].view(rows, 4)[:, 2:] = logits
    return head, [(names, flat, 1)]


def timed(call: Any, records: int, pause: float) -> list[float]:
    spent = []
    for _ in range(records):
        start = time.thread_time_ns()
        call()
        spent.append((time.thread_time_ns() - start) / 1e3)
        time.sleep(pause)
    return spent[len(spent) // 10:]  # the first ones warm up


def show(label: str, spent: list[float]) -> None:
    ordered = sorted(spent)
    print(f"{label:<34} {statistics.median(spent):8.0f} us  "
          f"[p10 {ordered[len(ordered) // 10]:.0f}, p90 {ordered[len(ordered) * 9 // 10]:.0f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--checkpoints", type=int, default=385)
    parser.add_argument("--records", type=int, default=150)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    args = parser.parse_args()
    head, host = record_parts(args.rows, args.checkpoints)
    pause = args.pause_ms / 1e3
    line = encode_line_bytes({"step": 0, "rank": 0, **_format(dict(head), host, args.rows)},
                             True)
    print(f"{args.rows} rows x {args.checkpoints} checkpoints: a {len(line) / 1e3:.0f} KB "
          f"line, one every {args.pause_ms:g} ms; engine-thread CPU us per record:")
    show("format (transfer._format)", timed(lambda: _format(dict(head), host, args.rows),
                                            args.records, pause))
    record = _format(dict(head), host, args.rows)
    show("encode (orjson)", timed(lambda: encode_line_bytes({"step": 0, "rank": 0, **record},
                                                            True), args.records, pause))
    with tempfile.TemporaryDirectory() as out:
        for offload in (False, True):
            sink = RecordSink(RankJsonl(Path(out) / f"tap{offload}.jsonl", 0, fast=True,
                                        offload=offload), deferred=True)

            def step(sink: RecordSink = sink) -> None:
                sink.submit(lambda: _format(dict(head), host, args.rows), 0)
                sink.pump()

            show(f"sink submit + pump, offload={offload}", timed(step, args.records, pause))
            sink.close()


if __name__ == "__main__":
    main()
