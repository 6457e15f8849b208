"""Bad input is refused with the file and line named, and the CLI prints one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.tap.analysis.diff import diff_runs
from enginetap.tap.analysis.files import TapError, load_run

from .conftest import Recorder, requests


@pytest.fixture
def recorded(record: Recorder, tmp_path: Path) -> Path:
    record("llama", requests(["kernels and caches", "decode"], max_new_tokens=2),
           out=tmp_path / "good")
    return tmp_path / "good"


def test_a_truncated_file_names_its_last_line(recorded: Path) -> None:
    path = recorded / "tap-rank0.jsonl"
    text = path.read_text()
    path.write_text(text[:-40])
    lines = text.count("\n")
    with pytest.raises(TapError, match=rf"tap-rank0.jsonl:{lines}: not a JSON line"):
        load_run(recorded)


def test_a_foreign_file_is_refused_at_line_1(tmp_path: Path) -> None:
    (tmp_path / "tap-rank0.jsonl").write_text(json.dumps({"step": 0, "rank": 0}) + "\n")
    with pytest.raises(TapError, match=r"tap-rank0.jsonl:1: not a tap file"):
        load_run(tmp_path)
    with pytest.raises(TapError, match="no tap files"):
        load_run(tmp_path / "missing")


def test_a_missing_rank_file_is_named(recorded: Path) -> None:
    path = recorded / "tap-rank0.jsonl"
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["world_size"] = 2
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(TapError, match=r"tap-rank0.jsonl:1: .*lacks rank file\(s\) tap-rank1"):
        load_run(recorded)


def test_runs_of_different_prompts_are_refused(record: Recorder, recorded: Path,
                                               tmp_path: Path) -> None:
    record("llama", requests(["other words here", "decode"], max_new_tokens=2),
           out=tmp_path / "other")
    with pytest.raises(TapError, match=r"tap-rank0.jsonl:\d+ and .*different prompts"):
        diff_runs(load_run(recorded), load_run(tmp_path / "other"))


def test_the_cli_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "tap-rank0.jsonl").write_text('{"kind": "header", "format": "enginetap-tap", '
                                             '"version": 2}\n{"step": 0, "mode"\n')
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", "tap", "report",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"{tmp_path / 'tap-rank0.jsonl'}:2: not a JSON line" in done.stderr.replace("\n", "")


def test_a_bad_prompt_file_names_its_line(tmp_path: Path) -> None:
    from enginetap.errors import ConfigError
    from enginetap.jobs.tap import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(ConfigError, match=r"bad record at .*prompts.jsonl:2"):
        load_prompts(str(path))
    with pytest.raises(ConfigError, match="unknown built-in prompt set 'nope'"):
        load_prompts("builtin:nope")
    assert load_prompts("builtin:pairs").count("the cache holds every key") == 3


@pytest.mark.parametrize("args,message", [
    (["--engine", "trtllm"], "unknown engine 'trtllm'"),
    (["--engine", "builtin", "--tp", "2"], "--tp needs --engine vllm"),
    (["--depth", "sublayer"], "unknown depth 'sublayer'"),
    (["--mode", "graph"], "unknown mode 'graph'"),
    (["--engine", "sglang", "--mode", "compile"], "--mode compile needs --engine builtin"),
    (["--mode", "compile", "--vectors", "split"], "--mode compile writes no raw rows"),
    (["--mode", "graphs"], "--mode graphs needs --device cuda"),
])
def test_tap_run_refuses_an_engine_it_cannot_run(tmp_path: Path, args: list[str],
                                                 message: str) -> None:
    from typer.testing import CliRunner

    from enginetap.cli.main import app
    from enginetap.errors import ConfigError

    done = CliRunner().invoke(app, ["tap", "run", "--model", "builtin:llama", "--prompts",
                                    "builtin:short", "--out", str(tmp_path / "run"), *args])
    assert isinstance(done.exception, ConfigError) and message in str(done.exception)
    assert not (tmp_path / "run").exists()


def test_every_sublayers_input_needs_sublayer_depth() -> None:
    from pydantic import ValidationError

    from enginetap.tap.options import TapOptions

    with pytest.raises(ValidationError, match="needs depth='sublayers'"):
        TapOptions(depth="layers", inputs="all")
    assert TapOptions(depth="layers").inputs == "layers"
