"""Capture from vLLM CPU (TP=1) for llama, qwen3_next and deepseek_v3, then replay every
captured workload against its definition's reference: each must PASS within the
definition's tolerance (exact for expert ids). Armed and disarmed runs sample the same
greedy tokens. One armed and one disarmed vLLM run per model, shared by the tests (run two
at a time, ``tests.pairwise.side_by_side``).

The CPU decides vLLM's kernels (AMX on Intel, AVX-512/AVX2 elsewhere): the AMX-less path is
also run for deepseek_v3 (it switches MLA to ``CPUMLAImpl``, MoE to the ``vec`` packing), by
hiding AMX from vLLM on a machine that has it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.pairwise import side_by_side

sys.path.insert(0, str(Path(__file__).parent))
from vllm_capture_checks import (  # noqa: E402
    CaptureRun,
    const_axes,
    definition_of,
    families,
    receipts,
    replay_failures,
    run_capture,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = ("llama", "qwen3_next", "deepseek_v3")

EXPECTED = {
    "llama": {"rmsnorm", "fused_add_rmsnorm", "gqa_ragged_prefill", "gqa_paged_decode"},
    # Qwen3-Next's norms are Gemma-style (1 + w): the offset families.
    "qwen3_next": {"rmsnorm_offset", "fused_add_rmsnorm_offset", "gqa_ragged_prefill",
                   "gqa_paged_decode", "moe_topk_softmax", "moe_experts_swiglu", "gdn_prefill",
                   "gdn_decode"},
    "deepseek_v3": {"rmsnorm", "fused_add_rmsnorm", "moe_topk_grouped_sigmoid",
                    "moe_experts_swiglu", "mla_paged_decode"},
}


@pytest.fixture(scope="module")
def model_dir(vllm_lock: None):
    from enginetap.models import build_model

    return build_model


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory: pytest.TempPathFactory):
    """``runs(model, armed=True, hide_amx=False, ssm="auto")``: one vLLM run per distinct
    request (``ssm``: the gated-delta state pool's dtype, vLLM's mamba_ssm_cache_dtype)."""
    done: dict[tuple, CaptureRun] = {}

    def job(key: tuple) -> Callable[[], CaptureRun]:
        model, armed, hide_amx, ssm = key
        out = tmp_path_factory.mktemp(f"{model}-{'armed' if armed else 'plain'}"
                                      f"{'-noamx' if hide_amx else ''}-{ssm}")
        folder = model_dir(model)  # built here, not by two threads at once
        return lambda: run_capture(folder, out, armed=armed, hide_amx=hide_amx, ssm_dtype=ssm)

    def get(model: str, armed: bool = True, hide_amx: bool = False, ssm: str = "auto") -> Any:
        key = (model, armed, hide_amx, ssm)
        if not done:  # every run of this module, two engines at a time
            keys: list[tuple] = [(m, a, False, "auto") for m in MODELS for a in (True, False)]
            keys.append(("deepseek_v3", True, True, "auto"))
            keys.append(("qwen3_next", True, False, "bfloat16"))
            jobs = [job(k) for k in keys]
            cli = tmp_path_factory.mktemp("cli-capture")
            model_dir("llama")
            process = tmp_path_factory.mktemp("llama-process-writer")
            keys.append(("process",))
            jobs.append(lambda: run_capture(model_dir("llama"), process,
                                            capture={"writer": "process"}))
            keys.append(("cli",))
            jobs.append(lambda: (cli, subprocess.run(
                [sys.executable, "-m", "enginetap.cli.main", "capture", "--engine", "vllm",
                 "--model", "builtin:llama", "--out", str(cli / "ds"),
                 "--max-output-tokens", "3"], cwd=cli, capture_output=True, text=True,
                timeout=600)))
            done.update(zip(keys, side_by_side(jobs)))
        if key not in done:
            done[key] = job(key)()
        return done[key]

    def cli() -> Any:
        get("llama")
        return done[("cli",)]

    def process() -> Any:
        get("llama")
        return done[("process",)]

    get.cli = cli  # type: ignore[attr-defined]
    get.process = process  # type: ignore[attr-defined]
    return get


def _expected(model: str) -> set[str]:
    """EXPECTED, plus MLA prefill where vLLM takes the AMX path (it absorbs W_UK there;
    the AMX-less backend prefills un-absorbed, which no family describes)."""
    import torch

    amx_prefill = model == "deepseek_v3" and torch.cpu._is_amx_tile_supported()
    return EXPECTED[model] | ({"mla_paged_prefill"} if amx_prefill else set())


@pytest.mark.parametrize("model", MODELS)
def test_every_captured_workload_replays(runs, model):
    run = runs(model)
    summary = run.summary()
    assert summary["probe_failures"] == {} and summary["disabled_probes"] == {}, summary
    assert _expected(model) <= families(run.dataset), families(run.dataset)
    statuses, failures = replay_failures(run.dataset)
    assert statuses and not failures, "\n".join(failures)
    assert summary["written"] == sum(summary["per_definition"].values()) > 0


@pytest.mark.parametrize("model", MODELS)
def test_armed_and_disarmed_sample_the_same_tokens(runs, model):
    armed, plain = runs(model), runs(model, armed=False)
    assert armed.tokens == plain.tokens
    assert not (plain.out / "dataset").exists()


def test_prefix_cache_hit_is_captured_with_its_cached_prefix(runs):
    from enginetap.dataset import Dataset

    run = runs("llama")
    assert run.cached["a2"] > 0, run.cached
    store = Dataset(run.dataset)
    name = definition_of(run.dataset, "gqa_ragged_prefill")
    axes = [line.workload.axes for line in store.workloads(name)]
    assert any(a["total_kv"] > a["total_q"] for a in axes), axes
    notes = [r["notes"] for r in receipts(run.dataset, "gqa_ragged_prefill")]
    assert all("original physical page ids" in str(n) for n in notes)


def test_receipts_name_request_step_layer_and_engine(runs):
    run = runs("qwen3_next")
    for receipt in receipts(run.dataset, "gdn_decode"):
        assert receipt["mode"] in ("decode", "mixed") and receipt["layer"]
        assert receipt["engine_version"].startswith("vllm")
        assert set(receipt["request_ids"]) <= set(run.tokens)
        assert "snapshotted before the call" in str(receipt["notes"])


def test_a_16_bit_state_pool_is_captured_widened_and_replays(runs):
    # vLLM CPU keeps the gated-delta state pool in the model's dtype where the CPU lacks
    # AVX-512 BF16 (mamba_ssm_cache_dtype "auto"), in float32 elsewhere; asked for bf16 it
    # keeps bf16 on every CPU. The states are widened to float32 and replay within the
    # definition's state tolerance; the receipt says so.
    run = runs("qwen3_next", ssm="bfloat16")
    assert {"gdn_prefill", "gdn_decode"} <= families(run.dataset), families(run.dataset)
    statuses, failures = replay_failures(run.dataset)
    assert statuses and not failures, "\n".join(failures)
    for family in ("gdn_prefill", "gdn_decode"):
        found = receipts(run.dataset, family)
        assert found and all("state pool in bfloat16" in str(r["notes"]) for r in found)


def test_the_path_without_amx_captures_and_replays(runs):
    run = runs("deepseek_v3", hide_amx=True)
    assert run.tokens == runs("deepseek_v3").tokens
    _, failures = replay_failures(run.dataset)
    assert not failures, "\n".join(failures)
    # CPU MLA pages by 16: the AMX-less backend ran.
    assert const_axes(run.dataset, "mla_paged_decode")["page_size"] == 16
    mla = receipts(run.dataset, "mla_paged_decode")
    assert mla and all("CPUMLAImpl.forward_mqa ran" in str(r["notes"]) for r in mla)
    experts = receipts(run.dataset, "moe_experts_swiglu")
    assert experts and all("vec prepacked" in str(r["notes"]) for r in experts)


def test_the_writer_process_captures_inside_vllm(runs):
    # options.capture.writer = process: the dataset work in a child of vLLM's engine
    # process, fed through a shared ring; same tokens, a complete summary, all replays
    run = runs.process()
    assert run.tokens == runs("llama", armed=False).tokens
    summary = run.summary()
    assert not summary["write_error"] and summary["disabled_probes"] == {}, summary
    assert summary["written"] == sum(summary["per_definition"].values()) > 0
    assert EXPECTED["llama"] <= families(run.dataset), families(run.dataset)
    statuses, failures = replay_failures(run.dataset)
    assert statuses and not failures, "\n".join(failures)


def test_cli_captures_from_vllm_and_every_workload_replays(runs):
    # ``enginetap capture --engine vllm`` end to end (its own vLLM child, in this module's
    # batch): a complete run, attention workloads, receipts keyed by the driver's request
    # keys (vLLM's ids carry a random suffix), and everything replays
    from enginetap.dataset import Dataset
    from enginetap.replay.runner import replay_dataset

    folder, out = runs.cli()
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((folder / "ds" / "enginetap" / "capture-run.json").read_text())
    assert run["status"] == "complete" and run["engine"] == "vllm"
    ds = Dataset(folder / "ds")
    names = set(ds.definitions())
    assert any(n.startswith("gqa_ragged_prefill") for n in names)
    assert any(n.startswith("gqa_paged_decode") for n in names)
    receipts_ = [line.enginetap.receipt for n in names for line in ds.workloads(n)]
    assert all(r.notes["requests"][k].get("profile") == "mooncake-tiny"
               for r in receipts_ for k in r.request_ids)
    assert replay_dataset(folder / "ds", progress=False).ok
