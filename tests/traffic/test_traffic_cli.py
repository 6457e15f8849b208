"""`enginetap traffic show|derive`, run through the console entry point."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from enginetap.cli.main import main
from enginetap.traffic import load_profile
from enginetap.traffic.sources import packaged_trace


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["enginetap", "traffic", *args])
    monkeypatch.setenv("COLUMNS", "200")
    try:
        main()
        code = 0
    except SystemExit as exited:
        code = exited.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_show_builtin_lists_every_label(monkeypatch, capsys) -> None:
    code, out, _ = _cli(monkeypatch, capsys, "show", "builtin:mooncake-tiny")
    assert code == 0
    for label in ("context_p10", "context_p99", "subagent_typical", "auxiliary_typical",
                  "fully_reused", "long_output", "overlap/", "arrival/"):
        assert label in out
    assert "scale 0.0234375" in out


def test_show_an_agentx_file(monkeypatch, capsys) -> None:
    fixture = Path(__file__).parent / "data" / "agentx_shapes.json"
    code, out, _ = _cli(monkeypatch, capsys, "show", f"agentx:{fixture}")
    assert code == 0
    assert "fully_reused" in out and "tool_fanout/fan_b" in out and "scale 1" in out


def test_derive_writes_a_profile_that_loads(monkeypatch, capsys, tmp_path: Path) -> None:
    with_slice = packaged_trace().path
    target = tmp_path / "p.json"
    code, out, err = _cli(monkeypatch, capsys, "derive", f"mooncake:{with_slice}", "--out",
                          str(target), "--max-context", "1024", "--max-output", "16", "--seed", "5")
    assert code == 0 and out.strip() == str(target) and "wrote" in err
    profile = load_profile(target)
    assert profile.seed == 5
    assert all(r.input_tokens + r.output_tokens <= 1024 for r in profile.requests)
    code, out, _ = _cli(monkeypatch, capsys, "show", str(target))
    assert code == 0 and "fully_reused" in out


@pytest.mark.parametrize(("args", "message"), [
    (["show", "builtin:nope"], "no built-in traffic profile 'nope'"),
    (["show", "mooncake:BAD"], "bad record at .*bad.jsonl:2"),
    (["show", "missing.json"], "cannot read traffic profile"),
    (["derive", "builtin:mooncake-tiny", "--out", "OUT/p.json", "--max-context", "40"],
     "cannot fit a 40-token context"),
])
def test_errors_are_one_line_and_exit_2(monkeypatch, capsys, tmp_path: Path, args,
                                        message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 0, "input_length": 5}\n')
    args = [a.replace("BAD", str(bad)).replace("OUT", str(tmp_path)) for a in args]
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(monkeypatch, capsys, *args)
    assert code == 2
    assert re.search(message, err.replace("\n", " ")), err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("**/p.json"))
