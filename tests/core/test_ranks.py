"""Ranks: discovery, agreement and shard gathering on a real 2-process gloo group; merging
per-rank files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from enginetap.core.ranks import (
    agree,
    gather_shards,
    merge_rank_files,
    rank_files,
    rank_path,
    rank_world,
)
from enginetap.errors import EnginetapError

# Each rank takes its slice of one seeded tensor; the slices have unequal lengths.
WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from enginetap.core.ranks import agree, gather_shards, rank_world, set_group_resolver

    out, backend = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank, world = rank_world()
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    full = torch.randn(9, 6, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    full = full.to(device)
    bounds = [0, 2, 9]  # rank 0 holds 2 rows / columns, rank 1 holds 7 (or 4 of 6 columns)
    rows = full[bounds[rank]:bounds[rank + 1]]
    cols = full[:, [0, 2, 6][rank]:[0, 2, 6][rank + 1]]
    flags = full[bounds[rank]:bounds[rank + 1]] > 0
    results = {
        "rows_on_0": gather_shards(rows, 0),
        "cols_on_1": gather_shards(cols, -1, dst=1),
        "flags_on_0": gather_shards(flags, 0),
    }
    try:
        gather_shards(torch.zeros(2, rank + 3, device=device), 0)
    except ValueError as exc:
        mismatch = str(exc)
    subgroup = dist.new_group([0, 1])
    set_group_resolver(lambda: subgroup)
    facts = {
        "rank_world": rank_world(),
        "agree_all": agree(True),
        "agree_one_false": agree(rank == 0),
        "mismatch": mismatch,
        "on_this_rank": sorted(k for k, v in results.items() if v is not None),
    }
    save_file({k: v.cpu().contiguous() for k, v in results.items() if v is not None},
              os.path.join(out, f"gathered-rank{rank}.safetensors"))
    with open(os.path.join(out, f"facts-rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    if rank == 0:
        save_file({"full": full.cpu()}, os.path.join(out, "full.safetensors"))
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs two CUDA devices")


@pytest.fixture(scope="module",
                params=["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, _TWO_GPUS])])
def group_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both ranks' results of WORKER under a real 2-process group of this backend."""
    out = tmp_path_factory.mktemp(request.param)
    script = out / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(script), str(out), request.param],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, log.decode()[-3000:]
    return out


def test_gather_rebuilds_unequal_shards_on_dst_only(group_run: Path):
    full = load_file(group_run / "full.safetensors")["full"]
    on_0 = load_file(group_run / "gathered-rank0.safetensors")
    on_1 = load_file(group_run / "gathered-rank1.safetensors")
    assert sorted(on_0) == ["flags_on_0", "rows_on_0"] and sorted(on_1) == ["cols_on_1"]
    assert on_0["rows_on_0"].dtype == torch.bfloat16
    assert torch.equal(on_0["rows_on_0"], full)
    assert torch.equal(on_1["cols_on_1"], full)
    assert torch.equal(on_0["flags_on_0"], full > 0)


def test_agree_and_rank_world_in_a_resolved_group(group_run: Path):
    facts = [json.loads((group_run / f"facts-rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["rank_world"] for f in facts] == [[0, 2], [1, 2]]
    assert all(f["agree_all"] is True for f in facts)
    assert all(f["agree_one_false"] is False for f in facts)
    assert all("differ outside dim 0" in f["mismatch"] for f in facts)


def test_single_process_fallbacks(monkeypatch: pytest.MonkeyPatch):
    shard = torch.randn(3, 4)
    assert gather_shards(shard, 1) is shard
    assert agree(True) and not agree(False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert rank_world() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_world() == (3, 4)


def _write_rank(path: Path, rank: int, steps: list[int]) -> None:
    with rank_path(path, rank).open("w") as f:
        for i, step in enumerate(steps):
            f.write(json.dumps({"step": step, "rank": rank, "i": i}) + "\n")


def test_merge_orders_by_step_then_rank(tmp_path: Path):
    base = tmp_path / "steps.jsonl"
    _write_rank(base, 1, [0, 1, 1, 3])
    _write_rank(base, 0, [0, 2, 3])
    _write_rank(base, 10, [1])
    (tmp_path / "steps-rankX.jsonl").write_text("not a rank file\n")
    assert list(rank_files(base)) == [0, 1, 10]
    merged = merge_rank_files(base)
    lines = [json.loads(line) for line in merged.read_text().splitlines()]
    assert [(r["step"], r["rank"], r["i"]) for r in lines] == [
        (0, 0, 0), (0, 1, 0), (1, 1, 1), (1, 1, 2), (1, 10, 0), (2, 0, 1), (3, 0, 2), (3, 1, 3)]


def test_merge_refuses_missing_unordered_and_stepless(tmp_path: Path):
    base = tmp_path / "steps.jsonl"
    with pytest.raises(EnginetapError, match="no per-rank files"):
        merge_rank_files(base)
    _write_rank(base, 0, [2, 1])
    with pytest.raises(EnginetapError, match="step 1 after step 2"):
        merge_rank_files(base, tmp_path / "merged.jsonl")
    assert not (tmp_path / "merged.jsonl").exists()
    rank_path(base, 0).write_text('{"rank": 0}\n')
    with pytest.raises(EnginetapError, match="no integer 'step'"):
        merge_rank_files(base)
