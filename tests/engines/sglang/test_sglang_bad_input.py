"""Bad input on the SGLang path: one clear line and exit 2 each, never a traceback, and
nothing started. SGLang missing is checked in a venv without it (the main one); an
unsupported SGLang version and a model the SGLang path does not cover in SGLang's venv
(``sglang``-marked: skipped where SGLang is not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.sglang.conftest import child_env, have_sglang


def _tap_run(model: str, out: Path, env: dict[str, str] | None = None,
             prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = (f"{prelude}\nfrom enginetap.cli.main import main\nimport sys\n"
            f"sys.argv = ['enginetap', 'tap', 'run', '--engine', 'sglang', '--model', "
            f"{model!r}, '--prompts', 'builtin:short', '--out', {str(out)!r}]\nmain()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env or child_env(), timeout=300)


@pytest.mark.skipif(have_sglang(), reason="SGLang is installed in this venv")
def test_sglang_not_installed_is_one_line(tmp_path: Path) -> None:
    done = _tap_run("builtin:llama", tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert "SGLang is not installed" in done.stderr and "Traceback" not in done.stderr
    assert "make install-sglang" in done.stderr
    assert not (tmp_path / "out" / "arming.json").exists()


@pytest.mark.sglang
def test_an_unsupported_sglang_version_is_one_line(tmp_path: Path) -> None:
    prelude = "import enginetap.engines.sglang.plugin as p; p.SUPPORTED = ('0.4.0',)"
    done = _tap_run("builtin:llama", tmp_path / "out", prelude=prelude)
    assert done.returncode == 2, done.stderr
    assert "SGLang 0.5.23 is not a supported version" in done.stderr
    assert "Traceback" not in done.stderr and "guard check" in done.stderr


@pytest.mark.sglang
def test_a_model_the_sglang_path_does_not_cover_is_one_line(tmp_path: Path) -> None:
    from enginetap.models import build_model

    done = _tap_run(str(build_model("glm4_moe")), tmp_path / "out")
    assert done.returncode == 2, done.stderr
    assert "Glm4MoeForCausalLM is not covered by enginetap on SGLang" in done.stderr
    assert "Traceback" not in done.stderr
