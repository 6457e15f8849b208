"""The vLLM integration's engine-free parts: the step recorder, the server's command and
environment, the CLI's arming options."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from enginetap.cli.vllm import app
from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.core.context import Step, StepRows, publish
from enginetap.core.recorder import StepRecorder, filter_rows
from enginetap.engines.vllm.server import VLLMServer, free_port
from enginetap.errors import ConfigError


def _step(number: int, rng: random.Random) -> Step:
    ids = ["keep-1"] * 3 + ["drop-2"] * 2 + ["keep-3"]
    rows = StepRows(request_ids=ids, positions=[rng.randrange(512) for _ in ids],
                    token_ids=[rng.randrange(512) for _ in ids], query_start=[0, 0, 0, 3, 3, 5],
                    computed_host=[rng.randrange(64) for _ in ids],
                    computed_device=[rng.randrange(64) for _ in ids],
                    kv_slots=[rng.randrange(4096) for _ in ids], state_slots=None)
    return Step("vllm", number, "mixed", rows, rank=1, world_size=2)


def test_recorder_writes_filtered_steps_per_rank(tmp_path: Path):
    rng = random.Random(3)
    recorder = StepRecorder(tmp_path, rank=1, request_filter="keep").install()
    steps = [_step(n, rng) for n in range(3)]
    try:
        for step in steps:
            with publish(step):
                pass
        lines = (tmp_path / "steps-rank1.jsonl").read_text().splitlines()
    finally:
        recorder.uninstall()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record, step in zip(records, steps):
        keep = [0, 1, 2, 5]
        assert record["rows"]["request_ids"] == ["keep-1"] * 3 + ["keep-3"]
        assert record["rows"]["kv_slots"] == [step.rows.kv_slots[i] for i in keep]
        assert record["rows"]["state_slots"] is None
        assert (record["rank"], record["world_size"], record["mode"]) == (1, 2, "mixed")


def test_filter_without_match_leaves_no_rows_and_no_line(tmp_path: Path):
    step = _step(0, random.Random(4))
    assert filter_rows(step.rows, "") is step.rows
    assert len(filter_rows(step.rows, "nobody")) == 0
    recorder = StepRecorder(tmp_path, rank=0, request_filter="nobody").install()
    try:
        with publish(step):
            pass
    finally:
        recorder.uninstall()
    assert not (tmp_path / "steps-rank0.jsonl").exists()


def test_server_environment_replaces_the_callers_arming(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ENGINETAP", "1")
    monkeypatch.setenv("ENGINETAP_CAPABILITIES", "tap")
    disarmed = VLLMServer(tmp_path / "model", log_path=tmp_path / "a.log")
    env = disarmed.environment()
    assert not set(env) & set(ARMING_VARS)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    config = ArmConfig(enabled=True, capabilities=["step"], out_dir=tmp_path / "out")
    armed = VLLMServer(tmp_path / "model", arm=config, env={"X_EXTRA": "1"},
                       log_path=tmp_path / "b.log", port=free_port())
    env = armed.environment()
    assert set(env) & set(ARMING_VARS) == {"ENGINETAP_CONFIG"}
    assert ArmConfig.model_validate_json(Path(env["ENGINETAP_CONFIG"]).read_text()) == config
    assert env["X_EXTRA"] == "1"
    command = armed.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == str(armed.port)
    assert armed.url == f"http://127.0.0.1:{armed.port}"


def test_log_tail_and_shutdown_before_start(tmp_path: Path):
    server = VLLMServer("m", log_path=tmp_path / "s.log")
    assert server.log_tail() == ""
    (tmp_path / "s.log").write_text("\n".join(f"line {i}" for i in range(100)))
    assert server.log_tail(3) == "line 97\nline 98\nline 99"
    assert server.shutdown() is None


def test_serve_refuses_unknown_capabilities(tmp_path: Path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--arm", "step,teleport"])
    assert isinstance(result.exception, ConfigError)
    assert "teleport" in str(result.exception)
