"""``sglang.launch_server`` (tiny Llama, CPU) started armed, driven over HTTP with a
profile derived from the Mooncake slice shipped with enginetap, and stopped.

The checks: every submission of the profile came back with its tokens; the server's
scheduler published one step record per step, whose rows carry the profile's request
keys (SGLang keeps the ``rid`` the driver sends), positions that count up from the
radix cache's hit, and prefix hits that equal what the server reported as cached tokens
(the trace's shared hash blocks become shared prompt prefixes); the server stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.sglang.conftest import child_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_CONTEXT = 384


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from enginetap.config import ArmConfig
    from enginetap.engines.sglang.server import SGLangServer
    from enginetap.traffic.drivers import SGLangHTTPDriver
    from enginetap.models import build_model
    from enginetap.traffic import derive_mooncake
    from enginetap.traffic.runner import run_profile
    from enginetap.traffic.sources import packaged_trace

    out = tmp_path_factory.mktemp("serve-sglang")
    model = build_model("llama")
    profile = derive_mooncake(packaged_trace(), max_context=MAX_CONTEXT, max_output_tokens=3,
                              group_size=3, replay_count=3, time_scale=0.001)
    arm = ArmConfig(enabled=True, capabilities=["step"], out_dir=out / "tap")
    server = SGLangServer(model, arm=arm, env=child_env(), log_path=out / "server.log",
                          startup_timeout=400, grace=20)
    with server:
        driver = SGLangHTTPDriver(server.url, max_context=MAX_CONTEXT, vocab_size=512)
        report = run_profile(profile, driver, progress=False)
        process = server.process
    return {"out": out, "report": report, "profile": profile, "process": process,
            "server": server}


def _steps(out: Path) -> list[dict]:
    lines = (out / "tap" / "steps-rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_submission_of_the_profile_came_back(served) -> None:
    from enginetap.traffic.runner import count_submissions

    report = served["report"]
    assert len(report.receipts) == count_submissions(served["profile"]) > 3
    assert report.source.startswith("mooncake:")
    assert all(len(r.output_ids) == r.max_tokens for r in report.receipts), report.receipts[:2]


def test_the_scheduler_published_the_profiles_requests(served) -> None:
    steps = [s for s in _steps(served["out"]) if s.get("engine") == "sglang"]
    keys = {r.key for r in served["report"].receipts}
    seen = {k for s in steps for k in s["rows"]["request_ids"]}
    assert keys <= seen, keys - seen
    for step in steps:
        rows = step["rows"]
        for i, key in enumerate(rows["request_ids"]):
            assert rows["positions"][i] >= rows["computed_host"][i]
            assert rows["seq_lens"][i] == rows["computed_host"][i] + rows["planned_tokens"][i]
    hits = {k: n for s in steps for k, n in s["extra"].get("prefix_hits", {}).items()}
    assert keys <= set(hits), keys - set(hits)  # every request's first (extend) step
    # the trace's shared hash blocks become shared prompt prefixes: the radix cache hits
    assert max(hits.values()) > 0, hits
    cached = {r.key: r.cached_tokens for r in served["report"].receipts}
    assert all(cached[k] == hits[k] for k in keys if cached[k] is not None), (cached, hits)


def test_the_server_stopped(served) -> None:
    assert served["process"].poll() is not None
