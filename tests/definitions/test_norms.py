"""rmsnorm / fused_add_rmsnorm: references against a float64 formula, each other, and engines."""

from __future__ import annotations

import pytest
import torch

from enginetap.definitions import compile_reference, get_template


def _vllm_ops():
    return pytest.importorskip("vllm._custom_ops", reason="vLLM CPU ops are not installed")


def _rms64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double(), weight.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def _case(family: str, dtype: str, seed: int, rows: int = 7, hidden: int = 96):
    template = get_template(family)
    definition = template.instantiate(hidden_size=hidden, dtype=dtype)
    inputs = template.synthetic_inputs(definition, {"batch_size": rows}, seed=seed)
    return definition, inputs, compile_reference(definition.reference, definition.name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_matches_float64_formula(dtype: str) -> None:
    _, inputs, run = _case("rmsnorm", dtype, seed=11)
    expected = _rms64(inputs["hidden_states"], inputs["weight"], inputs["eps"])
    out = run(**inputs)
    # float32: rounding noise only; bfloat16: within one rounding of the exact value.
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert out.std() > 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_add_equals_add_then_rmsnorm(dtype: str) -> None:
    definition, inputs, run = _case("fused_add_rmsnorm", dtype, seed=12)
    output, residual_out = run(**inputs)
    summed = inputs["hidden_states"].float() + inputs["residual"].float()
    assert torch.equal(residual_out, summed.to(residual_out.dtype))
    # Two steps: the plain float32 rmsnorm of the float32 sum, rounded once.
    plain = get_template("rmsnorm").instantiate(hidden_size=96, dtype="float32")
    two_step = compile_reference(plain.reference)(summed, inputs["weight"], inputs["eps"])
    assert torch.equal(output, two_step.to(output.dtype))
    expected = _rms64(summed, inputs["weight"], inputs["eps"])
    tol = 1e-6 if dtype == "float32" else 2.0 ** -8
    torch.testing.assert_close(output.double(), expected, atol=tol, rtol=tol)


def test_rmsnorm_matches_transformers_llama_rmsnorm() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    _, inputs, run = _case("rmsnorm", "bfloat16", seed=13, hidden=128)
    norm = llama.LlamaRMSNorm(128, eps=inputs["eps"]).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(inputs["weight"])
        engine = norm(inputs["hidden_states"])
    # The engine rounds twice (normalised row, then the product): one bf16 step apart at most.
    torch.testing.assert_close(run(**inputs), engine, atol=1e-2, rtol=1e-2)


def test_rmsnorm_matches_vllm_kernel() -> None:
    ops = _vllm_ops()
    _, inputs, run = _case("rmsnorm", "bfloat16", seed=14, hidden=128)
    engine = torch.empty_like(inputs["hidden_states"])
    ops.rms_norm(engine, inputs["hidden_states"], inputs["weight"], inputs["eps"])
    torch.testing.assert_close(run(**inputs), engine, atol=1e-2, rtol=1e-2)


def test_fused_add_rmsnorm_matches_vllm_kernel() -> None:
    ops = _vllm_ops()
    _, inputs, run = _case("fused_add_rmsnorm", "bfloat16", seed=15, hidden=128)
    x, residual = inputs["hidden_states"].clone(), inputs["residual"].clone()
    ops.fused_add_rms_norm(x, residual, inputs["weight"], inputs["eps"])  # in place
    output, residual_out = run(**inputs)
    torch.testing.assert_close(output, x, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(residual_out, residual, atol=1e-2, rtol=1e-2)
