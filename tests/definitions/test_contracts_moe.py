"""MoE contracts checked at their rounding points, not only within tolerance.

Each family names where it rounds (``rounding``). On what real engines produce — the built-in
engine's captures of its tiny models, transformers' own experts modules and vLLM CPU's own
router and fused-experts kernel — count the elements the declared scheme reproduces bit for
bit, and the elements each alternative scheme does: the declared one must reproduce every
element (vLLM's kernel: all but the rare ones its float32 summation order flips), and every
alternative must lose somewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from enginetap.config import ArmConfig
from enginetap.dataset import Dataset
from enginetap.definitions import compile_reference, get_template, known_template
from enginetap.definitions.base import params_of
from enginetap.definitions.moe import EXPERT_ROUNDING, ROUTER_ROUNDING
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.models import build_model
from tests.capture.hf_capture_helpers import capture_run, hf_capture_root  # noqa: F401
from tests.definitions.conftest import CPU_PATH_VAR
from tests.definitions.test_norms import BUILDS, VLLM_DIR


def _variant(definition, family: str, **change):
    """The reference of ``definition`` with some params changed (same const axes)."""
    template = get_template(family)
    consts = {k: a.value for k, a in definition.axes.items() if a.type == "const"}
    other = template.instantiate(**consts, **{**params_of(definition, template), **change})
    return compile_reference(other.reference, other.name)


def _exact(run, dataset: Dataset, name: str) -> dict[str, int]:
    """Elements of each output that ``run`` reproduces bit for bit, over every workload."""
    counts: dict[str, int] = {}
    for line in dataset.workloads(name):
        got = run(**dataset.load_inputs(line))
        got = got if isinstance(got, tuple) else (got,)
        stored = dataset.load_outputs(line)
        for key, value in zip(dataset.definition(name).outputs, got, strict=True):
            counts[key] = counts.get(key, 0) + int((value == stored[key]).sum())
    return counts


def _elements(dataset: Dataset, name: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in dataset.workloads(name):
        for key, value in dataset.load_outputs(line).items():
            counts[key] = counts.get(key, 0) + value.numel()
    return counts


def _captured(run_dir: Path, family: str) -> tuple[Dataset, str]:
    dataset = Dataset(run_dir)
    names = [n for n, d in dataset.definitions().items() if n.startswith(family + "_")]
    assert len(names) == 1, names
    assert known_template(dataset.definition(names[0])) is not None
    return dataset, names[0]


# ------------------------------------------------------------------- built-in engine, bf16
@pytest.mark.parametrize(("model", "declared"), [("qwen3_next", "each_op"),
                                                  ("qwen3_moe", "each_op"),
                                                  ("deepseek_v3", "each_op_f32_weighting")])
def test_captured_experts_follow_their_declared_rounding_exactly(model, declared,
                                                                 hf_capture_root):
    dataset, name = _captured(capture_run(model, hf_capture_root).dataset, "moe_experts_swiglu")
    definition = dataset.definition(name)
    assert name.endswith(f"_round_{declared}")
    total = _elements(dataset, name)["output"]
    counts = {r: _exact(_variant(definition, "moe_experts_swiglu", rounding=r), dataset,
                        name)["output"] for r in EXPERT_ROUNDING}
    assert counts[declared] == total, counts
    for rounding, count in counts.items():
        # With two bf16-weighted pairs, adding in bf16 from 0 rounds a + b once, as the
        # float32 sum does: the two schemes are the same function there.
        same = {declared, rounding} == {"each_op", "each_op_bf16_sum"} and \
            definition.axes["top_k"].value == 2
        if rounding != declared and not same:
            assert count < total, (rounding, counts)
    assert counts["act"] < 0.5 * total  # "float32 then one cast" is far from these bytes


@pytest.mark.parametrize("model", ["qwen3_next", "deepseek_v3"])
def test_captured_router_rows_are_the_reference_bit_for_bit_in_canonical_order(
        model, hf_capture_root):
    family = "moe_topk_softmax" if model == "qwen3_next" else "moe_topk_grouped_sigmoid"
    dataset, name = _captured(capture_run(model, hf_capture_root).dataset, family)
    definition = dataset.definition(name)
    run = compile_reference(definition.reference, name)
    assert _exact(run, dataset, name) == _elements(dataset, name)
    for line in dataset.workloads(name):
        out = dataset.load_outputs(line)
        w, ids = out["topk_weights"], out["topk_ids"].long()
        ordered = (w[:, :-1] > w[:, 1:]) | ((w[:, :-1] == w[:, 1:]) & (ids[:, :-1] < ids[:, 1:]))
        assert bool(ordered.all()), line.workload.uuid
    if family == "moe_topk_softmax":
        assert name.endswith("_round_output")
        total = _elements(dataset, name)["topk_weights"]
        # 'each_op' with renormalize also rounds one float32 softmax once: not an
        # alternative here. Float32 weights ('none') are what the old contract claimed.
        alt = _exact(_variant(definition, family, rounding="none"), dataset, name)
        assert alt["topk_weights"] < total


def _router_capture_float16(root: Path) -> Path:
    """qwen3_next in float16 through the built-in engine, capturing its routers."""
    out = root / "qwen3_next-float16"
    arm = ArmConfig(enabled=True, capabilities=["capture"], out_dir=out,
                    options={"capture": {"policy": {"name": "f16", "per_definition": 6}}})
    try:
        engine = HFEngine(build_model("qwen3_next"), dtype=torch.float16, arm=arm)
        engine.generate([Request("a", prompt_ids=[5 + 7 * i for i in range(19)],
                                 max_new_tokens=3),
                         Request("b", prompt_ids=[9, 8, 7], max_new_tokens=2)])
    finally:
        disarm()
    return out / "dataset"


def test_float16_router_capture_rounds_its_weights_to_float16_once(tmp_path):
    dataset, name = _captured(_router_capture_float16(tmp_path), "moe_topk_softmax")
    definition = dataset.definition(name)
    assert name.endswith("_float16_round_output")
    total = _elements(dataset, name)
    assert _exact(compile_reference(definition.reference, name), dataset, name) == total
    assert _exact(_variant(definition, "moe_topk_softmax", rounding="none"), dataset,
                  name)["topk_weights"] < total["topk_weights"]


# --------------------------------------------------------- transformers' experts, top_k=3
@pytest.mark.parametrize(("implementation", "weights_dtype", "declared"),
                         [("grouped_mm", torch.bfloat16, "each_op"),
                          ("grouped_mm", torch.float32, "each_op_f32_weighting"),
                          ("batched_mm", torch.bfloat16, "each_op"),
                          ("eager", torch.bfloat16, "each_op_bf16_sum"),
                          ("eager", torch.float32, "each_op_bf16_sum")])
def test_transformers_experts_round_where_the_probe_says(implementation, weights_dtype,
                                                        declared):
    """Three pairs per token, where every scheme differs from every other."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from enginetap.engines.hf.probes.moe import _rounding

    config = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=8,
                            num_experts_per_tok=3)
    config._experts_implementation = implementation
    definition, inputs, run = _experts_case(seed=31, top_k=3)
    experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(inputs["w13"])
        experts.down_proj.copy_(inputs["w2"])
        weights = inputs["topk_weights"].to(weights_dtype)
        engine = experts(inputs["hidden_states"], inputs["topk_ids"].long(), weights)
    assert _rounding(experts, weights) == declared
    inputs["topk_weights"] = weights.float()
    counts = {r: int((_variant(definition, "moe_experts_swiglu", rounding=r)(**inputs)
                      == engine).sum()) for r in EXPERT_ROUNDING}
    assert counts[declared] == engine.numel(), counts
    assert max(c for r, c in counts.items() if r != declared) < engine.numel(), counts


