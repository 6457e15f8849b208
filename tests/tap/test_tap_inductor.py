"""The tap's op inside an inductor graph changes nothing the graph computes
(:mod:`enginetap.tap.record.inductor`).

A small bf16 model shaped like vLLM's qwen3_next MoE block on the CPU: a residual add and
RMSNorm, a gated shared expert, routed experts written by an out-variant op (as vLLM's
``_C.cpu_fused_moe`` writes its ``output``), their sum. Tapped at the shared expert's gated
output, the block's output and the residual, as the compiled vLLM tap does, without the
fixes its output differed from the untapped graph's: the gated output stored ahead of the
routed experts drew the block's sum into a kernel that read their output before it was
written, and every tapped value was rounded to bf16 where inductor kept it in fp32.
Inductor compiles C++: ``slow``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import enginetap.tap.record.compiled  # noqa: F401  (registers enginetap::tap_hash_rows)
from enginetap.core.patching import PatchSet
from enginetap.tap.record import inductor

pytestmark = pytest.mark.slow

WIDTH, ROWS, LAYERS = 128, 7, 3
_lib = torch.library.Library("enginetap_test", "DEF")
_lib.define("experts(Tensor(a0!) output, Tensor input, Tensor weight) -> ()")


def _experts(output: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    output.copy_(torch.nn.functional.silu(x @ w))


_lib.impl("experts", _experts, "CPU")
_lib.impl("experts", lambda output, x, w: None, "Meta")


class Tap:
    """Hashes into ``buffer`` where ``armed`` (the rows of every call, one slot each)."""

    def __init__(self, armed: bool) -> None:
        self.armed, self.slot = armed, 0
        self.buffer = torch.zeros((4 * LAYERS, ROWS + 1), dtype=torch.int64)
        self.index = torch.cat([torch.tensor([ROWS]), torch.arange(ROWS)])

    def __call__(self, value: torch.Tensor) -> None:
        if self.armed:
            torch.ops.enginetap.tap_hash_rows(self.buffer, value, self.index, self.slot)
            self.slot += 1


def layer(tap: Tap, x, residual, gate, shared, experts, norm):
    h = x.float() + residual.float()  # vLLM's fused_add_rms_norm, in torch
    residual = h.to(torch.bfloat16)
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm
    gated = torch.sigmoid(normed @ gate) * (normed @ shared)
    tap(gated)
    routed = torch.empty_like(normed)
    torch.ops.enginetap_test.experts(routed, normed, experts)
    out = gated + routed
    tap(out)
    tap(residual)
    return out, residual


def model(tap: Tap, x, weights):
    residual = torch.zeros_like(x)
    for w in weights:
        x, residual = layer(tap, x, residual, *w)
    return x.float() + residual.float()


@pytest.fixture
def fresh() -> Iterator[None]:
    """No compiled graph or cache entry from before (the scheduler fix is not in
    inductor's cache key)."""
    inductor.stop_observing()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    inductor.stop_observing()
    torch._dynamo.reset()


def _compiled(armed: bool) -> tuple[torch.Tensor, Tap]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 8.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / scale).to(torch.bfloat16)

    weights = [(rand(WIDTH, 1), rand(WIDTH, WIDTH), rand(WIDTH, WIDTH), rand(WIDTH, scale=1))
               for _ in range(LAYERS)]
    tap = Tap(armed)
    out = torch.compile(model, backend="inductor", dynamic=True)(tap, rand(ROWS, WIDTH, scale=1),
                                                                 weights)
    return out, tap


def test_a_tapped_inductor_graph_computes_what_the_untapped_one_does(fresh: None) -> None:
    disarmed, _ = _compiled(armed=False)
    inductor.observe_without_changing()
    armed, tap = _compiled(armed=True)
    assert torch.equal(armed, disarmed)
    assert tap.slot == 3 * LAYERS and bool((tap.buffer[:tap.slot, -1] == 1).all())


def test_the_scheduler_fix_alone_keeps_the_routed_experts_before_their_readers(
        fresh: None) -> None:
    disarmed, _ = _compiled(armed=False)
    patches = PatchSet("test-keep-renames")
    patches.add(inductor.KEEP_RENAMES, inductor._keep_renames)
    patches.install()
    try:
        armed, _ = _compiled(armed=True)  # no copies: tapped values rounded to bf16
    finally:
        patches.uninstall()
    # rounding apart, the same values (their sum read before it was written: off by ~9)
    assert (armed - disarmed).abs().max().item() < 0.25


def test_each_tap_op_reads_its_own_copy_of_the_pointwise_chain() -> None:
    traced = torch.fx.symbolic_trace(lambda a, b, buf, idx: _two_taps(a, b, buf, idx))
    graph = traced.graph
    add = next(n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert inductor.copy_tapped_values(graph) == 2
    taps = [n for n in graph.nodes if n.target is torch.ops.enginetap.tap_hash_rows.default]
    assert [user.target for user in add.users] == [torch.ops.aten.mul.Tensor]
    copies = [t.args[1] for t in taps]
    assert all(c is not add and c.target is add.target for c in copies) and \
        copies[0] is not copies[1]


def _two_taps(a, b, buf, idx):
    s = torch.ops.aten.add.Tensor(torch.ops.aten.sigmoid.default(a), b)
    torch.ops.enginetap.tap_hash_rows.default(buf, s, idx, 0)
    torch.ops.enginetap.tap_hash_rows.default(buf, s, idx, 1)
    return torch.ops.aten.mul.Tensor(s, 2)
