"""Exactness proof per key on real torch computations, in one process."""

from __future__ import annotations

import gc
import json
import logging
import weakref

import pytest
import torch
from safetensors import safe_open

from pydantic import ValidationError

from enginetap.capabilities import arm
from enginetap.config import ArmConfig
from enginetap.errors import ConfigError
from enginetap.guard import ExactnessError, ExactPatch

HERE = __name__
CALLS: dict[str, int] = {}


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


@pytest.fixture(autouse=True)
def _fresh_counts():
    CALLS.clear()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    _count("stock")
    return _rms(x, weight, eps)


def rms_norm_by_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Row chunks, concatenated: RMSNorm is row-local, so this is bit-exact."""
    _count("patched")
    return _by_rows(x, weight, eps)


def _by_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.cat([_rms(chunk, weight, eps) for chunk in x.split(3)])


def rms_norm_split_above_8(x: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6) -> torch.Tensor:
    """Exact up to 8 rows; above, squares are summed per half in the input dtype (inexact)."""
    _count("patched")
    if x.shape[0] <= 8:
        return _by_rows(x, weight, eps)
    halves = x.split(x.shape[-1] // 2, dim=-1)
    var = sum(h.pow(2).sum(-1, keepdim=True).float() for h in halves) / x.shape[-1]
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _count("stock")
    return a @ b


def matmul_split_k(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Split-K: partial products over four K slices, summed afterwards."""
    _count("patched")
    parts = [a[:, k:k + a.shape[1] // 4] @ b[k:k + a.shape[1] // 4] for k in
             range(0, a.shape[1], a.shape[1] // 4)]
    return torch.stack(parts).sum(0)


def scale_into(out: torch.Tensor, x: torch.Tensor, factor: float) -> None:
    """A kernel-style op: writes its result into ``out``."""
    _count("stock")
    torch.mul(x, factor, out=out)


def scale_into_copy(out: torch.Tensor, x: torch.Tensor, factor: float) -> None:
    _count("patched")
    out.copy_(x * factor)


def scale_into_forgetful(out: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    _count("patched")
    return x * factor


class Norm:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _count("stock")
        return _rms(x, self.weight, 1e-6)


def norm_forward_by_rows(self: Norm, x: torch.Tensor) -> torch.Tensor:
    _count("patched")
    return torch.cat([_rms(c, self.weight, 1e-6) for c in x.split(2)])


def _inputs(rows: int, width: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    return x, (1 + 0.1 * torch.randn(width, generator=g)).to(torch.bfloat16)


def _module() -> object:
    import sys

    return sys.modules[HERE]


def test_exact_alternative_is_chosen_and_then_runs_alone():
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_by_rows, mode="check") as patch:
        x, w = _inputs(10)
        expected = _rms(x, w, 1e-6)
        assert torch.equal(_module().rms_norm(x, w), expected)
        assert CALLS == {"stock": 1, "patched": 1}
        for _ in range(3):
            assert torch.equal(_module().rms_norm(x, w), expected)
        assert CALLS == {"stock": 1, "patched": 4}
        (decision,) = patch.decisions.values()
        assert decision.patched and decision.local_exact and "bit-exact" in decision.reason
        assert patch.errors == []


def test_split_k_matmul_is_told_apart_and_falls_back():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(16, 256, generator=g), torch.randn(256, 32, generator=g)
    with ExactPatch(f"{HERE}:matmul", matmul_split_k) as patch:
        for _ in range(3):
            assert torch.equal(_module().matmul(a, b), a @ b)
        (decision,) = patch.decisions.values()
    assert not decision.patched and "elements differ" in decision.reason
    assert CALLS == {"stock": 3, "patched": 1}


def test_decisions_are_per_shape():
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8) as patch:
        for rows in (4, 32, 8, 100, 4, 32):
            x, w = _inputs(rows)
            assert torch.equal(_module().rms_norm(x, w), _rms(x, w, 1e-6))
        chosen = {key[0][0][0]: d.patched for key, d in patch.decisions.items()}
    assert chosen == {4: True, 8: True, 32: False, 100: False}


def test_in_place_outputs_are_compared_and_the_caller_gets_the_stock_writes():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    with ExactPatch(f"{HERE}:scale_into", scale_into_copy, mutates=["out"]) as patch:
        out = torch.full_like(x, 7.0)
        _module().scale_into(out, x, 3.0)
        assert torch.equal(out, x * 3.0)
        out2 = torch.full_like(x, 7.0)
        _module().scale_into(out2, x, 3.0)  # proven: the patched path writes it alone
        assert torch.equal(out2, x * 3.0) and CALLS == {"stock": 1, "patched": 2}
        assert next(iter(patch.decisions.values())).patched
    with ExactPatch(f"{HERE}:scale_into", scale_into_forgetful) as patch:
        out = torch.full_like(x, 7.0)
        _module().scale_into(out, x, 3.0)
        assert torch.equal(out, x * 3.0)
        (decision,) = patch.decisions.values()
    assert not decision.patched and "arg.out" in decision.reason


def test_a_misspelt_mutated_argument_is_refused_not_trusted():
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(8))
    with ExactPatch(f"{HERE}:scale_into", scale_into_copy, mutates=["output"]) as patch:
        out = torch.full_like(x, 7.0)
        _module().scale_into(out, x, 2.0)
        (decision,) = patch.decisions.values()
    assert torch.equal(out, x * 2.0) and CALLS == {"stock": 1}
    assert not decision.patched and "does not take" in decision.reason


def test_methods_receive_self_and_keys_ignore_the_instance():
    _, w = _inputs(1)
    norms = [Norm(w), Norm(w.flip(0))]
    with ExactPatch(f"{HERE}:Norm.forward", norm_forward_by_rows) as patch:
        for norm in norms:
            x, _ = _inputs(7)
            assert torch.equal(norm.forward(x), _rms(x, norm.weight, 1e-6))
        assert len(patch.decisions) == 1 and CALLS == {"stock": 1, "patched": 2}


def test_patched_outputs_and_clones_are_not_kept():
    seen: list[weakref.ref] = []

    def recording(x, weight, eps=1e-6):
        out = rms_norm_by_rows(x, weight, eps)
        seen.extend([weakref.ref(out), weakref.ref(x)])
        return out

    with ExactPatch(f"{HERE}:rms_norm", recording, mode="compare"):
        x, w = _inputs(12)
        result = _module().rms_norm(x, w)
        gc.collect()
        assert result is not None and [r() for r in seen] == [None, None]


def test_lru_bound_evicts_and_reproves():
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_by_rows, max_keys=2) as patch:
        for rows in (2, 3, 4):
            _module().rms_norm(*_inputs(rows))
        assert [k[0][0][0] for k in patch.decisions] == [3, 4]
        _module().rms_norm(*_inputs(2))  # evicted: proven again, both paths run
        assert CALLS == {"stock": 4, "patched": 4}
        assert [k[0][0][0] for k in patch.decisions] == [4, 2]


def test_custom_key_function():
    def by_size(args, kwargs):
        return "small" if args[0].shape[0] <= 8 else "large"

    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8, key=by_size) as patch:
        for rows in (3, 5, 20):
            _module().rms_norm(*_inputs(rows))
        assert {k: d.patched for k, d in patch.decisions.items()} == {"small": True,
                                                                      "large": False}


