"""`tap report` memory grows with the rows of a tap file, not with pairs of rows: a crafted
290 KB file of 1,400 same-prefix rows in one step (980,000 row pairs, half of them split,
half of the requests sampling another token) is analysed in bounded memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from .tap_helpers import record_tap, tap_lines, write_tap

_MEASURE = r"""
import resource, subprocess, sys
done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", *sys.argv[1:]],
                      capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(done.returncode, peak, repr(done.stderr[-300:]))
"""


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tap_lines(record_tap(tmp_path_factory.mktemp("tap-memory") / "run"))[0]


def _crafted(run: Path, header: dict, rows: int) -> Path:
    names = ["L0.in", "L0.attn.out", "L0.mlp.out", "L0.out"]
    records = [{"key": f"k{i:05d}", "request_id": f"k{i:05d}", "pos": 0,
                "prefix": "0000000000000002", "computed_host": 0} for i in range(rows)]
    hashes = ["".join(("%016x" % (1 + (c == 2 and i % 2))) for i in range(rows))
              for c in range(len(names))]
    step = {"step": 0, "rank": 0, "kind": "step", "mode": "prefill", "rows": records,
            "checkpoints": names, "hashes": hashes,
            "sampler": [{"argmax": 5 + i % 2, "gap": 0.5} for i in range(rows)],
            "sampled": {f"k{i:05d}": 5 + i % 2 for i in range(rows)}}
    write_tap(run, [header, step])
    return run


def _peak_kib(*args: str) -> int:
    done = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    rc, peak, tail = done.stdout.split(" ", 2)
    assert rc in ("0", "1"), tail
    return int(peak)


def test_report_memory_grows_with_rows_not_pairs(header: dict, tmp_path: Path) -> None:
    small = _crafted(tmp_path / "small", header, 100)
    big = _crafted(tmp_path / "big", header, 1400)
    size = (big / "tap-rank0.jsonl").stat().st_size
    assert 250_000 < size < 330_000, size
    base = _peak_kib("tap", "report", str(small))
    for extra in ([], ["--json"], ["--html", str(tmp_path / "page.html")]):
        peak = _peak_kib("tap", "report", str(big), *extra)
        # 14x the rows (200x the row pairs): a few MiB more, not gigabytes
        assert peak - base < 64 << 10, (extra, base, peak)
    assert (tmp_path / "page.html").stat().st_size < 2 << 20


def _brute_force(rank) -> Counter:
    """(step, position, checkpoint) → row pairs first differing there, pair by pair."""
    from itertools import combinations

    from enginetap.tap.compare import comparable, last_of_request

    found: Counter = Counter()
    for step in rank.steps:
        last = last_of_request(step.rows)
        groups: dict = {}
        for i, row in enumerate(step.rows):
            if row["prefix"] is not None:
                groups.setdefault((row["pos"], row["prefix"]), {}).setdefault(row["key"], i)
        for rows in groups.values():
            for i, j in combinations(sorted(rows.values()), 2):
                a, b = step.rows[i], step.rows[j]
                for c, name in enumerate(step.checkpoints):
                    if step.hashes[c][i] != step.hashes[c][j] \
                            and comparable(name, a, b, i in last and j in last):
                        found[(step.step, a["pos"], name)] += 1
                        break
    return found


@pytest.mark.parametrize("model", ["llama", "qwen3_next"])
def test_the_class_analysis_counts_what_pair_by_pair_comparison_counts(
        tmp_path: Path, model: str) -> None:
    """On real runs (qwen3_next: recurrent states compared only between last rows),
    including a run whose rows split: the same first differences, pair for pair."""
    from enginetap.tap.analysis.files import load_run
    from enginetap.tap.analysis.pairs import pair_splits

    prompts = ["the cache holds every key", "kernels and caches", "the cache holds every key",
               "the cache holds every key and more", "kernels and caches", "decode"]
    rank = load_run(record_tap(tmp_path / "run", model, prompts, max_new_tokens=4)).rank(0)
    # a split the engine did not make: one row's hash changed at one checkpoint
    step = rank.steps[2]
    c = len(step.checkpoints) // 2
    step.hashes[c][1] = "f" * 16
    summary = pair_splits(rank)
    expected = _brute_force(rank)
    got: Counter = Counter()
    for s in summary.splits:
        got[(s.step, s.position, s.checkpoint)] += s.pairs
    assert got == +expected and sum(expected.values()) > 0
    assert summary.pairs_split == sum(expected.values())
