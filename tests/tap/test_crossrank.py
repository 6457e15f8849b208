"""Replicated checkpoints are compared rank to rank; shards are not."""

from __future__ import annotations

import json
from pathlib import Path

from enginetap.tap.analysis.crossrank import compare_ranks
from enginetap.tap.analysis.files import load_run
from enginetap.tap.analysis.report import analyse, summary

from .conftest import Recorder, requests


def _as_two_ranks(run_dir: Path, edit) -> None:
    """Rank 1 = rank 0's records with ``edit(record)`` applied; both headers say TP=2."""
    lines = [json.loads(x) for x in (run_dir / "tap-rank0.jsonl").read_text().splitlines()]
    lines[0]["world_size"] = 2
    (run_dir / "tap-rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    other = [dict(x, rank=1) for x in lines]
    for record in other[1:]:
        edit(record)
    (run_dir / "tap-rank1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in other))


def _flip(record: dict, step: int, checkpoint: str, key: str) -> None:
    if record["step"] != step:
        return
    c = record["checkpoints"].index(checkpoint)
    i = next(i for i, r in enumerate(record["rows"]) if r["key"] == key)
    packed = record["hashes"][c]  # one hex string, 16 digits per row
    flipped = f"{int(packed[16 * i:16 * i + 16], 16) ^ 1:016x}"
    record["hashes"][c] = packed[:16 * i] + flipped + packed[16 * i + 16:]


def test_a_replicated_checkpoint_that_differs_is_named(record: Recorder, tmp_path: Path) -> None:
    out = tmp_path / "tp"
    record("llama", requests(["kernels and caches", "decode"], max_new_tokens=3), out=out)
    assert compare_ranks(load_run(out)) == []

    def edit(r: dict) -> None:
        _flip(r, 2, "L1.in", "r1")        # replicated: must be reported
        _flip(r, 1, "L0.attn.kv_written", "r0")  # a shard under TP: not compared

    _as_two_ranks(out, edit)
    run = load_run(out)
    (found,) = compare_ranks(run)
    r1 = next(r for r in run.rank(0).steps[2].rows if r["key"] == "r1")
    assert (found.step, found.checkpoint, found.key, found.position, found.ranks) == (
        2, "L1.in", "r1", r1["pos"], [1])
    assert any("L1.in request r1" in line for line in summary(analyse(run)))


def test_runs_of_other_tp_sizes_are_diffed_on_what_is_whole_on_every_rank(
        record: Recorder, tmp_path: Path) -> None:
    import shutil

    from enginetap.tap.analysis.diff import diff_runs

    record("llama", requests(["kernels and caches", "decode"], max_new_tokens=3),
           out=tmp_path / "tp1")
    shutil.copytree(tmp_path / "tp1", tmp_path / "tp2")
    path = tmp_path / "tp2" / "tap-rank0.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines[1:]:
        _flip(line, 2, "L1.out", "r1")  # both ranks: whole, and unlike the TP=1 run
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _as_two_ranks(tmp_path / "tp2", lambda r: _flip(r, 1, "L0.attn.kv_written", "r0"))
    (result,) = diff_runs(load_run(tmp_path / "tp1"), load_run(tmp_path / "tp2"))
    assert result.merged == (1, 2)
    # the shard that differs rank to rank is left out; the whole checkpoint is named
    assert dict(result.by_checkpoint) == {"L1.out": 1}
    assert result.first is not None and (result.first.key, result.first.step_a,
                                         result.first.checkpoint) == ("r1", 2, "L1.out")
