"""In-process ``vllm.LLM`` (V1 runner, CPU), armed through the plugin by the environment.

One armed run per model (``offline_run.py``: chunked prefill, a request arriving mid-way,
a repeated prompt); the recorded steps are checked row by row against the requests. With
a disarmed run and a run whose step reader breaks, five engine runs, two at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from step_checks import Request, check_steps, read_steps
from vllm_harness import OFFLINE, child_env, run_script

from tests.pairwise import side_by_side

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODELS = ["llama", "qwen3_next", "deepseek_v3"]
PROBE = "probe_patches:watch_rmsnorm"


def _engine_name(rid: str) -> str:
    return rid.rsplit("-", 1)[0]  # vLLM appends "-<8 hex>" to the caller's request id


def _run(model_dir: Path, out: Path, guard_patches: list[str]) -> tuple[dict, str]:
    config = {"enabled": True, "capabilities": ["step", "guard"], "out_dir": str(out),
              "options": {"guard": {"patches": guard_patches}}}
    (out / "arming.json").write_text(json.dumps(config))
    env = child_env({"ENGINETAP_CONFIG": str(out / "arming.json")})
    log = run_script([str(OFFLINE), str(model_dir), str(out / "report.json")], env,
                     out / "run.log")
    return json.loads((out / "report.json").read_text()), log


@pytest.fixture(scope="module")
def armed_runs(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """``armed_runs(model)`` → (output dir, report, log text); every model runs once, two
    engines at a time, when the first is asked for."""
    runs: dict[str, tuple[Path, dict, str]] = {}

    def job(model: str):
        out, folder = tmp_path_factory.mktemp(f"armed-{model}"), tiny_model(model)
        return lambda: (out, *_run(folder, out, [PROBE]))

    def disarmed():
        out, folder = tmp_path_factory.mktemp("disarmed-llama"), tiny_model("llama")
        return lambda: (out, {}, run_script([str(OFFLINE), str(folder),
                                             str(out / "report.json")],
                                            child_env({"ENGINETAP_OUT": str(out)}),
                                            out / "run.log"))

    def breaking():
        out, folder = tmp_path_factory.mktemp("breaking-llama"), tiny_model("llama")
        return lambda: (out, *_run(folder, out, ["probe_patches:break_step_reading"]))

    def get(model: str) -> tuple[Path, dict, str]:
        if not runs:  # every run of this module, two engines at a time
            names = [*MODELS, "disarmed", "breaking"]
            runs.update(zip(names, side_by_side([*(job(m) for m in MODELS), disarmed(),
                                                 breaking()])))
        return runs[model]

    return get


@pytest.mark.parametrize("model", MODELS)
def test_steps_match_the_scheduled_requests(armed_runs, model: str):
    out, report, log = armed_runs(model)
    assert log.count("enginetap armed in vLLM worker") == 1
    requests = {name: Request(r["prompt"], r["output"]) for name, r in report["requests"].items()}
    steps = read_steps(out / "steps-rank0.jsonl")
    seen = check_steps(steps, requests, _engine_name)
    assert seen.modes == {"prefill", "decode", "mixed"}
    assert set(seen.first_position) == set(requests)
    hybrid = model == "qwen3_next"
    assert all((s["rows"]["state_slots"] is not None) == hybrid for s in steps)
    # The repeated prompt: only its uncached suffix is computed, where prefix caching is on.
    # Whether vLLM CPU keeps it on for MLA models (DeepSeek-V3) depends on the CPU's kernel
    # path (seen off on one machine kind, on on this AMX one): the rows must agree either way.
    cached = report["requests"]["a2"]["cached_tokens"]
    if model != "deepseek_v3":
        assert report["prefix_caching"]
    assert seen.first_position["a2"] == cached
    assert (cached > 0) == report["prefix_caching"]
    assert seen.first_position["a"] == 0


def test_kernels_see_the_current_step_and_dummy_runs_do_not(armed_runs):
    out, _, _ = armed_runs("llama")
    steps = read_steps(out / "steps-rank0.jsonl")
    probe = read_steps(out / "probe-rank0.jsonl")
    assert [p["step"] for p in probe] == [s["step"] for s in steps]
    layers = 2 * 2 + 1  # two RMSNorms per decoder layer, one final norm
    assert all(p["calls"] == layers and p["row_mismatches"] == 0 for p in probe)
    # The dummy batches before each phase called the kernel outside any step, and only they.
    a2_first = next(s["step"] for s in steps if s["rows"]["request_ids"][0].startswith("a2-"))
    outside = [p["outside_so_far"] for p in probe]
    assert outside[0] > 0
    assert set(outside[:a2_first]) == {outside[0]} and set(outside[a2_first:]) == {outside[-1]}
    assert outside[-1] > outside[0]


def test_armed_and_disarmed_give_identical_tokens_and_logprobs(armed_runs):
    _, armed, _ = armed_runs("llama")
    out, _, log = armed_runs("disarmed")
    disarmed = json.loads((out / "report.json").read_text())
    assert "enginetap armed" not in log
    assert not list(out.glob("steps-rank*.jsonl"))
    assert disarmed["requests"] == armed["requests"]
    assert all(r["logprobs"] for r in armed["requests"].values())


def test_a_failing_step_reader_disarms_and_vllm_goes_on(armed_runs):
    _, armed, _ = armed_runs("llama")
    out, report, log = armed_runs("breaking")
    assert "reading vLLM's step failed; the step context disarms" in log
    assert log.count("enginetap: disarmed in vLLM worker") == 1
    assert not list(out.glob("steps-rank*.jsonl"))
    assert report["requests"] == armed["requests"]
