"""Module scope: names of a loaded model's modules and the sublayer running now."""

from __future__ import annotations

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.core.context import Step, StepRows, subscribe, unsubscribe
from enginetap.core.patching import Patch, PatchSet, Target
from enginetap.core.scope import SCOPE, current_names, short_name
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm


@pytest.mark.parametrize("qualname, moe, short", [
    ("model.layers.3.self_attn", False, "L3.attn"),
    ("model.layers.3.mlp.gate", True, "L3.moe.gate"),
    ("model.layers.3.mlp.down_proj", False, "L3.mlp.down_proj"),
    ("model.layers.0.linear_attn", False, "L0.gdn"),
    ("model.layers.12.input_layernorm", False, "L12.in_norm"),
    ("model.layers.1.mlp.shared_experts", True, "L1.moe.shared"),
    ("model.layers.2.self_attn.attn", False, "L2.attn"),
    ("model.norm", False, "norm"),
    ("lm_head", False, "lm_head"),
    ("model.embed_tokens", False, "embed"),
])
def test_short_names(qualname, moe, short):
    assert short_name(qualname, moe) == short


def _names_seen_in_silu(engine: HFEngine) -> set[tuple[str, str]]:
    """The scope's names of the running sublayer at every ``silu`` call of a short
    generation (the engine disarmed after it)."""
    seen: set[tuple[str, str]] = set()

    def spy(wrapped, instance, args, kwargs):
        names = current_names()
        if names is not None:
            seen.add(names)
        return wrapped(*args, **kwargs)

    try:
        with PatchSet("spy", [Patch(Target.parse("torch.nn.functional:silu"), spy)]):
            engine.generate([Request(request_id="a", prompt="hello there", max_new_tokens=2)])
    finally:
        disarm()
    return seen


def test_current_module_names_every_sublayer_during_a_forward(tmp_path):
    config = ArmConfig(enabled=True, capabilities=["scope"], out_dir=tmp_path)
    engine = HFEngine.from_builtin("qwen3_next", arm=config)
    seen = _names_seen_in_silu(engine)
    shorts = {s for _, s in seen}
    # silu runs inside the 3 GDN layers and every layer's experts and shared expert;
    # the innermost sublayer is the one named
    assert shorts == {"L0.gdn", "L1.gdn", "L2.gdn",
                      *(f"L{i}.moe.{part}" for i in range(4) for part in ("experts", "shared"))}
    assert all(q.startswith("model.layers.") for q, _ in seen)
    assert SCOPE.qualname(engine.model.model.layers[3].self_attn) == "model.layers.3.self_attn"
    assert current_names() is None  # nothing runs now


def test_device_rows_are_built_once_per_step():
    rows = StepRows(["a", "a", "b"], [0, 1, 0], [5, 6, 7], [0, 0, 2], [0, 0, 0],
                    token_index=[3, 4, 9])
    step = Step("test", 0, "prefill", rows)
    first = step.device_rows("token_index", "cpu")
    assert first.tolist() == [3, 4, 9] and first.dtype == torch.int64
    assert step.device_rows("token_index", "cpu") is first
    with pytest.raises(KeyError, match="does not fill"):
        step.device_rows("kv_slots", "cpu")
    with pytest.raises(KeyError, match="not a row column"):
        step.device_rows("nonsense", "cpu")
    assert "_device" not in step.to_json()


def test_the_tap_alone_leaves_the_running_sublayer_untracked(tmp_path):
    """The tap names its checkpoints from the scope's registry and never reads the running
    sublayer, so armed alone it keeps the scope's wrappers shut (host time per module
    call); the scope armed by itself tracks it (the test above)."""
    from enginetap.tap.analysis.files import load_run

    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tmp_path)
    engine = HFEngine.from_builtin("qwen3_next", arm=config)
    assert not engine.arming.context.notes["scope"].gate.is_open
    assert not _names_seen_in_silu(engine)
    steps = load_run(tmp_path).rank(0).steps
    assert steps and all("L1.gdn.out" in s.checkpoints and "L3.attn.out" in s.checkpoints
                         for s in steps)  # names from the registry all the same
