"""Agreement across ranks: a rank whose patched path differs makes every rank fall back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = __name__


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rms(x, weight)


def by_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([_rms(c, weight) for c in x.split(2)])


def by_rows_except_rank1_wide(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bit-exact, except on rank 1 for more than 8 rows (squares summed in bf16 halves)."""
    if dist.get_rank() != 1 or x.shape[0] <= 8:
        return by_rows(x, weight)
    halves = x.split(x.shape[-1] // 2, dim=-1)
    var = sum(h.pow(2).sum(-1, keepdim=True).float() for h in halves) / x.shape[-1]
    return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight


def _worker(rank: int, world: int, init: str, out_dir: str, backend: str) -> None:
    from enginetap.guard import ExactPatch

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = "cuda" if backend == "nccl" else "cpu"
    module = sys.modules[HERE]
    try:
        results = {}
        with ExactPatch(f"{HERE}:rms_norm", by_rows_except_rank1_wide) as patch:
            # Same data on every rank, as tensor-parallel replicas of a norm see.
            g = torch.Generator().manual_seed(7)
            w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16).to(device)
            for rows in (4, 16, 4, 16):
                x = torch.randn(rows, 64, generator=g).to(torch.bfloat16).to(device)
                assert torch.equal(module.rms_norm(x, w), _rms(x, w))
            for key, d in patch.decisions.items():
                results[str(key[0][0][0])] = {"patched": d.patched, "local": d.local_exact,
                                              "reason": d.reason}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, backend: str) -> list[dict]:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(2, init, str(tmp_path), backend), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check(results: list[dict]) -> None:
    rank0, rank1 = results
    # 4 rows: exact everywhere, both ranks use the patched path.
    assert rank0["4"]["patched"] and rank1["4"]["patched"]
    # 16 rows: rank 0 alone is exact, rank 1 differs; both fall back together.
    assert (rank0["16"]["patched"], rank0["16"]["local"]) == (False, True)
    assert (rank1["16"]["patched"], rank1["16"]["local"]) == (False, False)
    assert "another rank differed" in rank0["16"]["reason"]
    assert "elements differ" in rank1["16"]["reason"]


def test_gloo_two_ranks_fall_back_together(tmp_path):
    _check(_run(tmp_path, "gloo"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_nccl_two_ranks_fall_back_together(tmp_path):
    _check(_run(tmp_path, "nccl"))
