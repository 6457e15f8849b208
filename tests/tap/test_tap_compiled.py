"""The tap of a torch.compiled built-in engine (``HFEngine(..., compile=...)``).

Checkpoints are hashed inside the compiled graph by ``enginetap::tap_hash_rows`` (module
hooks dynamo traces). With the ``aot_eager`` backend the compiled graph runs the same
kernels as eager mode, so its records must equal the eager run's checkpoint for
checkpoint; with inductor (``compile=True``) the kernels are generated, and the diff
names where their bytes first differ. Inductor compiles C++ on the CPU: those tests are
``slow``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine
from enginetap.engines.hf.arming import disarm
from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.files import TapRun, load_run

from .conftest import named_first, overwrite_between_steps, requests

PROMPTS = ["the cache holds every key", "decode", "the cache holds every key"]
KV_POINTS = ["L0.attn.kv_written", "L0.attn.kv_prev", "L1.attn.kv_written", "L1.attn.kv_prev"]

Run = Callable[..., tuple[list[list[int]], TapRun | None]]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    """``run(model, compile=..., armed=True)``: one generate call of PROMPTS."""
    made: list[int] = []

    def go(model: str, compile: bool | str = False, armed: bool = True,
           max_new_tokens: int = 4) -> tuple[list[list[int]], TapRun | None]:
        out = tmp_path / f"run{len(made)}"
        made.append(1)
        config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                           options={"tap": {}, "step": {"record": False}}) if armed else None
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()  # graph breaks of this run only
        try:
            engine = HFEngine.from_builtin(model, dtype=torch.float32, prefix_cache_size=0,
                                           arm=config, compile=compile)
            outputs = [c.output_ids for c in engine.generate(requests(PROMPTS, max_new_tokens))]
        finally:
            disarm()
            close_all()
        return outputs, load_run(out) if armed else None

    yield go
    torch._dynamo.reset()


def _no_op_graph_break() -> list[str]:
    from torch._dynamo.utils import counters

    return [reason for reason in counters["graph_break"] if "tap_hash_rows" in reason
            or "enginetap" in reason]


def test_compiled_records_every_sublayer_checkpoint_and_equals_eager(run: Run) -> None:
    eager_tokens, eager = run("llama")
    tokens, compiled = run("llama", compile="aot_eager")
    assert eager is not None and compiled is not None
    assert tokens == eager_tokens
    assert _no_op_graph_break() == []
    assert compiled.header["compiled"] == "torch.compile"
    assert compiled.header["not_placed"] == KV_POINTS
    assert eager.header["compiled"] is False and "not_placed" not in eager.header
    a, b = eager.rank(0).steps, compiled.rank(0).steps
    assert len(a) == len(b) == 4
    for sa, sb in zip(a, b):
        expected = [c for c in sa.checkpoints if c not in KV_POINTS]
        assert sb.checkpoints == expected  # every sublayer, in execution order
        assert "L0.in" in expected and "L1.mlp.out" in expected and "norm.out" in expected
        assert [sb.hashes[sb.checkpoints.index(c)] for c in expected] == \
            [sa.hashes[sa.checkpoints.index(c)] for c in expected]
        assert sa.sampler == sb.sampler
    (result,) = diff_runs(eager, compiled)
    assert result.rows_compared > 0 and result.rows_diverged == 0 and result.first is None


@pytest.mark.parametrize("model,not_placed", [
    ("qwen3_moe", KV_POINTS),
    ("qwen3_next", [f"L{i}.gdn.{p}_{w}" for i in range(3) for p in ("state", "conv")
                    for w in ("before", "after")] + ["L3.attn.kv_written", "L3.attn.kv_prev"]),
])
def test_moe_and_hybrid_models_compile_armed_and_equal_eager(run: Run, model: str,
                                                             not_placed: list[str]) -> None:
    """The experts' forward is a closure: with the tap's class wrapper on it, dynamo's
    guard on the wrapper's closure failed on the frame that made it."""
    eager_tokens, eager = run(model, max_new_tokens=3)
    tokens, compiled = run(model, compile="aot_eager", max_new_tokens=3)
    assert eager is not None and compiled is not None
    assert tokens == eager_tokens
    assert _no_op_graph_break() == []
    assert compiled.header["not_placed"] == not_placed
    from enginetap.tap.analysis.report import analyse, summary

    assert f"not placed under torch.compile (not recorded in this mode): " \
        f"{', '.join(not_placed)}" in summary(analyse(compiled))
    for sa, sb in zip(eager.rank(0).steps, compiled.rank(0).steps, strict=True):
        expected = [c for c in sa.checkpoints if c not in not_placed]
        assert sb.checkpoints == expected
        assert any(".moe.experts.out" in c for c in expected)
        assert sb.hashes == [sa.hashes[sa.checkpoints.index(c)] for c in expected]
    (result,) = diff_runs(eager, compiled)
    assert result.rows_compared > 0 and result.rows_diverged == 0 and result.first is None


