"""The Triton fingerprint kernels compute the torch reference's hash bit for bit: on the
CPU through Triton's interpreter (CI), on CUDA where there is one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginetap.tap.record.fingerprint import fingerprint, hash_rows

triton = pytest.importorskip("triton", reason="Triton is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernels are "
                    "checked on the device (the tests below); Triton 3.6's interpreter there "
                    "fails on kernels Triton 3.9's runs")
@pytest.mark.parametrize(("checks", "agreed"), [
    ("kernel_checks.py", "kernels agree"),
    ("rowhash_checks.py", "rowhash kernels agree"),  # the graphs mode's per-layer kernel
])
def test_kernels_equal_the_reference_in_the_interpreter(checks: str, agreed: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(checks))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert agreed in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_cuda_equal_the_cpu_reference() -> None:
    from enginetap.tap.record.kernels import hash_rows_kernel

    x = torch.randn(3, 64, 5120).to(torch.bfloat16)
    got = hash_rows_kernel(x.cuda()).cpu()
    assert torch.equal(got.flatten(), hash_rows(x.reshape(-1, 5120)))
    big = torch.randn(3_000_001)
    assert fingerprint(big.cuda()) == fingerprint(big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pointer_table_kernel_on_cuda_equals_the_cpu_reference() -> None:
    from enginetap.tap.record.kernels import hash_table_rows

    parts = [torch.randn(70, 5120).to(torch.bfloat16), torch.randn(70, 8),
             torch.randn(70, 1030)[:, 6:]]
    index = torch.tensor([69, 3, 3, 0])
    on = [t.cuda() if t.is_contiguous() else t.cuda().contiguous()[:, :] for t in parts]
    on[2] = torch.randn(70, 1030).cuda()[:, 6:]
    on[2].copy_(parts[2].cuda())
    table = [(t.data_ptr(), t.stride(0) * t.element_size() // 4,
              t.shape[1] * t.element_size() // 4, 1, 0, 0) for t in on]
    # a KV cache column (8 heads of 128 bf16: 64-word runs, a longer static allocation),
    # every head's key then every head's value
    keys = torch.randn(70, 8, 40, 128).to(torch.bfloat16)
    values = torch.randn(70, 8, 40, 128).to(torch.bfloat16)
    cache_k = torch.zeros(70, 8, 64, 128, dtype=torch.bfloat16).cuda()[:, :, :40]
    cache_v = torch.zeros(70, 8, 64, 128, dtype=torch.bfloat16).cuda()[:, :, :40]
    cache_k.copy_(keys.cuda())
    cache_v.copy_(values.cuda())
    at = 39 * cache_k.stride(2) * 2
    table.append((cache_k.data_ptr() + at, cache_k.stride(0) // 2, 64, 8,
                  cache_k.stride(1) // 2, cache_v.data_ptr() + at))
    got = hash_table_rows(torch.tensor(table).t().contiguous().cuda(), index.cuda(), 2560).cpu()
    kv = torch.cat([keys[index, :, 39].reshape(4, -1), values[index, :, 39].reshape(4, -1)], 1)
    assert torch.equal(got, torch.stack([*(hash_rows(t[index]) for t in parts),
                                         hash_rows(kv)]))
