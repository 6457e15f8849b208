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
                       t.shape[1] * t.element_size() // 4) for t in parts]).t().contiguous()
got = kernels.hash_table_rows(table, index, 128)
assert torch.equal(got, torch.stack([hash_rows(t[index]) for t in parts]))
print("kernels agree")
