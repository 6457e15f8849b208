"""Attention contracts: what a declared output that an engine does not expose becomes
(receipt and replay report say so), and what ``mla_paged_prefill`` says about its edge cases
(L, requests without pages or queries, n > L, kv_last_page_len), checked on its reference."""

from __future__ import annotations

import math

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.definitions import compile_reference, get_template
from enginetap.replay.render import unexposed_lines
from enginetap.replay.results import NOT_EXPOSED
from enginetap.replay.runner import replay_dataset
from tests.capture.hf_capture_helpers import capture_run, hf_capture_root  # noqa: F401

_NOTE = "not exposed by this engine"


def test_lse_the_built_in_engine_does_not_expose_is_named_in_receipt_and_report(
        hf_capture_root):
    run = capture_run("qwen3_next", hf_capture_root)
    dataset = Dataset(run.dataset)
    attention = [n for n in dataset.definitions() if n.startswith("gqa_")]
    assert attention
    for name in attention:
        for line in dataset.workloads(name):
            assert line.enginetap.receipt.notes["not_exposed"] == {"lse": _NOTE}
            assert set(dataset.load_outputs(line)) == {"output"}
    moe = [n for n in dataset.definitions() if n.startswith("moe_")]
    for name in moe:  # every declared output stored: nothing to declare
        assert all(line.enginetap.receipt.notes["not_exposed"] == {}
                   for line in dataset.workloads(name))
    report = replay_dataset(run.dataset, definitions=attention + moe[:1], warmup=0,
                            repeats=0)
    assert report.ok
    lines = unexposed_lines(report)
    assert sorted(line.split(":")[0] for line in lines) == sorted(f"NOTE {n}"
                                                                  for n in attention)
    replayed = sorted((d for d in report.definitions if d.name in attention),
                      key=lambda d: d.name)
    for result, line in zip(replayed, sorted(lines), strict=True):
        assert f"output lse {_NOTE} in {len(result.workloads)} of " \
               f"{len(result.workloads)} workload(s)" in line
        lse = [c for w in result.workloads for c in w.checks if c.output == "lse"]
        assert lse and all(c.message == NOT_EXPOSED and c.comparison is None for c in lse)


# ---------------------------------------------------------------- mla_paged_prefill edges
_PAGE = 4


def _prefill():
    definition = get_template("mla_paged_prefill").instantiate(
        num_qo_heads=2, head_dim_ckv=16, head_dim_kpe=8, page_size=_PAGE, dtype="float32")
    return compile_reference(definition.reference, definition.name)


def _inputs(queries: list[int], pages: list[int], last: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total_q, used = sum(queries), sum(pages)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def offsets(counts):
        return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)

    return {"q_nope": randn(total_q, 2, 16), "q_pe": randn(total_q, 2, 8),
            "ckv_cache": randn(used + 2, _PAGE, 16), "kpe_cache": randn(used + 2, _PAGE, 8),
            "qo_indptr": offsets(queries), "kv_indptr": offsets(pages),
            "kv_indices": torch.randperm(used + 2, generator=gen)[:used].to(torch.int32),
            "kv_last_page_len": torch.tensor(last, dtype=torch.int32), "sm_scale": 0.2}


def _float64(inputs, b: int):
    """Request ``b`` from the description alone: L = (P - 1) * page_size + last; query i
    attends tokens 0 .. L - n + i; lse in base 2."""
    qo, kv = inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist()
    n, pages = qo[b + 1] - qo[b], inputs["kv_indices"][kv[b]:kv[b + 1]].long()
    length = (len(pages) - 1) * _PAGE + int(inputs["kv_last_page_len"][b])
    ckv = inputs["ckv_cache"][pages].reshape(-1, 16)[:length].double()
    kpe = inputs["kpe_cache"][pages].reshape(-1, 8)[:length].double()
    out, lse = [], []
    for i in range(n):
        row = qo[b] + i
        keys = slice(0, length - n + i + 1)
        logits = (inputs["q_nope"][row].double() @ ckv[keys].T
                  + inputs["q_pe"][row].double() @ kpe[keys].T) * inputs["sm_scale"]
        out.append(torch.softmax(logits, -1) @ ckv[keys])
        lse.append(torch.logsumexp(logits, -1) / math.log(2))
    return torch.stack(out), torch.stack(lse)


def test_prefill_reference_follows_the_described_l_and_causal_window():
    # Request 1 has no queries and no pages; request 2 has no queries but pages (and a
    # kv_last_page_len that would be invalid if it were read); request 3 has n == L.
    inputs = _inputs(queries=[5, 0, 0, 3, 2], pages=[3, 0, 1, 1, 2],
                     last=[2, 0, 0, 3, _PAGE])
    output, lse = _prefill()(**inputs)
    qo = inputs["qo_indptr"].tolist()
    for b in (0, 3, 4):
        want_out, want_lse = _float64(inputs, b)
        torch.testing.assert_close(output[qo[b]:qo[b + 1]].double(), want_out,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[qo[b]:qo[b + 1]].double(), want_lse,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("queries", "pages", "last", "message"), [
    ([2], [0], [1], "need pages"),                     # a request with queries has pages
    ([3], [1], [0], "kv_last_page_len 0"),             # 1..page_size
    ([3], [1], [_PAGE + 1], "kv_last_page_len 5"),
    ([6], [1], [_PAGE], "6 queries but only 4 tokens"),  # n > L
])
def test_prefill_reference_refuses_what_the_description_calls_invalid(queries, pages, last,
                                                                       message):
    with pytest.raises(ValueError, match=message):
        _prefill()(**_inputs(queries, pages, last))


def test_prefill_description_defines_every_term_it_uses():
    text = get_template("mla_paged_prefill").description
    for phrase in ("L = (P - 1) * page_size + kv_last_page_len[b]", "tokens 0 .. L - n + i",
                   "n <= L", "kv_last_page_len[b] in 1..page_size", "no queries (n = 0",
                   "replay reports lse as not exposed by this engine"):
        assert phrase in text, phrase
    assert "(no lse)" not in text
