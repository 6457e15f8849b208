"""What the capture, tap and explain jobs share to get an engine: the model folder, the
arming file and the environment that arms the engine's processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.errors import ConfigError
from enginetap.jobs.engine import arm_processes, resolve_model, write_arming


def test_a_builtin_model_is_built_and_a_folder_needs_its_config(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    assert (resolve_model("builtin:llama") / "config.json").is_file()
    with pytest.raises(ConfigError, match="no model at .*empty.*no config.json"):
        resolve_model(str(tmp_path / "empty"))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model("~/m") == tmp_path / "m"


def test_arming_processes_points_every_process_at_one_file(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tmp_path,
                       options={"tap": {"max_rows": 4}, "step": {"record": False}})
    path = write_arming(config, tmp_path / "run" / "arming.json")
    assert ArmConfig.model_validate_json(path.read_text()) == config
    for name in ARMING_VARS:
        monkeypatch.setenv(name, "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    arm_processes(path)
    armed = {name: os.environ.get(name) for name in ARMING_VARS}
    assert armed.pop("ENGINETAP_CONFIG") == str(path)
    assert set(armed.values()) == {None}  # no other variable overrides the file
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    arm_processes(path, tp=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    arm_processes(path, tp=2)  # a binding the user set is kept
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
