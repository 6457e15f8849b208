"""The built-in engine's KV points: where every token row of a decode step is tapped and
the device defers, they are the cache columns hashed in place at step end with the other
deferred checkpoints (no gather, no staging slot, quick steps unchanged); the records are
byte for byte those of the gathered path either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton", reason="Triton is not installed")


def deferred_and_gathered(max_rows: int) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the deferred path on the CPU
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("kv_points_run.py")),
                           str(max_rows)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kv_points(record: dict[str, Any]) -> list[str]:
    return [n for n in record["checkpoints"] if n.endswith((".kv_written", ".kv_prev"))]


@pytest.mark.parametrize("max_rows", [64, 2])
def test_kv_points_deferred_where_every_row_is_tapped_and_records_unchanged(
        max_rows: int) -> None:
    found = deferred_and_gathered(max_rows)
    assert found["tokens_equal"]
    assert found["deferred"] == found["gathered"]  # names, hashes, rows, sampler: all
    decode = [i for i, r in enumerate(found["deferred"]) if r["mode"] == "decode"]
    assert len(decode) == 5 and all(kv_points(found["deferred"][i]) for i in decode)
    assert len(found["hashed_in_place"]) == len(found["deferred"])  # one list per step
    for i in decode:  # step i's deferred names (one hash call per step with any)
        in_place = set(found["hashed_in_place"][i]) & set(kv_points(found["deferred"][i]))
        if max_rows == 64:  # 3 requests, all tapped: the cache columns, where they lie
            assert in_place == set(kv_points(found["deferred"][i])), i
            assert set(found["cache_columns"][i]) == in_place, i
        else:  # 2 of 3 rows tapped: the KV points are gathered into staging slots
            assert in_place == set() and found["cache_columns"][i] == [], i
    assert found["cache_columns"][0] == []  # the prefill's: gathered rows, not columns
    if max_rows == 64:  # decode steps 1-2 verify, 3 settles: 4-5 quick, KV points and all
        assert found["quick"] == 2
