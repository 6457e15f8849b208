"""Hostile Mooncake/AgentX traces and profiles, and `traffic derive` writing over its input.

Every bad record is "bad record at FILE:LINE: why" and exit 2 (never a traceback, never
exit 1); absurd lengths are refused with the bound; `--out` may never be the input trace,
whatever name reaches it (the same path, a symlink, a hard link).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from enginetap.cli.main import main

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["enginetap", *args])
    monkeypatch.setenv("COLUMNS", "400")
    try:
        main()
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(result: tuple[int, str, str], *words: str) -> str:
    code, out, err = result
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _trace(tmp_path: Path, bad_line: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + bad_line + "\n" + json.dumps(GOOD) + "\n")
    return path


DEEP = "[" * 100_000 + "]" * 100_000
GIANT = "9" * 5000

MOONCAKE_CASES = {
    "deep": '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], '
            f'"extra": {DEEP}}}',
    "giant_int": f'{{"timestamp": 0, "input_length": 600, "output_length": {GIANT}, '
                 '"hash_ids": [1, 2]}',
    "giant_hash": f'{{"timestamp": 0, "input_length": 600, "output_length": 4, '
                  f'"hash_ids": [1, {GIANT}]}}',
    "list_row": "[1, 2, 3]",
    "string_row": '"hello"',
    "output_1e18": '{"timestamp": 0, "input_length": 600, "output_length": 1000000000000000000, '
                   '"hash_ids": [1, 2]}',
}


@pytest.mark.parametrize("case", sorted(MOONCAKE_CASES))
def test_a_bad_mooncake_record_is_named_by_file_and_line(tmp_path, monkeypatch, capsys,
                                                         case) -> None:
    trace = _trace(tmp_path, MOONCAKE_CASES[case])
    for command in ("show", "derive"):
        extra = ["--out", str(tmp_path / "p.json")] if command == "derive" else []
        line = _refused(_cli(monkeypatch, capsys, "traffic", command, f"mooncake:{trace}",
                             *extra), f"bad record at {trace}:2")
        assert len(line) < 600, line  # the why is short: no 100k-character echo
    assert not (tmp_path / "p.json").exists()


def test_the_output_bound_is_said(tmp_path, monkeypatch, capsys) -> None:
    trace = _trace(tmp_path, MOONCAKE_CASES["output_1e18"])
    _refused(_cli(monkeypatch, capsys, "traffic", "show", f"mooncake:{trace}"),
             "output_length", "16777216")


def _agentx(tmp_path: Path, profile: str) -> Path:
    path = tmp_path / "shapes.json"
    good = json.dumps({"label": "a", "input_tokens": 4, "output_tokens": 2,
                       "hash_ids": [1], "block_size": 16})
    path.write_text('{"dataset": "d", "revision": "r",\n "profiles": [\n  ' + good + ",\n  "
                    + profile + '\n ],\n "overlap_profiles": []\n}\n')
    return path


AGENTX_CASES = {
    "deep": '{"label": "b", "input_tokens": 4, "output_tokens": 2, "hash_ids": [1], '
            f'"block_size": 16, "meta": {DEEP}}}',
    "giant_int": f'{{"label": "b", "input_tokens": 4, "output_tokens": {GIANT}, '
                 '"hash_ids": [1], "block_size": 16}',
    "list_row": "[1, 2]",
    "output_1e18": '{"label": "b", "input_tokens": 4, "output_tokens": 1000000000000000000, '
                   '"hash_ids": [1], "block_size": 16}',
}


@pytest.mark.parametrize("case", sorted(AGENTX_CASES))
def test_a_bad_agentx_record_is_named_by_file_and_line(tmp_path, monkeypatch, capsys,
                                                       case) -> None:
    path = _agentx(tmp_path, AGENTX_CASES[case])
    # the bad profile is on line 4; JSON gives no position for a nesting depth or for
    # a record that is not an object, so those name the file (and the list index)
    where = {"giant_int": f"{path}:4", "output_1e18": f"{path}:4",
             "list_row": "profiles[1]"}.get(case, str(path))
    line = _refused(_cli(monkeypatch, capsys, "traffic", "show", f"agentx:{path}"), where,
                    str(path))
    assert len(line) < 600, line


@pytest.mark.parametrize("case", ["deep", "giant_int"])
def test_a_hostile_profile_file_is_one_error(tmp_path, monkeypatch, capsys, case) -> None:
    body = DEEP if case == "deep" else GIANT
    path = tmp_path / "p.json"
    path.write_text('{"name": "x", "source": "y", "seed": ' + body + "}\n")
    _refused(_cli(monkeypatch, capsys, "traffic", "show", str(path)), str(path))


# ----------------------------------------------------------------- derive --out INPUT
@pytest.fixture
def trace(tmp_path: Path) -> Path:
    from enginetap.traffic.sources import SLICE

    import enginetap.traffic

    source = Path(enginetap.traffic.__file__).parent / "data" / SLICE
    path = tmp_path / "t.jsonl"
    path.write_bytes(source.read_bytes())
    return path


def test_derive_never_writes_over_its_input(tmp_path, monkeypatch, capsys, trace) -> None:
    before = trace.read_bytes()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.json").symlink_to(trace)
    os.link(trace, tmp_path / "hard.json")
    (tmp_path / "sub").mkdir()
    for out in ("t.jsonl", str(trace), "sub/../t.jsonl", "link.json", "hard.json"):
        _refused(_cli(monkeypatch, capsys, "traffic", "derive", "mooncake:t.jsonl",
                      "--out", out), "is the input")
        assert trace.read_bytes() == before
    # and through a symlinked input
    (tmp_path / "in.jsonl").symlink_to(trace)
    _refused(_cli(monkeypatch, capsys, "traffic", "derive", "mooncake:in.jsonl",
                  "--out", "t.jsonl"), "is the input")
    assert trace.read_bytes() == before
    # a saved profile re-derived onto itself is the same mistake
    code, _, err = _cli(monkeypatch, capsys, "traffic", "derive", "mooncake:t.jsonl",
                        "--out", "p.json")
    assert code == 0, err
    saved = (tmp_path / "p.json").read_bytes()
    _refused(_cli(monkeypatch, capsys, "traffic", "derive", "p.json", "--out", "p.json",
                  "--max-context", "1024"), "is the input")
    assert (tmp_path / "p.json").read_bytes() == saved


def test_derive_to_a_path_under_a_file_is_one_error(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "a-file").write_text("mine")
    _refused(_cli(monkeypatch, capsys, "traffic", "derive", "builtin:mooncake-tiny", "--out",
                  str(tmp_path / "a-file" / "p.json")), "cannot write traffic profile")
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("line", ['{"prompt": ' + DEEP + "}", '{"prompt": ' + GIANT + "}",
                                  "[1, 2]", '{"prompt": 5}'])
def test_a_bad_jsonl_prompt_is_a_bad_record(tmp_path, monkeypatch, capsys, line) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    _refused(_cli(monkeypatch, capsys, "tap", "run", "--model", "builtin:llama", "--prompts",
                  str(prompts), "--out", str(tmp_path / "run")), f"bad record at {prompts}:2")
    assert not (tmp_path / "run").exists()
