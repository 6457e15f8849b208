"""A guard lock that lists one target twice is refused, naming the target (it used to
check, and report, "2 targets match")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from enginetap.cli.main import main
from enginetap.errors import ConfigError
from enginetap.guard.lock import GuardLock

TARGET = "enginetap.errors:describe_validation"


def _lock(tmp_path: Path) -> Path:
    from enginetap.guard.lock import pin

    lock = pin([TARGET]).model_dump(mode="json")
    lock["entries"] = lock["entries"] * 2
    path = tmp_path / "guard.lock"
    path.write_text(json.dumps(lock))
    return path


def test_a_lock_listing_a_target_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"lists {TARGET} twice"):
        GuardLock.load(_lock(tmp_path))


def test_guard_check_says_so_and_exits_2(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["enginetap", "guard", "check", str(_lock(tmp_path))])
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr()
    assert exited.value.code == 2, err
    assert f"lists {TARGET} twice" in err.err and "match" not in err.out