def test_an_overwritten_kv_row_is_named_in_compile_mode(run: Run,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """After step 1, r1's newest layer-0 key lands in r0's row of the cache: step 2's
    layer-0 attention of r0 (and only r0) reads it."""
    _, clean = run("llama")

    def write(cache: Any) -> None:
        keys = cache.layers[0].keys
        keys[0, :, -1].copy_(keys[1, :, -1])

    overwrite_between_steps(monkeypatch, 1, write)
    _, faulted = run("llama", compile="aot_eager")
    named_first(clean, faulted, ("r0", 2, "L0.attn.out"), "L0.in_norm.out")


def test_an_overwritten_state_slot_is_named_in_compile_mode(
        run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """After step 2, r2's layer-1 recurrent state lands in r1's slot: step 3's layer-1
    gated delta rule of r1 (and only r1) reads it."""
    _, clean = run("qwen3_next")

    def write(cache: Any) -> None:
        states = cache.layers[1].recurrent_states[0]
        states[1].copy_(states[2])

    overwrite_between_steps(monkeypatch, 2, write)
    _, faulted = run("qwen3_next", compile="aot_eager")
    named_first(clean, faulted, ("r1", 3, "L1.gdn.out"), "L1.in_norm.out")


def test_detach_puts_the_tap_class_patches_back(tmp_path: Path) -> None:
    """After the compiled tap leaves (the tap still armed), an eager model of the same
    classes is tapped by the class wrappers again, KV points included."""
    from enginetap.engines.hf.arming import arm
    from enginetap.tap.record.arming import TapInstall

    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tmp_path)
    try:
        engine = HFEngine.from_builtin("llama", dtype=torch.float32, arm=config,
                                       compile="aot_eager")
        armed = arm(config)
        assert armed is not None
        (tap,) = [i for i in armed.installed if isinstance(i, TapInstall)]
        compiled = tap.recorder.compiled
        target = "transformers.models.llama.modeling_llama:LlamaMLP.forward"
        assert target not in {str(p.target) for p in tap.patches.patches}
        compiled.detach()
        assert target in {str(p.target) for p in tap.patches.patches if p.installed}
        assert tap.names.get(engine.model.model.layers[1].mlp) == "L1.mlp"
    finally:
        disarm()
        close_all()


def _planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request r1's row (batch row 1) of layer 1's MLP output gets +1e-3 at decode steps,
    inside the compiled graph (a hook registered before the tap's own)."""
    original = HFEngine._compile

    def compile_with_fault(self: HFEngine, backend: str) -> None:
        def corrupt(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if out.shape[1] != 1:
                return out
            fixed = out.clone()
            fixed[1] = fixed[1] + 1e-3
            return fixed

        self.model.model.layers[1].mlp.register_forward_hook(corrupt)
        original(self, backend)

    monkeypatch.setattr(HFEngine, "_compile", compile_with_fault)


def test_a_corrupted_row_is_named_in_compile_mode(run: Run,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _, eager = run("llama")
    _planted(monkeypatch)
    _, compiled = run("llama", compile="aot_eager")
    # r0 and r2 untouched; the MLP's input still agrees
    named_first(eager, compiled, ("r1", 1, "L1.mlp.out"), "L1.post_norm.out")


@pytest.mark.slow
def test_inductor_tokens_equal_armed_or_not_and_the_diff_names_the_generated_kernel(
        run: Run) -> None:
    disarmed, _ = run("llama", compile=True, armed=False)
    tokens, compiled = run("llama", compile=True)
    eager_tokens, eager = run("llama")
    assert tokens == disarmed == eager_tokens
    assert compiled is not None and eager is not None
    assert all(s.checkpoints == [c for c in e.checkpoints if c not in KV_POINTS]
               for s, e in zip(compiled.rank(0).steps, eager.rank(0).steps))
    (result,) = diff_runs(eager, compiled)
    # Inductor generates its own fused RMSNorm: the first bytes to differ are the first
    # norm's output, while the layer input (the embedding, no generated kernel) agrees.
    assert result.first is not None and result.first.checkpoint == "L0.in_norm.out"
    assert result.first.step_a == 0
    step_a, step_b = eager.rank(0).steps[0], compiled.rank(0).steps[0]
    assert step_a.hashes[step_a.checkpoints.index("L0.in")] == \
        step_b.hashes[step_b.checkpoints.index("L0.in")]