def test_a_raising_patched_path_falls_back():
    def broken(x, weight, eps=1e-6):
        raise RuntimeError("kernel not built for this shape")

    with ExactPatch(f"{HERE}:rms_norm", broken) as patch:
        x, w = _inputs(5)
        assert torch.equal(_module().rms_norm(x, w), _rms(x, w, 1e-6))
        (decision,) = patch.decisions.values()
    assert not decision.patched and "kernel not built" in decision.reason


def test_decisions_are_logged_once_per_key(caplog):
    caplog.set_level(logging.INFO, logger="enginetap.guard")
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8):
        for rows in (4, 4, 20, 20, 4):
            _module().rms_norm(*_inputs(rows))
    lines = [r.getMessage() for r in caplog.records if r.name == "enginetap.guard"]
    assert len(lines) == 2
    assert "bfloat16[4, 64]" in lines[0] and "-> patched" in lines[0]
    assert "bfloat16[20, 64]" in lines[1] and "-> stock" in lines[1]


def test_compare_mode_serves_stock_logs_every_mismatch_and_dumps_the_first(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="enginetap.guard")
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8, mode="compare",
                    dump_dir=tmp_path) as patch:
        for rows in (20, 4, 20, 30):
            x, w = _inputs(rows)
            assert torch.equal(_module().rms_norm(x, w), _rms(x, w, 1e-6))
        assert CALLS == {"stock": 4, "patched": 4}
        assert patch.mismatches == 3 and patch.decisions == {}
        (dump,) = patch.dumps
    assert len([r for r in caplog.records if "): mismatch: out:" in r.getMessage()]) == 3
    with safe_open(str(dump), framework="pt") as f:
        x, w = _inputs(20)
        assert torch.equal(f.get_tensor("input.x"), x)
        assert torch.equal(f.get_tensor("stock.out"), _rms(x, w, 1e-6))
        assert not torch.equal(f.get_tensor("patched.out"), f.get_tensor("stock.out"))
        assert f.metadata()["key"].startswith("(bfloat16[20, 64]")


