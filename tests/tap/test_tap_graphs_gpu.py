"""The tap of the built-in engine's CUDA-graph decode mode (``HFEngine(mode="graphs")``).

Decode steps replay captured graphs over a static KV cache; the tap's checkpoints are
hashed inside them (``enginetap::tap_hash_rows_fixed``). Prefill runs eagerly through
the same hooks. The batch of three runs in the bucket of four (one padding row) until a
request finishes, then in the bucket of two. Needs CUDA: skipped without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginetap.config import ArmConfig
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.files import TapRun, load_run
from enginetap.tap.analysis.report import analyse, summary

from .conftest import named_first, overwrite_between_steps



def cuda(test: Callable[..., None]) -> Callable[..., None]:
    """A test that needs CUDA: marked ``gpu`` (``pytest -m gpu`` runs it), skipped without."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs CUDA")(test))


PROMPTS = ["the cache holds every key", "decode", "kernels and caches at once"]
KV_POINTS = ["L0.attn.kv_written", "L0.attn.kv_prev", "L1.attn.kv_written", "L1.attn.kv_prev"]

Run = Callable[..., tuple[list[list[int]], TapRun | None, HFEngine]]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    """``run(mode, armed=True, lengths=(6, 3, 6))``: one generate call of PROMPTS."""
    made: list[int] = []

    def go(mode: str, armed: bool = True, lengths: tuple[int, ...] = (6, 3, 6),
           compile: bool | str = False) -> tuple[list[list[int]], TapRun | None, HFEngine]:
        out = tmp_path / f"run{len(made)}"
        made.append(1)
        config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                           options={"tap": {}, "step": {"record": False}}) if armed else None
        reqs = [Request(request_id=f"r{i}", prompt=p, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        try:
            engine = HFEngine.from_builtin("llama", dtype=torch.float32, device="cuda",
                                           prefix_cache_size=0, arm=config, mode=mode,
                                           compile=compile)
            outputs = [c.output_ids for c in engine.generate(reqs)]
        finally:
            disarm()
            close_all()
        return outputs, load_run(out) if armed else None, engine

    yield go


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many steps queued their buffer to the host at the device wait (the path a
    replayed step takes: :meth:`CompiledTap.queue`), counted around the real method."""
    from enginetap.tap.record.compiled import CompiledTap

    calls: list[int] = []
    original = CompiledTap.queue

    def counted(self: CompiledTap, extra: list[torch.Tensor]) -> None:
        calls.append(len(extra))
        original(self, extra)

    monkeypatch.setattr(CompiledTap, "queue", counted)
    return calls


@cuda
def test_graphs_mode_records_every_sublayer_checkpoint_and_diffs_against_eager(
        run: Run, queued: list[int]) -> None:
    eager_tokens, eager, _ = run("eager")
    tokens, graphs, engine = run("graphs")
    assert queued == [1] * 6  # every step's buffer and sampler values queued at the wait
    disarmed, _, _ = run("graphs", armed=False)
    assert eager is not None and graphs is not None
    assert tokens == disarmed  # instrumentation never changes outputs
    assert tokens == eager_tokens  # same model, same greedy choices
    assert engine._graphs.captures == 2  # buckets 4 (three requests) and 2 (after r1)
    assert graphs.header["compiled"] == "cuda graphs" and graphs.header["cuda_graphs"]
    assert graphs.header["not_placed"] == KV_POINTS
    assert "not placed under cuda graphs (not recorded in this mode): " + \
        ", ".join(KV_POINTS) in summary(analyse(graphs))
    a, b = eager.rank(0).steps, graphs.rank(0).steps
    assert len(a) == len(b) == 6
    for sa, sb in zip(a, b):
        assert sb.checkpoints == [c for c in sa.checkpoints if c not in KV_POINTS]
        assert [r["key"] for r in sb.rows] == [r["key"] for r in sa.rows]  # no padding row
        assert all(len(h) == len(sb.rows) for h in sb.hashes)
        assert len(sb.sampler) == len(sa.sampler)
        assert [r["argmax"] for r in sb.sampler] == [r["argmax"] for r in sa.sampler]
        # L1.in is L0.out's tensor: hashed once, its hashes repeated under both names
        assert sb.hashes[sb.checkpoints.index("L1.in")] == \
            sb.hashes[sb.checkpoints.index("L0.out")] == \
            sa.hashes[sa.checkpoints.index("L0.out")] or sa.step > 0
    (result,) = diff_runs(eager, graphs)
    assert result.rows_compared > 0
    if result.first is not None:
        # Only attention may differ: over the static cache it reduces over every column
        # (masked ones included) where eager attends to the grown cache.
        first = result.first
        assert re.fullmatch(r"L\d+\.attn\.out", first.checkpoint), first
        layer = first.checkpoint.split(".")[0]
        sa = next(s for s in a if s.step == first.step_a)
        sb = next(s for s in b if s.step == first.step_b)
        ra = next(i for i, r in enumerate(sa.rows) if r["key"] == first.key
                  and r["pos"] == first.position)
        rb = next(i for i, r in enumerate(sb.rows) if r["key"] == first.key
                  and r["pos"] == first.position)
        name = f"{layer}.in_norm.out"  # the attention's input agrees
        assert sa.hashes[sa.checkpoints.index(name)][ra] == \
            sb.hashes[sb.checkpoints.index(name)][rb]
    print(f"graphs vs eager: first={result.first} by_checkpoint={dict(result.by_checkpoint)}")


@cuda
def test_compile_mode_on_the_device_queues_what_step_end_would_read(
        run: Run, queued: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile on CUDA (aot_eager): the buffer and the sampler's values reach the
    host through the copy queued at the device wait, and the records equal those of a
    run whose step end reads the buffer itself, checkpoint for checkpoint; both name the
    eager run's checkpoints (less the KV points, not placed) with its tokens."""
    from enginetap.tap.record.compiled import CompiledTap

    eager_tokens, eager, _ = run("eager")
    torch._dynamo.reset()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(CompiledTap, "queue", lambda self, extra: None)
            read_tokens, read, _ = run("eager", compile="aot_eager")
        assert queued == []
        torch._dynamo.reset()
        tokens, compiled, _ = run("eager", compile="aot_eager")
    finally:
        torch._dynamo.reset()
    assert eager is not None and read is not None and compiled is not None
    assert len(queued) == 6  # every step's
    assert tokens == read_tokens == eager_tokens
    assert compiled.header["compiled"] == "torch.compile"
    steps = zip(eager.rank(0).steps, read.rank(0).steps, compiled.rank(0).steps, strict=True)
    for sa, sr, sb in steps:
        assert sb.checkpoints == sr.checkpoints == [c for c in sa.checkpoints
                                                    if c not in KV_POINTS]
        assert sb.hashes == sr.hashes
        assert sb.sampler == sr.sampler
        assert [r["argmax"] for r in sb.sampler] == [r["argmax"] for r in sa.sampler]
    (result,) = diff_runs(eager, compiled)
    assert result.rows_compared > 0
    print(f"compile (aot_eager, CUDA) vs eager: first={result.first}")


def _plant(monkeypatch: pytest.MonkeyPatch, hook: Any, where: Callable[[HFEngine], Any]
           ) -> None:
    """Register ``hook`` on ``where(engine)`` before the tap's own hooks (and so inside
    the captured graphs)."""
    original = HFEngine._use_graphs

    def use_graphs(self: HFEngine) -> None:
        where(self).register_forward_hook(hook)
        original(self)

    monkeypatch.setattr(HFEngine, "_use_graphs", use_graphs)


@cuda
def test_a_corrupted_row_is_named_under_graphs(run: Run,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, clean, _ = run("graphs", lengths=(4, 4, 4))

    def corrupt(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if out.shape[1] != 1:
            return out
        fixed = out.clone()
        fixed[1] = fixed[1] + 1e-3  # request r1's row of every decode step
        return fixed

    _plant(monkeypatch, corrupt, lambda e: e.model.model.layers[1].mlp)
    _, faulted, _ = run("graphs", lengths=(4, 4, 4))
    # the MLP's input still agrees
    named_first(clean, faulted, ("r1", 1, "L1.mlp.out"), "L1.post_norm.out")


@cuda
def test_an_overwritten_kv_row_is_named_under_graphs(run: Run,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """After decode step 1 sampled, r2's newest layer-0 key lands in r0's row of the
    static cache: step 2's layer-0 attention of r0 (and only r0) reads it."""
    _, clean, _ = run("graphs", lengths=(4, 4, 4))
    def write(cache: Any) -> None:
        keys, column = cache.keys[0], int(cache.columns[-1])
        keys[0, :, column].copy_(keys[2, :, column])

    overwrite_between_steps(monkeypatch, 1, write)
    _, faulted, _ = run("graphs", lengths=(4, 4, 4))
    # the attention's input agrees: the cache was wrong
    named_first(clean, faulted, ("r0", 2, "L0.attn.out"), "L0.in_norm.out")


def test_graphs_mode_refuses_the_cpu() -> None:
    from enginetap.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a CUDA device"):
        HFEngine.from_builtin("llama", dtype=torch.float32, mode="graphs")
    with pytest.raises(ConfigError, match="unknown engine mode"):
        HFEngine.from_builtin("llama", dtype=torch.float32, mode="graph")


@cuda
def test_graphs_mode_refuses_recurrent_models() -> None:
    from enginetap.errors import ConfigError

    with pytest.raises(ConfigError, match="recurrent layers"):
        HFEngine.from_builtin("qwen3_next", dtype=torch.float32, device="cuda", mode="graphs")


@cuda
def test_the_fixed_op_hash_equals_the_eager_hash_on_the_device() -> None:
    from enginetap.tap.record.compiled import tap_hash_rows_fixed
    from enginetap.tap.record.fingerprint import hash_rows

    for dtype, width in ((torch.bfloat16, 40), (torch.float32, 40), (torch.float16, 40),
                         (torch.bfloat16, 3000), (torch.float32, 1500)):  # several blocks
        tensor = torch.randn(5, 3, width, device="cuda").to(dtype)
        index = torch.tensor([14, 0, 7], device="cuda")
        buffer = torch.zeros((4, 9), dtype=torch.int64, device="cuda")
        tap_hash_rows_fixed(buffer, tensor, index, 2, 15)
        expected = hash_rows(tensor.reshape(15, -1)[index.cpu()].cpu())
        assert buffer[2, :3].cpu().tolist() == expected.tolist()
        assert buffer[2, -1].item() == 1 and buffer[:2].abs().sum().item() == 0
