"""Capture from the built-in engine: every workload replays against its reference, armed
runs give the disarmed tokens, flashinfer-bench reads the dataset, and every family the
catalog lists for a model is captured (or its absence is explained here)."""

from __future__ import annotations

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.definitions.catalog import definitions_for_config
from enginetap.replay.runner import replay_dataset
from tests.capture.hf_capture_helpers import capture_run, hf_capture_root, workload_lines

__all__ = ["hf_capture_root"]

MODELS = ["llama", "qwen3_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "deepseek_v32"]

NOT_CAPTURED = {
    # transformers adds the residual and normalizes in two separate calls: no fused op runs.
    "fused_add_rmsnorm": "transformers has no fused add + RMSNorm",
}
NOT_CAPTURED_BY_MODEL = {
    # DeepSeek-V3.2 attends only the indexer's picks: dense MLA decode is not what it runs
    # (its attention is captured as dsa_sparse_mla).
    ("deepseek_v32", "mla_paged_decode"): "V3.2 runs sparse MLA, captured as dsa_sparse_mla",
}


INPUTS_ONLY = {
    # transformers computes MLA un-absorbed: the engine never produces the latent output
    # these definitions describe. Capture stores their inputs only (each capture checks
    # them against the layer's real output first), so replay has nothing to compare and
    # says so: "nothing compared" is never a PASS.
    "mla_paged_decode", "dsa_sparse_mla",
}


def _family(definition) -> str:
    return next(t.split("=", 1)[1] for t in definition.tags
                if t.startswith("enginetap:family="))


@pytest.mark.parametrize("model", MODELS)
def test_every_captured_workload_replays(model, hf_capture_root):
    run = capture_run(model, hf_capture_root)
    assert run.summary["probe_failures"] == {}, run.summary["disabled_probes"]
    assert run.summary["written"] > 0
    declined = {k: v for k, v in run.summary["skipped"].items() if "declined" in k}
    assert declined == {}
    report = replay_dataset(run.dataset, warmup=0, repeats=0)
    assert report.problems == []
    families = {n: _family(d) for n, d in Dataset(run.dataset).definitions().items()}
    inputs_only = [d for d in report.definitions if families[d.name] in INPUTS_ONLY]
    for result in inputs_only:
        messages = {c.message for w in result.workloads for c in w.checks}
        assert len(messages) == 1 and next(iter(messages)).startswith("nothing compared")
    bad = {d.name: [(w.uuid, w.message, [(c.output, c.message) for c in w.checks
                                          if c.status != "PASS"])
                    for w in d.workloads if w.status != "PASS"]
           for d in report.definitions if d.status != "PASS" and d not in inputs_only}
    assert bad == {}
    assert sum(len(d.workloads) for d in report.definitions) == run.summary["written"]


@pytest.mark.parametrize("model", MODELS)
def test_armed_and_disarmed_tokens_are_identical(model, hf_capture_root):
    run = capture_run(model, hf_capture_root)
    assert run.armed_tokens == run.disarmed_tokens
    assert all(run.armed_tokens)
    # Disarming put the kernel the attention probes wrap back as it was.
    assert type(torch.nn.functional.scaled_dot_product_attention).__name__ == \
        "builtin_function_or_method"


@pytest.mark.parametrize("model", MODELS)
def test_every_catalog_family_is_captured(model, hf_capture_root):
    run = capture_run(model, hf_capture_root)
    captured = set(Dataset(run.dataset).definitions())
    expected = {d.name for d in definitions_for_config(run.config, engine="transformers")
                if _family(d) not in NOT_CAPTURED
                and (model, _family(d)) not in NOT_CAPTURED_BY_MODEL}
    assert expected - captured == set()


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "glm4_moe"])
def test_prefix_cache_hit_is_captured_as_cached_prefill(model, hf_capture_root):
    run = capture_run(model, hf_capture_root)
    assert run.prefix_reuse
    dataset = Dataset(run.dataset)
    cached = []
    for name, lines in workload_lines(run).items():
        if not name.startswith("gqa_ragged_prefill"):
            continue
        for line in lines:
            inputs = dataset.load_inputs(line)
            q_lens = inputs["qo_indptr"].diff()
            kv_lens = inputs["kv_indptr"].diff()
            cached += [int(k - q) for q, k in zip(q_lens, kv_lens) if k > q]
            assert line.enginetap.receipt.notes["adapter"]
    # Request d reuses the 22 tokens of request a's prompt (once per captured layer).
    assert cached and set(cached) == {22}


@pytest.mark.parametrize("model", ["qwen3_next", "deepseek_v32"])
def test_captured_dataset_loads_in_flashinfer_bench(model, hf_capture_root):
    pytest.importorskip("flashinfer_bench.data", reason="flashinfer-bench is not installed")
    from flashinfer_bench.data import TraceSet

    run = capture_run(model, hf_capture_root)
    traces = TraceSet.from_path(str(run.dataset))
    ours = Dataset(run.dataset)
    assert set(traces.definitions) == set(ours.definitions())
    for name, definition in ours.definitions().items():
        theirs = traces.definitions[name]
        assert theirs.model_dump(mode="json") == definition.model_dump(mode="json")
        assert [t.workload.uuid for t in traces.workloads[name]] == [
            line.workload.uuid for line in ours.workloads(name)]


@pytest.mark.parametrize("family", ["gqa_ragged_prefill", "gqa_paged_decode"])
def test_masked_and_unmasked_attention_calls_are_both_captured(family, hf_capture_root):
    # A padded batch gets a bool mask and kv heads repeated by transformers (repeat_kv); a
    # batch without padding ("f" alone, or "a" once the others finished) gets no mask and
    # the kv heads as they are (enable_gqa). Both layouts reach the dataset, and replay.
    run = capture_run("llama", hf_capture_root)
    repeated = []
    for name, lines in workload_lines(run).items():
        if name.startswith(family):
            repeated += [any(n.startswith("kv heads:") for n in line.enginetap.receipt.notes[
                "adapter"]) for line in lines]
    assert set(repeated) == {True, False}
