"""rmsnorm / fused_add_rmsnorm: references against a float64 formula, the engines' own ops
(bit for bit where they share the rounding points), and vLLM's C kernels in every CPU build
this CPU can run (AVX512-BF16/AMX, AVX-512F, AVX2), within the spread the families document
(relative 3 * 2**-7)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from enginetap.definitions import compile_reference, get_template

VLLM_DIR = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
    / "site-packages" / "vllm"


def _rms64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double(), weight.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def _case(family: str, dtype: str, seed: int, rounding: str | None = "twice", rows: int = 7,
          hidden: int = 96):
    template = get_template(family)
    params = {} if family.endswith("_offset") else {"rounding": rounding}
    definition = template.instantiate(hidden_size=hidden, dtype=dtype, **params)
    inputs = template.synthetic_inputs(definition, {"batch_size": rows}, seed=seed)
    return definition, inputs, compile_reference(definition.reference, definition.name)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between ``a`` and ``b`` (bit patterns made monotonic)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rounding", ["once", "twice"])
def test_rmsnorm_matches_float64_formula(dtype: str, rounding: str) -> None:
    _, inputs, run = _case("rmsnorm", dtype, seed=11, rounding=rounding)
    expected = _rms64(inputs["hidden_states"], inputs["weight"], inputs["eps"])
    out = run(**inputs)
    # float32: rounding noise only; bf16: half an ulp per rounding point (2**-9 relative each).
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8 * (2 if rounding == "twice" else 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=tol)
    assert out.std() > 0.5


def test_the_rounding_variants_differ_by_one_ulp_where_they_differ() -> None:
    _, inputs, once = _case("rmsnorm", "bfloat16", seed=12, rounding="once", rows=32, hidden=256)
    twice = _case("rmsnorm", "bfloat16", seed=12, rounding="twice", rows=32, hidden=256)[2]
    ulps = bf16_ulps(once(**inputs), twice(**inputs))
    assert ulps.max() == 1 and 0.05 < ulps.float().mean() < 0.5  # "about a quarter"


@pytest.mark.parametrize("rounding", ["once", "twice"])
def test_fused_add_rounds_the_residual_and_normalises_as_documented(rounding: str) -> None:
    _, inputs, run = _case("fused_add_rmsnorm", "bfloat16", seed=12, rounding=rounding)
    output, residual_out = run(**inputs)
    summed = inputs["hidden_states"].float() + inputs["residual"].float()
    assert torch.equal(residual_out, summed.to(torch.bfloat16))
    inv = torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    w = inputs["weight"].float()
    normalised = residual_out.float() if rounding == "once" else summed
    row = normalised * inv if rounding == "once" else (normalised * inv).bfloat16().float()
    assert torch.equal(output, (row * w).bfloat16())
    torch.testing.assert_close(output.double(), _rms64(summed, inputs["weight"], inputs["eps"]),
                               atol=1e-6, rtol=2.0 ** -7)


def test_rmsnorm_twice_is_transformers_llama_rmsnorm_bit_for_bit() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    _, inputs, run = _case("rmsnorm", "bfloat16", seed=13, hidden=128)
    norm = llama.LlamaRMSNorm(128, eps=inputs["eps"]).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(inputs["weight"])
        engine = norm(inputs["hidden_states"])
    assert torch.equal(run(**inputs), engine)


def test_twice_is_vllm_cpu_rmsnorm_layer_bit_for_bit() -> None:
    """vLLM 0.32 CPU's RMSNorm.forward (the layer models call, with the CPU platform's IR op
    priority) is rounding 'twice', plain and fused."""
    layernorm = pytest.importorskip("vllm.model_executor.layers.layernorm",
                                    reason="vLLM is not installed")
    from vllm.config import VllmConfig, set_current_vllm_config

    _, plain, run_plain = _case("rmsnorm", "bfloat16", seed=14, hidden=128)
    _, fused, run_fused = _case("fused_add_rmsnorm", "bfloat16", seed=15, hidden=128)
    config = VllmConfig()
    with set_current_vllm_config(config), config.kernel_config.ir_op_priority.set_priority():
        norm = layernorm.RMSNorm(128, eps=plain["eps"]).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(plain["weight"])
            engine_plain = norm(plain["hidden_states"])
            norm.weight.copy_(fused["weight"])
            engine_fused = norm(fused["hidden_states"].clone(), fused["residual"].clone())
    assert torch.equal(run_plain(**plain), engine_plain)
    for ours, engine in zip(run_fused(**fused), engine_fused, strict=True):
        assert torch.equal(ours, engine)


def test_offset_families_are_vllm_cpu_gemma_rmsnorm_layer_bit_for_bit() -> None:
    """vLLM 0.32 CPU's GemmaRMSNorm.forward (Qwen3-Next's norms), plain and with a residual,
    is what rmsnorm_offset and fused_add_rmsnorm_offset compute, bit for bit."""
    layernorm = pytest.importorskip("vllm.model_executor.layers.layernorm",
                                    reason="vLLM is not installed")
    from vllm.config import VllmConfig, set_current_vllm_config

    _, plain, run_plain = _case("rmsnorm_offset", "bfloat16", seed=16, hidden=128)
    _, fused, run_fused = _case("fused_add_rmsnorm_offset", "bfloat16", seed=17, hidden=128)
    config = VllmConfig()
    with set_current_vllm_config(config), config.kernel_config.ir_op_priority.set_priority():
        norm = layernorm.GemmaRMSNorm(128, eps=plain["eps"]).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(plain["weight"] - 1)  # a stored w around 0, as trained
            engine_plain = norm(plain["hidden_states"])
            ours_plain = run_plain(plain["hidden_states"], norm.weight, plain["eps"])
            norm.weight.copy_(fused["weight"] - 1)
            engine_fused = norm(fused["hidden_states"].clone(), fused["residual"].clone())
            ours_fused = run_fused(fused["hidden_states"], fused["residual"], norm.weight,
                                   fused["eps"])
    assert torch.equal(ours_plain, engine_plain)
    for ours, engine in zip(ours_fused, engine_fused, strict=True):
        assert torch.equal(ours, engine)


_KERNEL_SCRIPT = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file, save_file
    torch.ops.load_library(sys.argv[1])
    t = load_file(sys.argv[2])
    eps = float(sys.argv[4])
    out = torch.empty_like(t["x"])
    torch.ops._C.rms_norm(out, t["x"], t["weight"], eps)
    x, residual = t["hidden_states"].clone(), t["residual"].clone()
    torch.ops._C.fused_add_rms_norm(x, residual, t["weight"], eps)
    save_file({"rms": out, "output": x, "residual_out": residual}, sys.argv[3])
""")


