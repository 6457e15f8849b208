"""`models build --out DIR` over a build whose files were edited, or beside the user's
own files: without --force nothing is deleted; the refusal says what, why and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginetap.errors import ConfigError
from enginetap.models import build_model
from enginetap.models.builder import MARKER


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def built(tmp_path: Path) -> Path:
    return build_model("llama", out_dir=tmp_path / "m")


def test_an_edited_build_and_the_users_files_survive_without_force(built: Path) -> None:
    (built / "notes.txt").write_text("my notes")
    config = json.loads((built / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (built / "config.json").write_text(json.dumps(config))
    before = _listing(built)
    with pytest.raises(ConfigError) as refused:
        build_model("llama", out_dir=built)
    message = str(refused.value)
    assert "config.json" in message and "--force" in message, message
    assert _listing(built) == before


def test_a_user_file_beside_an_intact_build_survives(built: Path) -> None:
    (built / "notes.txt").write_text("my notes")
    (built / "tokenizer.json").unlink()  # the build is incomplete: it would be rebuilt
    before = _listing(built)
    with pytest.raises(ConfigError, match="notes.txt"):
        build_model("llama", out_dir=built)
    assert _listing(built) == before


def test_force_replaces_an_edited_build(built: Path) -> None:
    original = (built / "config.json").read_bytes()
    (built / "config.json").write_text("{}")
    assert build_model("llama", out_dir=built, force=True) == built
    assert (built / "config.json").read_bytes() == original
    assert (built / MARKER).is_file()


def test_an_intact_build_is_reused_and_an_older_pristine_one_rebuilt(built: Path) -> None:
    assert build_model("llama", out_dir=built) == built
    marker = json.loads((built / MARKER).read_text())
    marker["key"] = "0000000000"  # built by an older builder, files untouched
    (built / MARKER).write_text(json.dumps(marker))
    assert build_model("llama", out_dir=built) == built
    assert json.loads((built / MARKER).read_text())["key"] != "0000000000"


def test_the_cli_refusal_is_one_line_and_exit_2(built: Path, monkeypatch, capsys) -> None:
    import sys

    from enginetap.cli.main import main

    (built / "notes.txt").write_text("my notes")
    (built / "generation_config.json").write_text("{}")
    before = _listing(built)
    monkeypatch.setattr(sys, "argv", ["enginetap", "models", "build", "llama", "--out",
                                      str(built)])
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot rebuild llama"), err
    assert "notes.txt" in lines[0] and "generation_config.json (edited" in lines[0]
    assert f"--out {built} --force" in lines[0]
    assert _listing(built) == before
