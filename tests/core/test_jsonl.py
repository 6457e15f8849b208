"""The one per-rank JSONL writer: every record stamped with a step, files mergeable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from enginetap.core import context, jsonl
from enginetap.core.context import Step, StepRows, publish
from enginetap.core.jsonl import RankJsonl, close_all
from enginetap.core.ranks import merge_rank_files


def _step(n: int) -> Step:
    return Step("test", n, "decode", StepRows(["a"], [n], [1], [0], [n]))


def test_records_carry_the_step_and_ranks_merge(tmp_path):
    base = tmp_path / "guard.jsonl"
    writers = [RankJsonl(base, 0), RankJsonl(base, 1)]
    writers[0].write({"event": "before any step"})
    for n in range(3):
        with publish(_step(n)):
            for w in writers:
                w.write({"event": "inside", "n": n})
        writers[1].write({"event": "after step"})  # stamped with the last step
    close_all()
    first = json.loads((tmp_path / "guard-rank0.jsonl").read_text().splitlines()[0])
    assert first == {"step": -1, "rank": 0, "event": "before any step"}
    merged = [json.loads(line) for line in merge_rank_files(base).read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in merged] == sorted((r["step"], r["rank"]) for r in merged)
    assert [r["step"] for r in merged if r["event"] == "after step"] == [0, 1, 2]


def test_a_file_is_started_afresh_once_per_process_then_shared(tmp_path):
    base = tmp_path / "x.jsonl"
    (tmp_path / "x-rank0.jsonl").write_text('{"step": 0, "old": true}\n')
    RankJsonl(base, 0).write({"a": 1})
    RankJsonl(base, 0).write({"b": 2})  # a second writer of the same file appends
    close_all()
    lines = [json.loads(l) for l in (tmp_path / "x-rank0.jsonl").read_text().splitlines()]
    assert [("a" in l, "b" in l) for l in lines] == [(True, False), (False, True)]
    assert context.step_number() == -1


def test_fast_lines_equal_json_lines_and_fall_back_where_orjson_cannot():
    from enginetap.core.jsonl import encode_line

    step = _step(7)
    step.sampled = {"a": 3}
    step.extra = {"shape": (2, 1), "path": context}  # a tuple; an object written as str
    record = {"step": 7, "rank": 0, **step.to_json()}
    plain = json.dumps(record, separators=(",", ":"), default=str) + "\n"
    assert encode_line(record) == plain
    assert encode_line(record, fast=True) == plain
    huge = {"n": 1 << 70, "s": "\u00e9"}  # beyond 64 bits: orjson refuses, json writes it
    assert encode_line(huge, fast=True) == json.dumps(huge, separators=(",", ":")) + "\n"


def test_an_offloading_writer_writes_every_line_in_order_by_flush_close_and_exit(tmp_path):
    base = tmp_path / "tap.jsonl"
    writer = RankJsonl(base, 0, fast=True, offload=True)
    plain = RankJsonl(base, 0)  # another writer of the file: its lines queue behind
    for n in range(200):
        (plain if n % 50 == 7 else writer).write({"n": n, "pad": "x" * 5000}, step=n)
    writer.flush()
    lines = (tmp_path / "tap-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["n"] for line in lines] == list(range(200))
    assert jsonl._APPENDERS[writer.path].thread.is_alive()
    writer.close()
    assert writer.path not in jsonl._APPENDERS
    # a process that ends without closing: its exit writes what is queued
    script = ("from enginetap.core.jsonl import RankJsonl\n"
              f"w = RankJsonl({str(tmp_path / 'exit.jsonl')!r}, 0, offload=True)\n"
              "for n in range(300):\n    w.write({'n': n, 'pad': 'y' * 20000}, step=n)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    lines = (tmp_path / "exit-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["n"] for line in lines] == list(range(300))


def test_an_offloading_writer_raises_the_write_error_at_its_next_call(tmp_path):
    writer = RankJsonl(tmp_path / "full.jsonl", 0, offload=True)
    jsonl._OPEN[writer.path] = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    try:
        writer.write({"a": 1})
        with pytest.raises(OSError):
            writer.flush()  # the line's error, raised once
        writer.flush()
        writer.write({"a": 2})
        jsonl._APPENDERS[writer.path].flush()  # written (and failed) on the thread
        with pytest.raises(OSError):
            writer.write({"a": 3})  # the next call raises it
    finally:
        jsonl._APPENDERS.pop(writer.path).stop()
        os.close(jsonl._OPEN.pop(writer.path))