def test_strict_mode_raises_on_the_first_mismatch():
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8, mode="strict"):
        _module().rms_norm(*_inputs(4))
        with pytest.raises(ExactnessError, match="elements differ"):
            _module().rms_norm(*_inputs(20))


def test_off_mode_runs_stock_only():
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_by_rows, mode="off") as patch:
        _module().rms_norm(*_inputs(4))
        assert CALLS == {"stock": 1} and patch.decisions == {}
        patch.mode = "check"
        _module().rms_norm(*_inputs(4))
        assert CALLS == {"stock": 2, "patched": 1}
        with pytest.raises(ConfigError, match="unknown guard mode"):
            patch.mode = "sometimes"  # type: ignore[assignment]


def test_mode_and_records_come_from_the_installed_arming(tmp_path):
    armed = arm(ArmConfig(enabled=True, capabilities=["guard"], out_dir=tmp_path,
                          options={"guard": {"mode": "compare", "max_keys": 3}}))
    try:
        _patch_under_arming(tmp_path)
    finally:
        armed.uninstall()
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_by_rows) as patch:  # disarmed: defaults
        assert (patch.mode, patch.dump_dir) == ("check", None)
    with pytest.raises(ValidationError, match="options.guard"):
        ArmConfig(enabled=True, options={"guard": {"mode": "always"}})


def _patch_under_arming(tmp_path):
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8) as patch:
        assert (patch.mode, patch.max_keys) == ("compare", 3)
        _module().rms_norm(*_inputs(20))
        assert patch.dumps and patch.dumps[0].parent == tmp_path / "guard-dumps"
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_split_above_8, mode="check"):
        _module().rms_norm(*_inputs(4))
    records = (tmp_path / "guard-rank0.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in records]
    assert [(e["event"], e["mode"]) for e in events] == [("mismatch", "compare"),
                                                         ("decision", "check")]
    assert events[1]["chosen"] == "patched" and events[1]["key"].startswith("(bfloat16[4, 64]")
    assert all(isinstance(e["step"], int) for e in events)  # mergeable like step records


def test_applies_false_runs_stock_with_no_proof():
    small = lambda instance, args, kwargs: args[0].shape[0] <= 8  # noqa: E731
    with ExactPatch(f"{HERE}:rms_norm", rms_norm_by_rows, mode="check", applies=small) as patch:
        x, w = _inputs(12)
        assert torch.equal(_module().rms_norm(x, w), _rms(x, w, 1e-6))
        assert CALLS == {"stock": 1} and patch.decisions == {}
        _module().rms_norm(*_inputs(6))
        assert CALLS == {"stock": 2, "patched": 1} and len(patch.decisions) == 1


def test_tolerance_accepts_a_close_result_and_says_how_close():
    # Split-K float32 matmul: summation order changes, values stay within 1e-3 here.
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(16, 256, generator=g), torch.randn(256, 32, generator=g)
    with ExactPatch(f"{HERE}:matmul", matmul_split_k, tolerance=1e-3) as patch:
        _module().matmul(a, b)
        (decision,) = patch.decisions.values()
        assert decision.patched and "within tolerance" in decision.reason
        assert "max abs diff" in decision.reason
    with ExactPatch(f"{HERE}:matmul", matmul_split_k, tolerance=1e-9) as strict:
        _module().matmul(a, b)
        assert not next(iter(strict.decisions.values())).patched
    with pytest.raises(ConfigError, match="tolerance"):
        ExactPatch(f"{HERE}:matmul", matmul_split_k, tolerance=-1.0)
