"""The vLLM drivers on the tiny llama: ``vllm.LLM`` in a child process, and ``vllm serve``.

One profile: a request warmed by its predecessor (four shared 16-token blocks: two of
vLLM CPU's 32-token cache blocks hit), a cold repeat after the reset, and an overlap group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.config import ARMING_VARS
from enginetap.traffic import (
    HTTPDriver, OverlapGroup, RequestProfile, RunReport, TrafficProfile, run_profile,
    save_profile)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).parent


def _req(label: str, ids: list[int], n: int, out: int = 4, **kw) -> RequestProfile:
    return RequestProfile(label=label, input_tokens=n, output_tokens=out, hash_ids=ids,
                          block_size=16, **kw)


PROFILE = TrafficProfile(
    name="vllm-hand", source="test", seed=2,
    requests=[
        _req("warm", [0, 1, 2, 3, 4, 5], 90,
             cache_predecessor={"input_tokens": 75, "hash_ids": [0, 1, 2, 3, 9]}),
        _req("cold", [0, 1, 2, 3, 4, 5], 90),
    ],
    overlap_groups=[OverlapGroup(label="g", members=[
        _req("a", [0, 5], 30, out=6), _req("b", [0, 6, 7], 40, out=3)])])


def _check(report: RunReport) -> None:
    receipts = {r.key: r for r in report.receipts}
    assert list(receipts) == ["warm.warm", "warm.0", "cold.0", "g.0", "g.1"]
    assert receipts["warm.warm"].cached_tokens == 0
    assert receipts["warm.0"].cached_tokens == 64  # blocks 0-3 of the predecessor
    assert receipts["cold.0"].cached_tokens == 0  # the reset emptied the cache
    for key, expected in (("warm.0", 4), ("g.0", 6), ("g.1", 3)):
        assert len(receipts[key].output_ids) == expected  # ignore_eos: exactly max_tokens
        assert receipts[key].finish_reason == "length"


@pytest.fixture(scope="module")
def llama(vllm_lock: None) -> Path:
    from enginetap.models import build_model

    return build_model("llama")


def _in_process(llama: Path, tmp_path: Path) -> RunReport:
    profile_path = save_profile(PROFILE, tmp_path / "profile.json")
    env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
    with (tmp_path / "run.log").open("wb") as log:
        proc = subprocess.run([sys.executable, str(HERE / "vllm_traffic_run.py"), str(llama),
                               str(profile_path), str(tmp_path / "report.json")], env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=400, check=False)
    assert proc.returncode == 0, (tmp_path / "run.log").read_text(errors="replace")[-4000:]
    return RunReport.model_validate_json((tmp_path / "report.json").read_text())


def _over_http(llama: Path, tmp_path: Path) -> tuple[RunReport, int]:
    from transformers import AutoTokenizer

    from enginetap.engines.vllm.server import VLLMServer

    args = ["--enforce-eager", "--gpu-memory-utilization", "0.25", "--max-model-len", "512",
            "--max-num-seqs", "8", "--enable-prefix-caching", "--block-size", "32",
            "--seed", "0", "--enable-prompt-tokens-details"]
    with VLLMServer(llama, args=args, log_path=tmp_path / "server.log") as server:
        driver = HTTPDriver.for_server(server, tokenizer=AutoTokenizer.from_pretrained(llama))
        return run_profile(PROFILE, driver, progress=False), driver.max_context


@pytest.fixture(scope="module")
def reports(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both drivers' runs, side by side (two engines at a time)."""
    from tests.pairwise import side_by_side

    local, http = tmp_path_factory.mktemp("llm"), tmp_path_factory.mktemp("http")
    reports = side_by_side([lambda: _in_process(llama, local), lambda: _over_http(llama, http)])
    return dict(zip(("llm", "http"), reports))


def test_in_process_llm_driver(reports: dict) -> None:
    report = reports["llm"]
    assert report.prompts["token_source"] == "tokenizer"
    _check(report)


def test_http_driver_against_vllm_serve(reports: dict) -> None:
    report, max_context = reports["http"]
    assert max_context == 512  # asked from /v1/models
    assert report.receipts[0].driver == "vllm-http"
    _check(report)
