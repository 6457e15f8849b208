"""Run by test_kernels.py in a child with TRITON_INTERPRET=1 (set before Triton loads): the
graphs mode's per-layer kernel (several checkpoints into their buffer slots, one launch)
against the torch reference, on the CPU through Triton's interpreter."""

import torch

from enginetap.tap.record import rowhash
from enginetap.tap.record.fingerprint import hash_rows

g = torch.Generator().manual_seed(0)
rows = 6
parts = [torch.randn(rows, 5120, generator=g).to(torch.bfloat16),  # 2560 words: 5 blocks
         torch.randn(rows, 40, generator=g),
         torch.randn(rows, 1030, generator=g)[:, 2:]]  # a strided view
slots = [3, 0, 5]
index = torch.tensor([5, 0, 2, 2])
buffer = torch.zeros((7, index.numel() + 1), dtype=torch.int64)
entries = [rowhash.entry(t, s) for t, s in zip(parts, slots)]
table = torch.tensor(entries, dtype=torch.int64)
assert table.shape[1] == rowhash.ENTRY
rowhash.hash_slots(buffer, table, len(entries), index, max(e[2] for e in entries))
for t, s in zip(parts, slots):
    assert torch.equal(buffer[s, :-1], hash_rows(t[index])), s
    assert int(buffer[s, -1]) == 1, s
untouched = [s for s in range(buffer.shape[0]) if s not in slots]
assert not buffer[untouched].any(), "slots no entry names stay zero, flags included"
print("rowhash kernels agree")
