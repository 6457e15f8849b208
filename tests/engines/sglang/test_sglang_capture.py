"""Capture from SGLang CPU (TP=1) for qwen3_next and deepseek_v3, then replay every
captured workload against its definition's reference: each must PASS within the
definition's tolerance. One armed SGLang run per model (``sglang_capture_run.py``).

Qwen3-Next: Gemma-style norms, RadixAttention extend and decode (keys and values read
back from SGLang's token pool), the softmax router and the gated delta rule at SGLang's
GDN dispatcher (prefill and decode). DeepSeek-V3 (radix cache on): its norms and MLA's
absorbed decode and extend, one extend over a cached prefix (the latent cache read back
from SGLang's pool); its grouped sigmoid router computes the
sigmoid in bf16 and is not captured (see ``probes/moe.py``). Both: the routed SwiGLU
experts at SGLang's torch-native MoE, whose declared rounding reproduces every captured
element bit for bit while each other scheme does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.sglang.conftest import HERE, child_env, run_child
from tests.pairwise import side_by_side

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

EXPECTED = {
    "qwen3_next": {"rmsnorm_offset", "fused_add_rmsnorm_offset", "moe_topk_softmax",
                   "gdn_prefill", "gdn_decode", "gqa_ragged_prefill", "gqa_paged_decode",
                   "moe_experts_swiglu"},
    "deepseek_v3": {"rmsnorm", "fused_add_rmsnorm", "mla_paged_decode", "mla_paged_prefill",
                    "moe_experts_swiglu"},
}


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from enginetap.models import build_model

    root = tmp_path_factory.mktemp("capture-sglang")
    jobs = []
    for name in EXPECTED:
        folder = root / name
        folder.mkdir()
        config = {"enabled": True, "capabilities": ["capture"], "out_dir": str(folder),
                  "options": {"capture": {}}}
        (folder / "arming.json").write_text(json.dumps(config))
        args = [str(HERE / "sglang_capture_run.py"), str(build_model(name)),
                str(folder / "tokens.json"), *(["radix"] if name == "deepseek_v3" else [])]
        env = child_env({"ENGINETAP_CONFIG": str(folder / "arming.json")})
        jobs.append(lambda args=args, env=env, log=folder / "run.log": run_child(args, env, log))
    build_model("llama")
    jobs.append(lambda: run_child(  # the capture job: traffic through sglang.Engine
        ["-m", "enginetap.cli.main", "capture", "--engine", "sglang", "--model",
         "builtin:llama", "--profile", "builtin:mooncake-tiny", "--max-output-tokens", "4",
         "--out", str(root / "cli")], child_env(), root / "cli.log"))
    side_by_side(jobs)  # two engines at a time (one child process each)
    return {**{name: root / name / "dataset" for name in EXPECTED}, "cli": root / "cli"}


def _failures(dataset: Path) -> list[str]:
    from enginetap.replay.runner import replay_dataset

    report = replay_dataset(dataset, warmup=0, repeats=1)
    assert not report.problems, report.problems
    return [f"{d.name} {w.uuid}: {w.status} {[c for c in w.checks if c.status != 'PASS']}"
            for d in report.definitions for w in d.workloads if w.status != "PASS"]


def _families(dataset: Path) -> set[str]:
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of

    store = Dataset(dataset)
    return {family_of(d) or n for n, d in store.definitions().items() if store.workloads(n)}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_every_captured_workload_replays_within_tolerance(captured, model) -> None:
    dataset = captured[model]
    assert EXPECTED[model] <= _families(dataset), _families(dataset)
    failures = _failures(dataset)
    assert not failures, "\n".join(failures)


def test_receipts_name_sglang_its_step_and_the_gated_delta_layer(captured) -> None:
    from enginetap.dataset import Dataset

    store = Dataset(captured["qwen3_next"])
    for family, mode in (("gdn_prefill", "prefill"), ("gdn_decode", "decode")):
        name = next(n for n in store.definitions() if n.startswith(family))
        receipt = store.workloads(name)[0].enginetap.receipt.model_dump()
        assert receipt["engine_version"] == "sglang 0.5.23"
        assert receipt["mode"] == mode and receipt["layer"].endswith(".gdn.attn"), receipt
        assert set(receipt["request_ids"]) <= {"a", "b", "c", "d"}, receipt


def test_mla_extend_over_a_cached_prefix_is_captured(captured) -> None:
    """DeepSeek-V3's run has the radix cache on: "d" extends over "b"'s cached prefix,
    and its absorbed MLA extend is captured with the prefix's latents read back from the
    pool (its replay is checked with the others above)."""
    from enginetap.dataset import Dataset

    store = Dataset(captured["deepseek_v3"])
    name = next(n for n in store.definitions() if n.startswith("mla_paged_prefill"))
    lines = store.workloads(name)
    hit = [w for w in lines if w.workload.axes["num_kv_indices"] > w.workload.axes["total_q"]]
    assert hit, [w.workload.axes for w in lines]
    assert all(set(w.enginetap.receipt.request_ids) <= {"a", "b", "c", "d"} for w in lines)


def test_capture_engine_sglang_drives_a_mooncake_profile_and_prefixes_hit(captured) -> None:
    """``enginetap capture --engine sglang``: the traffic job through ``sglang.Engine``
    (radix cache on), its scheduler armed through the plugin; it exits 0 with a summary,
    and its prefill workloads include extends over a cached prefix, all replaying."""
    from enginetap.dataset import Dataset

    dataset = captured["cli"]
    summary = json.loads((dataset / "enginetap" / "capture-summary-rank0.json").read_text())
    assert summary and json.loads((dataset / "enginetap" / "capture-run.json").read_text())[
        "status"] == "complete"
    assert {"rmsnorm", "gqa_ragged_prefill", "gqa_paged_decode"} <= _families(dataset)
    store = Dataset(dataset)
    name = next(n for n in store.definitions() if n.startswith("gqa_ragged_prefill"))
    axes = [w.workload.axes for w in store.workloads(name)]
    assert any(a["total_kv"] > a["total_q"] for a in axes), axes  # a radix cache hit
    failures = _failures(dataset)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_captured_experts_follow_their_declared_rounding_exactly(captured, model) -> None:
    """SGLang's torch-native MoE (``moe_forward_native``) with float32 routing weights is
    'each_op_f32_weighting': that scheme reproduces every captured output element; each
    other scheme misses some (the float32 sum over pairs runs in SGLang's order, which
    could flip 1 ulp; here it does not)."""
    from enginetap.dataset import Dataset
    from enginetap.definitions import get_template
    from enginetap.definitions.base import compile_reference, params_of
    from enginetap.definitions.moe import EXPERT_ROUNDING

    store = Dataset(captured[model])
    names = [n for n in store.definitions() if n.startswith("moe_experts_swiglu_")]
    assert len(names) == 1, names
    definition = store.definition(names[0])
    assert names[0].endswith("_round_each_op_f32_weighting"), names
    template = get_template("moe_experts_swiglu")
    consts = {k: a.value for k, a in definition.axes.items() if a.type == "const"}
    counts, total = dict.fromkeys(EXPERT_ROUNDING, 0), 0
    for rounding in EXPERT_ROUNDING:
        other = template.instantiate(**consts, **{**params_of(definition, template),
                                                  "rounding": rounding})
        run = compile_reference(other.reference, other.name)
        for line in store.workloads(names[0]):
            stored = store.load_outputs(line)["output"]
            counts[rounding] += int((run(**store.load_inputs(line)) == stored).sum())
            total += stored.numel() if rounding == "each_op_f32_weighting" else 0
    assert counts["each_op_f32_weighting"] == total, (counts, total)
    assert all(c < total for r, c in counts.items() if r != "each_op_f32_weighting"), counts
