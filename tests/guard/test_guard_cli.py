"""`enginetap guard pin` / `check`, and arming guard patches from the config."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from enginetap.cli.main import app, main
from enginetap.config import ArmConfig
from enginetap.errors import ConfigError
from enginetap.guard import install_configured

INSTALLED: list[str] = []


def install_for_test() -> None:
    """An install function named in options.guard.patches."""
    INSTALLED.append("called")


@pytest.fixture
def engine_module(tmp_path):
    name = f"guard_cli_{uuid.uuid4().hex[:10]}"
    path = tmp_path / f"{name}.py"
    path.write_text("class Kernel:\n    def run(self, x):\n        return x * 2\n\n"
                    "def launch(x):\n    return Kernel().run(x)\n")
    yield name, path
    sys.modules.pop(name, None)


def _invoke(*args: str):
    return CliRunner().invoke(app, ["guard", *args], catch_exceptions=False)


def test_pin_then_check_then_drift(engine_module, tmp_path):
    name, path = engine_module
    lock = tmp_path / "guard.lock"
    result = _invoke("pin", f"{name}:launch", f"{name}:Kernel.run", "-o", str(lock),
                     "-p", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"pinned {name}:Kernel.run (function)" in result.output
    assert [e["target"] for e in json.loads(lock.read_text())["entries"]] == [
        f"{name}:Kernel.run", f"{name}:launch"]
    assert _invoke("check", str(lock), "-p", str(tmp_path)).exit_code == 0
    # A fresh process sees the rewritten file: what a user runs after an engine upgrade.
    path.write_text("class Kernel:\n    def run(self, x):\n        return x + x\n")
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", "guard", "check",
                           str(lock), "-p", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("DRIFT")]
    assert len(lines) == 2
    assert f"{name}:Kernel.run: changed (locked " in lines[0] and ", now " in lines[0]
    assert f"{name}:launch: vanished" in lines[1]
    assert "2 of 2 target(s) drifted" in done.stdout


def test_boundary_errors_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["enginetap", "guard", "check", str(tmp_path / "x.lock")])
    with pytest.raises(SystemExit) as caught:
        main()
    assert caught.value.code == 2 and "not found" in capsys.readouterr().err


def test_install_configured_calls_each_patch_when_armed():
    INSTALLED.clear()
    spec = f"{__name__}:install_for_test"
    armed = ArmConfig(enabled=True, capabilities=["guard"], options={"guard": {"patches": [spec]}})
    assert install_configured(armed) == [spec] and INSTALLED == ["called"]
    not_guard = ArmConfig(enabled=True, capabilities=["step"], options=armed.options)
    assert install_configured(not_guard) == [] and INSTALLED == ["called"]
    broken = ArmConfig(enabled=True, capabilities=["guard"],
                       options={"guard": {"patches": [f"{__name__}:no_such_function"]}})
    with pytest.raises(ConfigError, match="cannot load guard patch"):
        install_configured(broken)
