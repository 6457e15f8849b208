"""Gated delta rule contracts at their rounding points: everything in float32 (state
included), the output rounded once to the activation dtype. Checked on the built-in
engine's qwen3_next captures in bf16 and float16: the reference reproduces every output
element, and an output taken from a state rounded to the dtype (the plausible alternative
for a kernel that keeps its state in the activation dtype) does not."""

from __future__ import annotations

import pytest
import torch

from enginetap.dataset import Dataset
from enginetap.definitions import compile_reference
from tests.capture.hf_capture_helpers import capture_run, hf_capture_root  # noqa: F401
from tests.definitions.test_contracts_moe import _captured, _elements, _exact


def _float16_capture(root):
    from tests.definitions.test_contracts_moe import _router_capture_float16

    path = root / "qwen3_next-float16" / "dataset"
    return path if path.exists() else _router_capture_float16(root)


@pytest.fixture(scope="module")
def captures(hf_capture_root, tmp_path_factory):
    return {"bfloat16": capture_run("qwen3_next", hf_capture_root).dataset,
            "float16": _float16_capture(tmp_path_factory.mktemp("gdn-f16"))}


def _state_rounded_output(dataset: Dataset, name: str) -> int:
    """Decode outputs computed as q^T round(S'): matches with the stored outputs."""
    definition = dataset.definition(name)
    run = compile_reference(definition.reference, name)
    dtype = getattr(torch, definition.outputs["output"].dtype)
    group = definition.axes["num_v_heads"].value // definition.axes["num_qk_heads"].value
    matched = 0
    for line in dataset.workloads(name):
        inputs = dataset.load_inputs(line)
        _, new_state = run(**inputs)
        q = inputs["q"].float()
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * inputs["scale"]
        out = torch.einsum("bhk,bhkv->bhv", q.repeat_interleave(group, dim=1),
                           new_state.to(dtype).float()).to(dtype)
        matched += int((out == dataset.load_outputs(line)["output"]).sum())
    return matched


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["gdn_prefill", "gdn_decode"])
def test_captured_gdn_rounds_only_its_output(captures, dtype, family):
    dataset, name = _captured(captures[dtype], family)
    assert name.endswith(f"_{dtype}")
    definition = dataset.definition(name)
    exact = _exact(compile_reference(definition.reference, name), dataset, name)
    total = _elements(dataset, name)
    assert exact["output"] == total["output"], (exact, total)
    state = "final_state" if family == "gdn_prefill" else "new_state"
    # The state is float32 on both sides; the engine sums in its own order (chunked vs
    # the reference's), so most elements agree to the bit and the rest to float32 noise.
    assert exact[state] >= 0.9 * total[state], (exact, total)
    if family == "gdn_decode":
        assert _state_rounded_output(dataset, name) < total["output"]
