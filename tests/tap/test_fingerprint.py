"""Staged row hashes equal the per-row reference and see every byte, in order."""

from __future__ import annotations

import pytest
import torch

from enginetap.tap.record.fingerprint import hash_rows, row_bytes, token_rows
from enginetap.tap.record.staging import StepStaging


def _staged(tensors: list[torch.Tensor], index: torch.Tensor, rows: int) -> torch.Tensor:
    staging = StepStaging(len(index), torch.device("cpu"))
    staging.reset(len(index))
    for t in tensors:
        source = token_rows(t, rows)
        assert source is not None
        staging.stage(source, index)
    return staging.hashes()


def test_staged_hashes_equal_the_reference_for_mixed_widths_and_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(12, 6, generator=g).to(torch.bfloat16),
               torch.randn(3, 4, 5, generator=g),
               torch.arange(36, dtype=torch.uint8).view(12, 3),
               torch.randint(0, 9, (12, 2), generator=g)]
    index = torch.tensor([11, 3, 7])
    staged = _staged(tensors, index, 12)
    for slot, t in enumerate(tensors):
        source = token_rows(t, 12)
        assert source is not None
        assert torch.equal(staged[slot], hash_rows(source[index]))
    assert len(set(staged.flatten().tolist())) == staged.numel()


def test_hash_sees_one_bit_word_order_and_signed_zero() -> None:
    x = torch.randn(2, 64)
    base = hash_rows(row_bytes(x, 2))
    flipped = x.clone()
    flipped.view(torch.int32)[1, 17] ^= 1
    assert hash_rows(row_bytes(flipped, 2))[1] != base[1]
    assert hash_rows(row_bytes(flipped, 2))[0] == base[0]
    swapped = x.clone()
    swapped[0, [3, 4]] = x[0, [4, 3]]
    assert hash_rows(row_bytes(swapped, 2))[0] != base[0]
    zeros = torch.zeros(1, 4)
    assert hash_rows(row_bytes(zeros, 1)) != hash_rows(row_bytes(-zeros, 1))


def test_tensors_without_token_rows_are_skipped_and_staging_is_reused() -> None:
    assert row_bytes(torch.zeros(5, 3), 4) is None
    assert row_bytes(torch.zeros(2, 2, 3), 4) is not None
    index = torch.tensor([0, 1])
    staging = StepStaging(2, torch.device("cpu"))
    for slots in (3, 20, 3):  # grows past its first capacity, then reuses the buffer
        staging.reset(2)
        sources = [torch.full((2, 5), float(i)) for i in range(slots)]
        for source in sources:
            staging.stage(source, index)
        staging.stage(torch.ones(2, 3, dtype=torch.bool).view(torch.uint8), None)
        hashes = staging.hashes()
        assert hashes.shape == (slots + 1, 2)
        assert all(torch.equal(hashes[i], hash_rows(s)) for i, s in enumerate(sources))
        assert torch.equal(hashes[-1], hash_rows(torch.ones(2, 3, dtype=torch.uint8)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_hashes_on_cuda_equal_the_cpu_reference() -> None:
    x = torch.randn(64, 5120, dtype=torch.bfloat16)
    index = torch.arange(0, 64, 2)
    staging = StepStaging(len(index), torch.device("cuda"))
    staging.reset(len(index))
    staging.stage(x.cuda(), index.cuda())
    staging.stage(x[:, :7].float().cuda(), index.cuda())
    got = staging.hashes().cpu()
    assert torch.equal(got[0], hash_rows(x[index]))
    assert torch.equal(got[1], hash_rows(x[:, :7].float()[index]))


def test_per_request_slots_give_each_row_its_requests_hash() -> None:
    staging = StepStaging(3, torch.device("cpu"))
    staging.reset(3, inverse=torch.tensor([0, 0, 1]))  # rows 0, 1 of request 0; row 2 of 1
    rows = torch.randn(3, 4)
    states = torch.randn(2, 4, 4)
    staging.stage(rows, torch.arange(3))
    staging.stage_per_request(states.view(2, -1))
    hashes = staging.hashes()
    per_request = hash_rows(states.view(2, -1))
    assert torch.equal(hashes[0], hash_rows(rows))
    assert hashes[1].tolist() == [per_request[0], per_request[0], per_request[1]]
    assert torch.equal(staging.view_of(1), states.view(2, -1)[[0, 0, 1]])
