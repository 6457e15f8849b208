"""Arming is read from the environment once, validated, and reported clearly when wrong."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from enginetap import config
from enginetap.errors import ConfigError


def test_disarmed_by_default():
    cfg = config.load_config({})
    assert not cfg.enabled and not config.env_says_armed({})


def test_env_arms_with_capabilities_and_step_implied(tmp_path):
    env = {"ENGINETAP": "1", "ENGINETAP_CAPABILITIES": "scope, guard", "ENGINETAP_OUT": str(tmp_path)}
    cfg = config.load_config(env)
    assert cfg.enabled and cfg.capabilities == ["step", "scope", "guard"]
    assert cfg.out_dir == tmp_path


def test_config_file_then_env_overrides(tmp_path):
    path = tmp_path / "arm.json"
    path.write_text(json.dumps({"capabilities": ["guard"], "options": {"guard": {"mode": "compare"}},
                                "request_filter": "req-"}))
    cfg = config.load_config({"ENGINETAP_CONFIG": str(path), "ENGINETAP_REQUESTS": "abc"})
    assert cfg.enabled and cfg.capabilities == ["step", "guard"]
    assert cfg.options == {"guard": {"mode": "compare"}} and cfg.request_filter == "abc"


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"capabilities": ["teleport"]}), "capabilities"),
    (json.dumps({"unknown_field": 1}), "unknown_field"),
])
def test_bad_config_files_say_what_and_how(tmp_path, content, needle):
    path = tmp_path / "arm.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        config.load_config({"ENGINETAP_CONFIG": str(path)})
    assert needle in str(info.value) and "Fix:" in str(info.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="cannot be read"):
        config.load_config({"ENGINETAP_CONFIG": "/nonexistent/arm.json"})


def test_enabled_false_and_engintap_0_disarm(tmp_path):
    path = tmp_path / "arm.json"
    path.write_text(json.dumps({"enabled": False, "capabilities": ["guard"]}))
    assert not config.load_config({"ENGINETAP_CONFIG": str(path)}).enabled
    path.write_text(json.dumps({"capabilities": ["guard"]}))
    assert config.load_config({"ENGINETAP_CONFIG": str(path)}).enabled
    assert not config.load_config({"ENGINETAP_CONFIG": str(path), "ENGINETAP": "0"}).enabled
    assert not config.env_says_armed({"ENGINETAP_CONFIG": str(path), "ENGINETAP": "off"})
    # ENGINETAP=1 arms even a file that says enabled: false
    path.write_text(json.dumps({"enabled": False}))
    assert config.load_config({"ENGINETAP_CONFIG": str(path), "ENGINETAP": "1"}).enabled


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_config_that_is_not_a_json_file_is_one_clear_error(tmp_path, kind):
    path = tmp_path / "arm.json"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ConfigError) as info:
        config.load_config({"ENGINETAP_CONFIG": str(path)})
    assert ("not a regular file" if kind == "directory" else "not UTF-8") in str(info.value)


def test_unknown_capability_options_are_refused_when_parsed(tmp_path):
    path = tmp_path / "arm.json"
    path.write_text(json.dumps({"options": {"guard": {"mode": "always"}}}))
    with pytest.raises(ConfigError, match="options.guard"):
        config.load_config({"ENGINETAP_CONFIG": str(path)})
    path.write_text(json.dumps({"options": {"teleport": {}}}))
    with pytest.raises(ConfigError, match="unknown capability 'teleport'"):
        config.load_config({"ENGINETAP_CONFIG": str(path)})


def test_engines_disarm_on_a_bad_environment_config_unless_strict(tmp_path, caplog):
    path = tmp_path / "arm.json"
    path.write_text("{broken")
    env = {"ENGINETAP_CONFIG": str(path)}
    with caplog.at_level("ERROR", logger="enginetap.config"):
        assert not config.resolve_process_config(env).enabled
    assert "not valid JSON" in caplog.text and "running disarmed" in caplog.text
    with pytest.raises(ConfigError, match="not valid JSON"):
        config.resolve_process_config({**env, "ENGINETAP_STRICT": "1"})


def test_arming_is_read_once(monkeypatch):
    monkeypatch.setenv("ENGINETAP", "1")
    first = config.arming()
    monkeypatch.setenv("ENGINETAP", "0")
    assert config.arming() is first and first.enabled
    config.reset_arming()
    assert not config.arming().enabled


def test_importing_enginetap_does_not_import_torch_or_engines():
    code = ("import sys, enginetap, enginetap.config, enginetap.errors, enginetap.core.patching, "
            "enginetap.core.context, enginetap.core.ranks, enginetap.dataset.schema; "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_parsing_an_arming_config_imports_no_torch():
    code = ("import sys, enginetap.config as c; "
            "c.ArmConfig(enabled=True, capabilities=['guard', 'capture']); "
            "print([m for m in ('torch', 'vllm', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
