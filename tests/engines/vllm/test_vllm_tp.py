"""Tensor parallelism on vLLM CPU (TP=2): per-rank step files, their merge, the worker-only
guard contract, and :func:`gather_shards` rebuilding vLLM's sharded weights exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from step_checks import Request, check_steps, read_steps
from typer.testing import CliRunner
from vllm_harness import OFFLINE, child_env, run_script

from enginetap.cli.vllm import app
from enginetap.engines.vllm.selfcheck import SELFCHECK_FILE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tp_run(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("tp2")
    config = {"enabled": True, "capabilities": ["step", "guard", "capture"], "out_dir": str(out),
              "options": {"step": {"selfcheck_gather": True},
                          "guard": {"patches": ["probe_patches:mark_worker",
                                                "enginetap_no_such_module:install"]}}}
    (out / "arming.json").write_text(json.dumps(config))
    env = child_env({"ENGINETAP_CONFIG": str(out / "arming.json"),
                     "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    log = run_script([str(OFFLINE), str(tiny_model("llama")), str(out / "report.json"),
                      "--tp", "2"], env, out / "run.log")
    return out, json.loads((out / "report.json").read_text()), log


def test_each_rank_records_the_same_steps(tp_run):
    """Both ranks record the same steps with the same rows. vLLM waits only for its output
    rank (0), so at shutdown it can stop rank 1 before rank 1's last sampler returned: a
    trailing step rank 1 lacks must then be named in the log, never dropped silently."""
    out, report, log = tp_run
    ranks = [read_steps(out / f"steps-rank{r}.jsonl") for r in (0, 1)]
    assert [{(s["rank"], s["world_size"]) for s in steps} for steps in ranks] == [{(0, 2)},
                                                                                 {(1, 2)}]
    both = len(ranks[1])
    assert [(s["step"], s["rows"]) for s in ranks[0][:both]] == [(s["step"], s["rows"])
                                                                  for s in ranks[1]]
    for step in ranks[0][both:]:
        assert f"vLLM step {step['step']} on rank 1 was not recorded" in log, step["step"]
    assert len(ranks[0]) - both <= 1
    requests = {n: Request(r["prompt"], r["output"]) for n, r in report["requests"].items()}
    seen = check_steps(ranks[0], requests, lambda rid: rid.rsplit("-", 1)[0])
    assert seen.modes == {"prefill", "decode", "mixed"}


def test_merge_cli_orders_by_step_then_rank(tp_run):
    out, _, _ = tp_run
    result = CliRunner().invoke(app, ["merge", str(out), "--to", str(out / "merged.jsonl")])
    assert result.exit_code == 0, result.output
    merged = read_steps(out / "merged.jsonl")
    recorded = [(s["step"], s["rank"]) for r in (0, 1)
                for s in read_steps(out / f"steps-rank{r}.jsonl")]
    assert [(s["step"], s["rank"]) for s in merged] == sorted(recorded)


def test_gather_rebuilds_sharded_weights_exactly(tp_run, tiny_model):
    out, _, _ = tp_run
    gathered = load_file(out / SELFCHECK_FILE)
    with safe_open(str(out / SELFCHECK_FILE), "pt") as f:
        assert f.metadata() == {"world_size": "2", "agreed": "true"}
    checkpoint = {}
    for file in Path(tiny_model("llama")).glob("*.safetensors"):
        checkpoint.update(load_file(file))
    expected = {"model.embed_tokens.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{p}.weight" for i in (0, 1)
        for p in ("self_attn.o_proj", "mlp.down_proj")}
    assert set(gathered) == expected
    for name, tensor in gathered.items():
        assert tensor.dtype == checkpoint[name].dtype, name
        assert torch.equal(tensor, checkpoint[name]), name


def test_guard_patches_run_in_each_worker_and_failures_are_contained(tp_run):
    out, report, log = tp_run
    marks = [json.loads(p.read_text()) for p in out.glob("guard-mark-*.json")]
    assert sorted((m["rank"], m["world"]) for m in marks) == [(0, 2), (1, 2)]
    assert log.count("guard patch enginetap_no_such_module:install failed; skipped") == 2
    # capture arms in both workers; only rank 0 writes the (rebuilt) logical ops
    summaries = [json.loads((out / f"capture-summary-rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0]["written"] > 0 and summaries[1]["written"] == 0
    assert all(not s["disabled_probes"] for s in summaries)
    assert len(report["requests"]) == 4  # vLLM served every request regardless
