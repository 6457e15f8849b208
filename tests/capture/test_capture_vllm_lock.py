"""The capture drift lock shipped with enginetap, and the ISA unpacking the adapters learn
from vLLM's own packing ops (no engine is started: vLLM's modules and kernels only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from enginetap.engines.vllm.probes import GROUPS, LOCK, LOCKED_TARGETS, PROBES  # noqa: E402
from enginetap.engines.vllm.probes.packing import (  # noqa: E402
    kv_unpacker,
    learn_permutation,
    moe_weight_unpacker,
    unpack,
)
from enginetap.engines.vllm.worker import VLLMHooks  # noqa: E402
from enginetap.guard.lock import GuardLock  # noqa: E402


def test_the_shipped_lock_pins_every_target_and_matches_this_vllm():
    lock = GuardLock.load(LOCK.file)
    assert {e.target for e in lock.entries} == set(LOCKED_TARGETS)
    kept, refused = LOCK.checked_probes()
    assert refused == {} and [p.name for p in kept] == [p.name for p in PROBES]
    hooks = VLLMHooks("v1")
    assert [p.name for p in hooks.capture_probes()] == [p.name for p in PROBES]
    assert hooks.engine_version().startswith("vllm")


def test_a_drifted_source_refuses_its_probes_by_name(tmp_path: Path, caplog):
    data = json.loads(LOCK.file.read_text())
    attention_target = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"
    for entry in data["entries"]:
        if entry["target"] == attention_target:
            entry["digest"] = "0" * 64
    drifted = tmp_path / "capture.lock"
    drifted.write_text(json.dumps(data))
    with caplog.at_level(logging.ERROR, logger="enginetap.capture"):
        kept, refused = LOCK.checked_probes(drifted)
    assert set(refused) == {"vllm.cpu_attn.prefill", "vllm.cpu_attn.decode"}
    assert all(attention_target in why for why in refused.values())
    assert {p.name for p in kept} == {p.name for p in PROBES} - set(refused)
    assert "vllm.cpu_attn.prefill" in caplog.text and "Fix:" in caplog.text


def test_an_unreadable_lock_refuses_every_probe(tmp_path: Path):
    broken = tmp_path / "capture.lock"
    broken.write_text("{not json")
    kept, refused = LOCK.checked_probes(broken)
    assert kept == [] and set(refused) == {p.name for group, _ in GROUPS for p in group}


def test_learn_permutation_recovers_a_known_layout():
    perm = learn_permutation((3, 300), lambda t: t.t().contiguous())
    plain = torch.randn(2, 3, 300).to(torch.bfloat16)
    packed = plain.transpose(1, 2).contiguous()
    assert torch.equal(unpack(packed, perm, (3, 300)), plain)
    with pytest.raises(ValueError, match="not a permutation"):
        learn_permutation((4, 4), lambda t: torch.zeros_like(t))


def _isas() -> list[str]:
    return (["amx"] if torch.cpu._is_amx_tile_supported() else []) + ["vec", "vec16"]


@pytest.mark.parametrize("isa", _isas())
def test_kv_pages_unpack_to_what_was_written(isa: str):
    from vllm import _custom_ops as ops

    heads, block, dim, blocks = 2, 32, 64, 3
    keys = torch.randn(blocks * block, heads, dim).to(torch.bfloat16)
    values = torch.randn(blocks * block, heads, dim).to(torch.bfloat16)
    cache = torch.zeros(blocks, heads, 2 * block, dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.randperm(blocks * block)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    for half, which, written in ((key_cache, "key", keys), (value_cache, "value", values)):
        perm = kv_unpacker(isa, heads, block, dim, torch.bfloat16, which)
        plain = unpack(half.contiguous(), perm, (block, heads, dim)).reshape(-1, heads, dim)
        assert torch.equal(plain[slots], written), which


@pytest.mark.parametrize("isa", [i for i in _isas() if i != "vec16"])
def test_moe_weights_unpack_to_the_loaded_weights(isa: str):
    from vllm import _custom_ops as ops

    weights = torch.randn(3, 128, 64).to(torch.bfloat16)
    packed = ops.cpu_prepack_moe_weight(weights, isa)
    perm = moe_weight_unpacker(isa, 128, 64, torch.bfloat16)
    assert torch.equal(unpack(packed, perm, (128, 64)), weights)
