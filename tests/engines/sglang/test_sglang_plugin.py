"""The ``sglang.srt.plugins`` entry point without an engine: disarmed it imports nothing
heavy, a bad arming config is logged and never raised into SGLang, and the CPU fixes go
in only where SGLang runs its CPU engine on enginetap's stand-in. Each case in a fresh
interpreter (what a plugin imports is the point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from enginetap.engines.sglang import plugin
plugin.register()
heavy = sorted(m for m in ("torch", "sglang", "enginetap.core.arming", "enginetap.tap",
                           "enginetap.capture", "enginetap.engines.sglang.worker")
               if m in sys.modules)
print(json.dumps({"heavy": heavy, "fixes": len(plugin._FIXES), "triggers": len(plugin._TRIGGERS)}))
"""


def _register(env: dict[str, str]) -> tuple[dict, str]:
    clean = {k: v for k, v in __import__("os").environ.items()
             if not k.startswith(("ENGINETAP", "SGLANG"))}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_disarmed_register_imports_nothing_heavy_and_installs_nothing() -> None:
    found, _ = _register({})
    assert found == {"heavy": [], "fixes": 0, "triggers": 0}


def test_a_bad_arming_config_is_logged_and_never_raised(tmp_path: Path) -> None:
    bad = tmp_path / "arming.json"
    bad.write_text(json.dumps({"enabled": True, "capabilities": ["no_such_capability"]}))
    found, log = _register({"ENGINETAP_CONFIG": str(bad)})
    assert found["triggers"] == 0
    assert "invalid enginetap arming configuration" in log and "running disarmed" in log
    assert "no_such_capability" in log and "Traceback" not in log


def test_armed_register_installs_one_trigger_and_no_cpu_fix_off_the_cpu_engine(
        tmp_path: Path) -> None:
    found, _ = _register({"ENGINETAP": "1", "ENGINETAP_OUT": str(tmp_path)})
    assert found["triggers"] == 1 and found["fixes"] == 0


def test_cpu_fixes_install_only_with_the_standin() -> None:
    from importlib.util import find_spec

    found, _ = _register({"SGLANG_USE_CPU_ENGINE": "1"})
    standin = find_spec("sgl_kernel") is not None
    assert found["fixes"] == (1 if standin else 0)
    assert found["triggers"] == 0
