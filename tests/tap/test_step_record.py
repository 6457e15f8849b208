"""The step record's text as the recorder builds it (transfer._format): hashes encoded in
numpy passes, sampler rows from their packed words, exactly the line the Python build of
the same record writes (orjson and json, finite and non-finite logits, several devices)."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import torch

from enginetap.core.jsonl import NonFinite, encode_line_bytes
from enginetap.tap.record.transfer import _format


def _reference(head: dict[str, Any], host: list[tuple[list[str], torch.Tensor, int]],
               k: int) -> dict[str, Any]:
    """The record built one Python value at a time (the writer's format, spelled out)."""
    hashes: dict[str, str] = {}
    sampler: list[dict[str, Any]] = []
    for names, flat, extra in host:
        words = flat.tolist()
        for j, name in enumerate(names):
            hashes[name] = "".join(f"{w & (2**64 - 1):016x}" for w in words[j * k:(j + 1) * k])
        if extra:
            tail = words[len(names) * k:]
            sampler = []
            for r in range(k):
                top1, top2 = (struct.unpack("<d", struct.pack("<q", v))[0]
                              for v in tail[r * 4 + 2:r * 4 + 4])
                sampler.append({"argmax": tail[r * 4], "runner_up": tail[r * 4 + 1],
                                "top1": top1, "top2": top2, "gap": top1 - top2})
    return {**head, "hashes": [hashes[n] for n in head["checkpoints"]], "sampler": sampler}


def _packed(logits: list[tuple[float, float]]) -> list[int]:
    out = []
    for r, (a, b) in enumerate(logits):
        out += [r, r + 7, *(struct.unpack("<q", struct.pack("<d", v))[0] for v in (a, b))]
    return out


def _head(order: list[str], k: int) -> dict[str, Any]:
    rows = [{"row": i, "key": f"p{i}", "pos": i + 3} for i in range(k)]
    return {"kind": "step", "mode": "decode", "engine": "transformers", "rows": rows,
            "checkpoints": order, "sampled": {"r0": 5}}


@pytest.mark.parametrize("logits", [[(1.5, -0.25), (3.0, 2.75), (0.0, -0.0)],
                                    [(math.inf, 1.0), (2.0, -math.inf), (1.0, 0.5)]])
@pytest.mark.parametrize("fast", [True, False])
def test_record_line_equals_the_python_build(logits: list[tuple[float, float]],
                                             fast: bool) -> None:
    k = 3
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-2**63, 2**63 - 1, (2 * k,), dtype=torch.int64, generator=gen)
    words[0] = -1  # all bits set, and the sign bit alone: both ends of the hex range
    words[1] = -2**63
    other = torch.randint(-2**63, 2**63 - 1, (k,), dtype=torch.int64, generator=gen)
    # two devices, the second's name first in the step's order; a sampler on the first
    host = [(["a.out", "b.out"], torch.cat([words, torch.tensor(_packed(logits))]), 1),
            (["c.out"], other, 0)]
    head = _head(["c.out", "a.out", "b.out"], k)
    record = _format(dict(head), host, k)
    expected = _reference(dict(head), host, k)
    finite = all(math.isfinite(v) for pair in logits for v in pair)
    assert isinstance(record, NonFinite) is not finite
    line = encode_line_bytes(record, fast and finite)
    assert line == encode_line_bytes(expected, fast and finite)
    assert json.loads(line)["hashes"][1][:32] == "f" * 16 + "8" + "0" * 15


def test_no_checkpoints_and_one_row() -> None:
    head = _head([], 1)
    host: list[tuple[list[str], torch.Tensor, int]] = [([], torch.tensor(_packed([(2.0, 1.0)])), 1)]
    record = _format(dict(head), host, 1)
    assert encode_line_bytes(record, True) == encode_line_bytes(_reference(head, host, 1), True)
    assert json.loads(encode_line_bytes(record, True))["hashes"] == []