def _builds() -> list[str]:
    """vLLM CPU builds (their libraries) whose instructions this CPU has."""
    capability = torch.backends.cpu.get_cpu_capability()
    found = [("_C_AVX2", capability in ("AVX2", "AVX512")),
             ("_C_AVX512", torch.cpu._is_avx512_supported()),
             ("_C", torch.cpu._is_avx512_bf16_supported())]
    return [name for name, runs in found if runs and (VLLM_DIR / f"{name}.abi3.so").exists()]


BUILDS = _builds()


@pytest.mark.skipif(not BUILDS, reason="no vLLM CPU build this CPU can run")
@pytest.mark.parametrize("build", BUILDS)
def test_once_is_vllm_c_kernels_in_every_cpu_build(build: str, tmp_path: Path) -> None:
    """The C kernels of each build, loaded alone in a subprocess: the RNE build (AVX512-BF16)
    matches to 1 ulp (summation order), the truncating builds within the documented spread."""
    _, plain, rms = _case("rmsnorm", "bfloat16", seed=16, rounding="once", rows=64, hidden=256)
    _, fused, add = _case("fused_add_rmsnorm", "bfloat16", seed=17, rounding="once", rows=64,
                          hidden=256)
    save_file({"x": plain["hidden_states"], "weight": fused["weight"],
               "hidden_states": fused["hidden_states"], "residual": fused["residual"]},
              tmp_path / "in.safetensors")
    plain["weight"] = fused["weight"]
    subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, str(VLLM_DIR / f"{build}.abi3.so"),
                    str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                    repr(fused["eps"])], check=True, timeout=120)
    engine = load_file(tmp_path / "out.safetensors")
    output, residual_out = add(**fused)
    spread = {"rms": bf16_ulps(engine["rms"], rms(**plain)),
              "output": bf16_ulps(engine["output"], output),
              "residual_out": bf16_ulps(engine["residual_out"], residual_out)}
    truncating = build != "_C"
    # Truncation errs by < 1 ulp per conversion; output inherits the residual's error.
    limits = {"rms": 2 if truncating else 1, "output": 3 if truncating else 1,
              "residual_out": int(truncating)}
    for name, ulps in spread.items():
        assert ulps.max() <= limits[name], (build, name, ulps.max())
    if truncating:  # truncation shows: otherwise this build would be an RNE one
        assert spread["residual_out"].float().mean() > 0.2
    rule = get_template("fused_add_rmsnorm").rule("output")
    bound = rule.atol + rule.rtol * output.double().abs()
    assert bool(((engine["output"].double() - output.double()).abs() <= bound).all())


def test_rmsnorm_offset_matches_transformers_qwen3_next_norm_bit_for_bit():
    """The offset family's reference is the Qwen3-Next norm's own arithmetic."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from enginetap.definitions import compile_reference, get_template

    definition = get_template("rmsnorm_offset").instantiate(hidden_size=64)
    run = compile_reference(definition.reference, definition.name)
    gen = torch.Generator().manual_seed(0)
    norm = Qwen3NextRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(64, generator=gen))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(7, 64, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(run(x, norm.weight, 1e-6), norm(x))
