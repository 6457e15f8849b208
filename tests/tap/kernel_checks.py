"""Run by test_kernels.py in a child with TRITON_INTERPRET=1 (set before Triton loads):
the Triton kernels against the torch reference, on the CPU through Triton's interpreter."""

import torch

from enginetap.tap.record import kernels
from enginetap.tap.record.fingerprint import fingerprint, hash_rows
from enginetap.tap.record.staging import StepStaging

g = torch.Generator().manual_seed(0)
assert kernels.available(torch.zeros(1)), "the interpreter should make the kernels run"
for rows in (torch.randn(4, 3, 70, generator=g).to(torch.bfloat16),
             torch.randn(6, 1030, generator=g),
             torch.arange(21, dtype=torch.uint8).view(3, 7)):
    flat = rows.reshape(-1, rows.shape[-1])
    assert torch.equal(kernels.hash_rows_kernel(rows).flatten(), hash_rows(flat)), rows.dtype

x = torch.randn(kernels.CHUNK_WORDS * 2 + 37, generator=g)
whole = kernels.fingerprint_tensor(x)
assert whole == int(hash_rows(x.view(1, -1))[0])
kernels_off = kernels.triton
kernels.triton = None  # the torch path, chunked at another size, agrees
assert fingerprint(x, chunk=1000) == whole
kernels.triton = kernels_off
flipped = x.clone()
flipped.view(torch.int32)[kernels.CHUNK_WORDS + 5] ^= 1 << 30
swapped = x.clone()
swapped[[3, 4]] = swapped[[4, 3]]
assert len({whole, kernels.fingerprint_tensor(flipped), kernels.fingerprint_tensor(swapped)}) == 3

staging = StepStaging(2, torch.device("cpu"))
staging.reset(2)
staging.stage(torch.randn(5, 64, generator=g).to(torch.bfloat16), torch.tensor([4, 1]))
assert staging.hashes().shape == (1, 2)
# rows of several tensors read in place through a pointer table (deferred checkpoints)
parts = [torch.randn(9, 96, generator=g).to(torch.bfloat16), torch.randn(9, 40, generator=g),
         torch.randn(9, 130, generator=g)[:, 2:]]  # a strided view: row stride 130 floats
index = torch.tensor([8, 0, 3])
table = torch.tensor([(t.data_ptr(), t.stride(0) * t.element_size() // 4,
                       t.shape[1] * t.element_size() // 4, 1, 0, 0) for t in parts]
                     ).t().contiguous()
got = kernels.hash_table_rows(table, index, 128)
assert torch.equal(got, torch.stack([hash_rows(t[index]) for t in parts]))


def gathered(keys: torch.Tensor, values: torch.Tensor, column: int,
             rows: torch.Tensor) -> torch.Tensor:
    """The gathered KV row: every head's key at ``column``, then every head's value."""
    n = rows.numel()
    return torch.cat([keys[rows, :, column].reshape(n, -1),
                      values[rows, :, column].reshape(n, -1)], 1)


# KV cache columns read in place as pieces: each head's dim of K, then each head's of V,
# with their word offsets in the row; beside ordinary entries (wider and narrower) in the
# same table, written and previous column, contiguous and strided (a static cache's
# longer allocation) caches, bf16 and float32, rows in any order.
for dtype, heads, dim in ((torch.bfloat16, 3, 8), (torch.float32, 2, 5), (torch.bfloat16, 4, 2)):
    size = torch.tensor([], dtype=dtype).element_size()
    for capacity in (7, 11):
        keys = torch.randn(5, heads, capacity, dim, generator=g).to(dtype)[:, :, :7]
        values = torch.randn(5, heads, capacity, dim, generator=g).to(dtype)[:, :, :7]
        plain = torch.randn(5, 70, generator=g)
        index = torch.tensor([4, 0, 2, 1])
        s0, s1, s2, _ = (x * size // 4 for x in keys.stride())
        entries, want = [], []
        for column in (6, 5, 0):
            at = column * keys.stride(2) * size
            entries.append((keys.data_ptr() + at, s0, dim * size // 4, heads, s1,
                            values.data_ptr() + at))
            want.append(hash_rows(gathered(keys, values, column, index)))
        entries.append((keys.data_ptr() + 6 * keys.stride(2) * size, s0, dim * size // 4,
                        heads, s1, 0))  # no second piece: the keys alone
        want.append(hash_rows(keys[index, :, 6].reshape(4, -1)))
        entries.append((plain.data_ptr(), 70, 70, 1, 0, 0))
        want.append(hash_rows(plain[index]))
        table = torch.tensor(entries).t().contiguous()
        widest = max(70, heads * dim * size // 4)
        got = kernels.hash_table_rows(table, index, widest)
        assert torch.equal(got, torch.stack(want)), (dtype, heads, dim, capacity)

# ... and through the deferred state's table: kept cache columns among ordinary tensors,
# the table put in another order (arrange), every row hashed as its gathered row is
from enginetap.tap.record.deferred import DeferredHashes, cache_layout  # noqa: E402

keys = torch.randn(3, 2, 9, 16, generator=g).to(torch.bfloat16)
values = torch.randn(3, 2, 9, 16, generator=g).to(torch.bfloat16)
hidden = torch.randn(3, 1, 24, generator=g)
assert cache_layout(keys, values)
assert not cache_layout(keys, values.transpose(1, 2).contiguous().transpose(1, 2))
assert not cache_layout(keys[..., :3], values[..., :3])  # 6-byte runs: not whole words
deferred = DeferredHashes(torch.device("cpu"), budget=1 << 20)
deferred.reset("decode", 1)
rows = torch.arange(3)
assert deferred.keep_cache(["kv_written"], keys, values, (8,), rows=3) == [0]
assert deferred.keep("hidden", hidden, words=24, nbytes=hidden.nbytes) == 1
assert deferred.keep_cache(["kv_prev"], keys, values, (7,), rows=3) == [2]
assert deferred.held == hidden.nbytes + 2 * 3 * 2 * 2 * 16 * 2  # the bytes hashed
deferred.arrange([1, 2, 0])
assert deferred.names == ["hidden", "kv_prev", "kv_written"]
got = deferred.hashes(rows)
assert deferred.hashed_bytes == deferred.held
assert torch.equal(got, torch.stack([hash_rows(hidden.view(3, -1)),
                                     hash_rows(gathered(keys, values, 7, rows)),
                                     hash_rows(gathered(keys, values, 8, rows))]))
# a demoted name, or one over the byte budget, is not kept
deferred.reset("decode", 2)
deferred.demoted["kv_prev"] = "test"
assert deferred.keep_cache(["kv_written", "kv_prev"], keys, values, (8, 7), rows=3) == [0, -1]
assert not deferred.spent and deferred.names == ["kv_written"]
small = DeferredHashes(torch.device("cpu"), budget=400)  # one column's 384 bytes fit
small.reset("decode", 1)
assert small.keep_cache(["kv_written", "kv_prev"], keys, values, (8, 7), rows=3) == [0, -1]
assert small.spent and small.held == 384
print("kernels agree")