def _experts_case(seed: int, top_k: int = 2, tokens: int = 48):
    template = get_template("moe_experts_swiglu")
    definition = template.instantiate(num_experts=8, hidden_size=128, intermediate_size=64,
                                      gemm1_out_size=128, top_k=top_k)
    inputs = template.synthetic_inputs(definition, {"num_tokens": tokens}, seed=seed)
    return definition, inputs, compile_reference(definition.reference, definition.name)


# ------------------------------------------------------------------------------ vLLM CPU
_FUSED_MOE = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file, save_file
    torch.ops.load_library(sys.argv[1])
    t = load_file(sys.argv[2])
    packed = {}
    for key in ("w13", "w2"):
        packed[key] = torch.empty_like(t[key])
        torch.ops._C.prepack_moe_weight(t[key], packed[key], "vec")
    out = torch.empty_like(t["hidden_states"])
    torch.ops._C.cpu_fused_moe(out, t["hidden_states"], packed["w13"], packed["w2"], None,
                               None, t["topk_weights"], t["topk_ids"], False, "silu", "vec")
    save_file({"out": out}, sys.argv[3])
""")


def _truncating_act(inputs: dict, intermediate: int) -> torch.Tensor:
    """Rounding 'act' with float32 -> bf16 by truncation (what the non-BF16 builds do)."""
    def trunc(t: torch.Tensor) -> torch.Tensor:
        return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)

    x, ids = inputs["hidden_states"].float(), inputs["topk_ids"].long()
    out = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        w13, w2 = inputs["w13"][ids[:, slot]].float(), inputs["w2"][ids[:, slot]].float()
        gate_up = torch.einsum("th,tih->ti", x, w13)
        act = trunc(torch.nn.functional.silu(gate_up[:, :intermediate])
                    * gate_up[:, intermediate:])
        out += torch.einsum("ti,thi->th", act, w2) * inputs["topk_weights"][:, slot, None]
    return trunc(out).to(torch.bfloat16)


@pytest.mark.skipif(not BUILDS, reason="no vLLM CPU build this CPU can run")
@pytest.mark.parametrize("build", BUILDS)
def test_vllm_fused_moe_is_rounding_act_in_every_cpu_build(build: str, tmp_path: Path):
    """Each build's kernel, loaded alone in a subprocess (the 'vec' path; AMX CPUs take
    another, not runnable here): the AVX512-BF16 build is 'act' rounding to nearest, the
    others 'act' truncating, except elements a float32 summation order flips (measured
    2 or 3 of 10,240 here) — the engine's own spread; every other scheme is far off."""
    definition, inputs, run = _experts_case(seed=41, top_k=4, tokens=80)
    save_file({k: v.contiguous() for k, v in inputs.items()}, tmp_path / "in.safetensors")
    subprocess.run([sys.executable, "-c", _FUSED_MOE, str(VLLM_DIR / f"{build}.abi3.so"),
                    str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
                   check=True, timeout=300)
    engine = load_file(tmp_path / "out.safetensors")["out"]
    schemes = {r: _variant(definition, "moe_experts_swiglu", rounding=r)(**inputs)
               for r in EXPERT_ROUNDING}
    schemes["act_truncating"] = _truncating_act(inputs, 64)
    counts = {r: int((out == engine).sum()) for r, out in schemes.items()}
    declared = "act" if build == "_C" else "act_truncating"
    assert counts[declared] >= 0.995 * engine.numel(), counts
    assert all(c < 0.75 * engine.numel() for r, c in counts.items() if r != declared), counts
    rule = get_template("moe_experts_swiglu").rule("output")
    bound = rule.atol + rule.rtol * schemes["act"].float().abs()
    assert bool(((engine.float() - schemes["act"].float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_vllm_softmax_router_is_rounding_each_op_bit_for_bit(dtype, renormalize):
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    from enginetap.definitions.moe import canonical_routing

    template = get_template("moe_topk_softmax")
    definition = template.instantiate(num_experts=32, top_k=8, renormalize=renormalize,
                                      logits_dtype=dtype, rounding="each_op")
    logits = template.synthetic_inputs(definition, {"num_tokens": 64}, seed=5)["router_logits"]
    engine_w, engine_ids = canonical_routing(*cpu_router._softmax_topk(logits, 8, renormalize))
    counts = {}
    for rounding in ROUTER_ROUNDING:
        weights, ids = _variant(definition, "moe_topk_softmax", rounding=rounding)(logits)
        # vLLM's topk may take the higher id of an exactly tied pair (the compare rule's
        # "selection" accepts that): same chosen logits either way, so the same weights.
        chosen = logits.float().gather(-1, ids.long()).sort(-1).values
        assert torch.equal(chosen, logits.float().gather(-1, engine_ids.long()).sort(-1).values)
        counts[rounding] = int((weights == engine_w).sum())
    assert counts["each_op"] == engine_w.numel(), counts
    assert counts["none"] < engine_w.numel(), counts
    if not renormalize:  # with renormalize, both round one float32 softmax once
        assert counts["output"] < engine_w.numel(), counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_vllm_grouped_router_weights_are_float32_bit_for_bit(dtype, scale):
    """moe_topk_grouped_sigmoid never rounds: vLLM widens 16-bit logits to float32 first."""
    cpu_router = pytest.importorskip("vllm.model_executor.layers.fused_moe.router.cpu_router")
    from enginetap.definitions.moe import canonical_routing

    template = get_template("moe_topk_grouped_sigmoid")
    definition = template.instantiate(num_experts=16, top_k=3, n_group=4, topk_group=2,
                                      routed_scaling_factor=scale, logits_dtype=dtype)
    inputs = template.synthetic_inputs(definition, {"num_tokens": 64}, seed=6)
    weights, ids = compile_reference(definition.reference, definition.name)(**inputs)
    engine_w, engine_ids = canonical_routing(*cpu_router._grouped_topk(
        inputs["router_logits"], 3, True, 4, 2, "sigmoid", scale,
        inputs["e_score_correction_bias"]))
    # A third of the rows hold a planted exact tie, which vLLM's topk may give the higher
    # id (a selection the compare rule accepts); compare weights on the rows that agree.
    same = (ids == engine_ids).all(-1)
    assert int(same.sum()) >= 48
    assert torch.equal(weights[same], engine_w[same])
    rounded = weights.to(getattr(torch, dtype)).float()
    assert int((rounded[same] == engine_w[same]).sum()) < engine_w[same].numel()


# ------------------------------------------------------- vLLM CPU engine captures (slow)
_NOT_EXPOSED = "not exposed by this engine"


def _vllm_build() -> str:
    """The library vLLM CPU loads here (platforms/cpu.py's rule)."""
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_next", "deepseek_v3"])
def test_vllm_captures_follow_their_declared_rounding(model, vllm_lock, tmp_path):
    """Captured through vLLM CPU itself: experts are 'act' (rounding to nearest in the
    AVX512-BF16 build, truncating in the others) except float32 summation-order flips
    (measured: 0 of 14,592 and 1 of 23,040 elements); routers are their reference bit for
    bit, in canonical order."""
    if CPU_PATH_VAR in os.environ:
        pytest.skip("the engine runs in a child that sees this CPU's own build; every "
                    "build's kernel is covered by test_vllm_fused_moe_is_rounding_act_...")
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("AMX CPUs run cpu_fused_moe's 'amx' path, not measured")
    from enginetap.models import build_model
    from tests.capture.vllm_capture_checks import run_capture

    root = run_capture(build_model(model), tmp_path / model, timeout=900).out / "dataset"
    dataset, name = _captured(root, "moe_experts_swiglu")
    definition, total = dataset.definition(name), _elements(dataset, name)["output"]
    assert name.endswith("_round_act")
    counts = {r: _exact(_variant(definition, "moe_experts_swiglu", rounding=r), dataset,
                        name)["output"] for r in EXPERT_ROUNDING}
    if _vllm_build() == "_C":
        declared = counts["act"]
    else:
        intermediate = definition.axes["intermediate_size"].value
        declared = sum(int((_truncating_act(dataset.load_inputs(line), intermediate)
                            == dataset.load_outputs(line)["output"]).sum())
                       for line in dataset.workloads(name))
    assert declared >= 0.999 * total, counts
    assert all(c < 0.5 * total for r, c in counts.items() if r != "act"), counts
    router = "moe_topk_softmax" if model == "qwen3_next" else "moe_topk_grouped_sigmoid"
    dataset, name = _captured(root, router)
    run = compile_reference(dataset.definition(name).reference, name)
    exact, total = _exact(run, dataset, name), _elements(dataset, name)
    # Weights bit for bit; an id may differ only where vLLM's topk took the other expert of
    # an exact tie (same weight either way).
    assert exact["topk_weights"] == total["topk_weights"]
    assert exact["topk_ids"] >= 0.99 * total["topk_ids"]
    # vLLM's attention kernels return no lse: its receipts say so.
    attention = [n for n in dataset.definitions() if n.startswith(("gqa_", "mla_"))]
    assert attention
    for name in attention:
        assert all(line.enginetap.receipt.notes["not_exposed"] == {"lse": _NOT_EXPOSED}
                   for line in dataset.workloads(name))
