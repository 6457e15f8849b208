"""Capture under tensor parallelism (TP=2) on vLLM CPU: the logical operators are rebuilt
on rank 0 from every rank's shards (attention heads, MoE intermediate shards and partial
outputs, gated-delta-rule heads) and replay against the references like TP=1 captures.

qwen3_next covers attention, MoE router and experts and the gated delta rule in one model
(its norms are Gemma-style, which no rmsnorm family describes).
``VLLM_CPU_OMP_THREADS_BIND=nobind``: two CPU workers on one NUMA node.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from vllm_capture_checks import (  # noqa: E402
    const_axes,
    families,
    receipts,
    replay_failures,
    run_capture,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tp_run(vllm_lock: None, tmp_path_factory: pytest.TempPathFactory):
    from enginetap.models import build_model

    return run_capture(build_model("qwen3_next"), tmp_path_factory.mktemp("tp2"), tp=2)


def test_rank0_writes_the_logical_operators_and_they_replay(tp_run):
    wanted = {"gqa_ragged_prefill", "gqa_paged_decode", "moe_topk_softmax",
              "moe_experts_swiglu", "gdn_prefill", "gdn_decode"}
    assert wanted <= families(tp_run.dataset)
    _, failures = replay_failures(tp_run.dataset)
    assert not failures, "\n".join(failures)
    # The whole model's sizes, not one rank's half. The page size is vLLM's choice: CPU
    # attention pages in multiples of 32 tokens, and a hybrid model's attention page grows
    # to hold one gated-delta state page, whose bytes follow the state pool's dtype (160
    # tokens with a float32 pool, on CPUs with AVX-512 BF16; 96 with the bf16 pool vLLM
    # keeps elsewhere, e.g. AMD EPYC's AVX2).
    bf16_pool = all("state pool in bfloat16" in str(r["notes"])
                    for r in receipts(tp_run.dataset, "gdn_decode"))
    axes = const_axes(tp_run.dataset, "gqa_paged_decode")
    assert axes.pop("page_size") == (96 if bf16_pool else 160)
    assert axes == {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    assert const_axes(tp_run.dataset, "gdn_decode") == {"num_qk_heads": 2, "num_v_heads": 4,
                                                        "head_size": 64}
    assert const_axes(tp_run.dataset, "moe_experts_swiglu")["intermediate_size"] == 64


def test_every_rank_took_part_and_only_rank0_wrote(tp_run):
    ranks = [tp_run.summary(r) for r in (0, 1)]
    assert [s["world_size"] for s in ranks] == [2, 2]
    assert all(s["probe_failures"] == {} and s["disabled_probes"] == {} for s in ranks), ranks
    assert ranks[0]["written"] > 0 and ranks[1]["written"] == 0
    assert not (tp_run.out / "dataset-rank1").exists()


def test_receipts_say_how_shards_were_joined(tp_run):
    for family in ("gqa_paged_decode", "moe_experts_swiglu", "gdn_prefill"):
        found = [str(r["notes"]) for r in receipts(tp_run.dataset, family)]
        assert found and all("TP=2" in n for n in found), family
    assert all(r["world_size"] == 2 for r in receipts(tp_run.dataset, "gdn_decode"))
