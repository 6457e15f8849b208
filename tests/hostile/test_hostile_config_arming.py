"""Hostile arming configs in a real built-in engine (tiny llama): the engine serves on.

An ``ENGINETAP_CONFIG`` nested 100k deep or holding a 5,000-digit integer raised
RecursionError/ValueError out of the engine's constructor; a capture armed with an output
directory under a regular file, or with a NUL byte in it, did the same. Now the config
case runs disarmed with one logged line (or refuses with a ConfigError under
``ENGINETAP_STRICT=1``), and capture disarms itself, says why, and the engine's tokens
are those of a disarmed engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.errors import ConfigError

PROMPTS = ["kernels and caches", "hi"]


def _tokens(engine: HFEngine) -> list[list[int]]:
    done = engine.generate([Request(request_id=f"q{i}", prompt=p, max_new_tokens=3)
                            for i, p in enumerate(PROMPTS)])
    return [c.output_ids for c in done]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _tokens(HFEngine.from_builtin("llama", dtype=torch.float32, arm=ArmConfig()))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.chdir(tmp_path)  # a config that arms anyway writes to ./enginetap-out
    for name in ARMING_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    disarm()


CONFIGS = {
    "deep": '{"enabled": true, "options": {"step": ' + "[" * 100_000 + "]" * 100_000 + "}}",
    "giant_int": '{"enabled": true, "options": {"capture": {"budget_bytes": '
                 + "7" * 5000 + "}}}",
    "big_int": '{"enabled": true, "options": {"capture": {"budget_bytes": '
               + "7" * 4000 + "}}}",
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_hostile_config_file_runs_the_engine_disarmed(tmp_path, clean_env, caplog,
                                                        reference, case) -> None:
    path = tmp_path / "arm.json"
    path.write_text(CONFIGS[case])
    clean_env.setenv("ENGINETAP_CONFIG", str(path))
    with caplog.at_level(logging.ERROR, logger="enginetap"):
        engine = HFEngine.from_builtin("llama", dtype=torch.float32)
    assert engine.arming is None
    assert _tokens(engine) == reference
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("enginetap")]
    assert len(lines) == 1 and "running disarmed" in lines[0], lines
    assert str(path) in lines[0] and len(lines[0]) < 600, lines[0]


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_strict_refuses_a_hostile_config_with_a_config_error(tmp_path, clean_env,
                                                             case) -> None:
    path = tmp_path / "arm.json"
    path.write_text(CONFIGS[case])
    clean_env.setenv("ENGINETAP_CONFIG", str(path))
    clean_env.setenv("ENGINETAP_STRICT", "1")
    with pytest.raises(ConfigError, match=str(path)):
        HFEngine.from_builtin("llama", dtype=torch.float32)


def _capture_config(tmp_path: Path, where: str) -> ArmConfig:
    (tmp_path / "a-file").write_text("not a directory")
    bad = {"under_file": str(tmp_path / "a-file" / "ds"), "nul": str(tmp_path / "d\0s")}[where]
    return ArmConfig(enabled=True, capabilities=["capture", "tap"], out_dir=tmp_path / "run",
                     options={"capture": {"dataset": bad}})


@pytest.mark.parametrize("where", ["under_file", "nul"])
def test_capture_with_an_unusable_dataset_disarms_itself(tmp_path, clean_env, caplog,
                                                         reference, where) -> None:
    with caplog.at_level(logging.ERROR, logger="enginetap"):
        engine = HFEngine.from_builtin("llama", dtype=torch.float32,
                                       arm=_capture_config(tmp_path, where))
        tokens = _tokens(engine)
    assert tokens == reference
    assert engine.arming is not None
    assert any("capture (disarmed" in what for what in engine.arming.armed), engine.arming.armed
    # the rest of the arming serves on: the tap recorded the run
    assert (tmp_path / "run" / "tap-rank0.jsonl").stat().st_size > 0
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("enginetap")]
    assert len(lines) == 1 and "capture" in lines[0] and "Fix:" in lines[0], lines


@pytest.mark.parametrize("where", ["under_file", "nul"])
def test_capture_out_dir_itself_unusable_disarms_capture(tmp_path, clean_env, reference,
                                                         where) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    out = {"under_file": tmp_path / "a-file" / "run", "nul": tmp_path / "r\0un"}[where]
    engine = HFEngine.from_builtin("llama", dtype=torch.float32, arm=ArmConfig(
        enabled=True, capabilities=["capture"], out_dir=out))
    assert _tokens(engine) == reference
    assert any("capture (disarmed" in what for what in engine.arming.armed)


def test_every_rank_disarms_capture_alike(tmp_path, clean_env, reference) -> None:
    """Rank 0 alone creates the dataset, but every rank's probes take part in gathers: a
    directory that disarms rank 0 disarms rank 1 too (else rank 1 would gather alone)."""
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    engine = HFEngine.from_builtin("llama", dtype=torch.float32,
                                   arm=_capture_config(tmp_path, "under_file"))
    assert engine.arming is not None and engine.arming.rank == 1
    assert any("capture (disarmed" in what for what in engine.arming.armed), engine.arming.armed
    assert _tokens(engine) == reference
