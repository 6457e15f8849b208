"""The ``vllm.general_plugins`` entry point as vLLM loads it (no engine started): disarmed it
loads nothing of ours; armed it waits for a model runner; a bad config never raises."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from vllm_harness import child_env

from enginetap.engines.vllm import plugin
from enginetap.engines.vllm.plugin import register

pytest.importorskip("vllm")

# What vLLM does in each of its processes, then what the process holds afterwards.
LOAD = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
loaded = sorted(m for m in sys.modules if m.startswith(("enginetap", "vllm.v1.worker.gpu_")))
if len(sys.argv) > 1:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    loaded.append(type(vars(GPUModelRunner)["__init__"]).__name__)
print(json.dumps(loaded))
"""


def _load(env: dict[str, str], *args: str) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-c", LOAD, *args], env=child_env(env),
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], str, Path]]:
    """The plugin tests' child interpreters, two at a time (each is mostly vLLM's import)."""
    from tests.pairwise import side_by_side

    out = {name: tmp_path_factory.mktemp(f"plugin-{name}")
           for name in ("disarmed", "armed", "armed-runner", "missing")}
    jobs = {
        "disarmed": ({}, ("import-runner",)),
        "armed": ({"ENGINETAP": "1", "ENGINETAP_OUT": str(out["armed"])}, ()),
        "armed-runner": ({"ENGINETAP": "1", "ENGINETAP_OUT": str(out["armed-runner"])},
                         ("import-runner",)),
        "missing": ({"ENGINETAP_CONFIG": str(out["missing"] / "missing.json")},
                    ("import-runner",)),
    }
    loaded = side_by_side([lambda env=env, args=args: _load(env, *args)
                           for env, args in jobs.values()])
    return {name: (*result, out[name]) for name, result in zip(jobs, loaded)}


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names["enginetap"] == "enginetap.engines.vllm.plugin:register"


@pytest.mark.slow
def test_disarmed_plugin_loads_nothing_and_patches_nothing(loads):
    loaded, _, _ = loads["disarmed"]
    assert loaded[-1] == "function"  # the runner's __init__ is vLLM's own
    assert not {m for m in loaded if m.startswith("enginetap.core")}
    assert "enginetap.engines.vllm.worker" not in loaded


@pytest.mark.slow
def test_armed_plugin_waits_for_a_model_runner(loads):
    loaded, _, _ = loads["armed"]
    assert "enginetap.engines.vllm.worker" in loaded
    assert "vllm.v1.worker.gpu_model_runner" not in loaded  # nothing heavy imported early
    loaded, _, out = loads["armed-runner"]
    assert loaded[-1] == "FunctionWrapper"  # armed when a runner is constructed
    # no runner was constructed: nothing armed, nothing written
    assert not list(out.iterdir()) and not list(loads["armed"][2].iterdir())


@pytest.mark.slow
def test_missing_config_is_reported_and_vllm_goes_on(loads):
    loaded, stderr, _ = loads["missing"]
    assert "running disarmed" in stderr and "cannot be read" in stderr
    assert loaded[-1] == "function"


@pytest.mark.parametrize("config, why", [
    ({"enabled": True, "capabilities": ["stepp"]}, "capabilities"),
    ({"enabled": True, "options": {"step": {"recrod": True}}}, "recrod"),
    ({"enabled": True, "options": {"guard": {"patches": ["no_colon"]}}}, "no_colon"),
])
def test_invalid_arming_is_reported_and_nothing_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        config: dict, why: str):
    path = tmp_path / "arming.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("ENGINETAP_CONFIG", str(path))
    register()  # never raises
    assert "running disarmed" in caplog.text
    assert why in caplog.text
    assert not plugin._TRIGGERS
