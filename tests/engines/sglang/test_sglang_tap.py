"""Tap on SGLang CPU (tiny qwen3_next: gated delta rule, full attention, MoE).

One engine run (``sglang_tap_run.py``, see its docstring for the phases), armed through
``ENGINETAP_CONFIG`` like any SGLang user's program, and one ``enginetap tap run --engine
sglang`` of the built-in prompt pairs on the tiny Llama. The checks: every sublayer, the
KV rows written this step and the gated-delta/convolution state around it and the sampler
are recorded and continuous; a row corrupted by test code in layer 1's MoE block is named
by the pair analysis (and ``tap report``) at that layer and sublayer; a KV row and a
recurrent-state slot overwritten by test code between steps are named by continuity
(layer, slot, request, position); identical requests
never split; armed and disarmed tokens are identical; the CLI run's identical prompts
agree and it diffs against a built-in-engine run of the same prompts, aligned by request
and position.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.sglang.conftest import HERE, child_env, run_child
from tests.pairwise import side_by_side

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from enginetap.models import build_model

    out = tmp_path_factory.mktemp("tap-sglang")
    model = str(build_model("qwen3_next"))
    config = {"enabled": True, "capabilities": ["tap"], "out_dir": str(out / "faults"),
              "options": {"tap": {"max_rows": 256}}}
    (out / "arming.json").write_text(json.dumps(config))
    build_model("llama")  # built here, not by two children at once
    side_by_side([  # the two engines at once (one child process each)
        lambda: run_child([str(HERE / "sglang_tap_run.py"), model, str(out / "faults.json")],
                          child_env({"ENGINETAP_CONFIG": str(out / "arming.json")}),
                          out / "faults.log"),
        lambda: run_child(["-m", "enginetap.cli.main", "tap", "run", "--engine", "sglang",
                           "--model", "builtin:llama", "--prompts", "builtin:pairs",
                           "--max-new-tokens", "4", "--out", str(out / "cli")], child_env(),
                          out / "cli.log")])
    return {"root": out, "faults": out / "faults", "cli": out / "cli"}


def _report(runs: dict[str, Path]) -> dict:
    return json.loads((runs["root"] / "faults.json").read_text())


def test_sublayers_kv_rows_state_and_sampler_are_recorded_and_continuous(runs) -> None:
    from enginetap.tap.analysis.continuity import check_continuity, check_metadata
    from enginetap.tap.analysis.files import load_run

    run = load_run(runs["faults"])
    assert run.header["engine"] == "sglang"
    rank = run.rank(0)
    names = set(rank.steps[1].checkpoints)
    assert {"L0.in", "L0.gdn.attn.out", "L0.gdn.out", "L1.moe.experts.out", "L1.moe.out",
            "L3.attn.out", "L3.attn.kv_written", "L3.attn.kv_prev", "L1.gdn.state_before",
            "L1.gdn.state_after", "L1.gdn.conv_before", "L1.gdn.conv_after", "L3.out"} <= names
    # only the test's overwrites break continuity (checked exactly below)
    assert {v.key for v in check_continuity(rank)} == {"k0", "k1"}
    assert check_metadata(rank) == []
    for step in rank.steps:  # greedy: the sampled token is the top logit (or tied with it)
        last = {row["key"]: i for i, row in enumerate(step.rows)}
        for key, i in last.items():
            top = step.sampler[i]
            assert step.sampled[key] == top["argmax"] or (
                top["gap"] == 0 and step.sampled[key] == top["runner_up"]), (step.step, key)


def test_a_corrupted_row_is_named_by_the_pair_analysis_and_tap_report(runs) -> None:
    from typer.testing import CliRunner

    from enginetap.cli.main import app
    from enginetap.tap.analysis.files import load_run
    from enginetap.tap.analysis.pairs import find_pairs

    rank = load_run(runs["faults"]).rank(0)
    fault = _report(runs)["written"]
    pair = next(p for p in find_pairs(rank) if p.keys == ("f0", "f1"))
    assert (pair.first_step, pair.position, pair.checkpoint) == (fault["step"],
                                                                fault["position"], "L1.moe.out")
    # identical requests of the first phase never split
    assert all(p.first_step is None for p in find_pairs(rank) if p.keys[0].startswith("s"))
    result = CliRunner().invoke(app, ["tap", "report", str(runs["faults"])])
    assert result.exit_code == 0, result.output
    assert (f"split at step {fault['step']} position {fault['position']}: f0 | f1, "
            "culprit L1.moe.out") in result.output


def test_an_overwritten_kv_row_and_state_slot_are_named(runs) -> None:
    from enginetap.tap.analysis.continuity import check_continuity
    from enginetap.tap.analysis.files import load_run

    rank = load_run(runs["faults"]).rank(0)
    written = _report(runs)["written"]
    kv, state = written["kv"], written["state"]
    found = {(v.kind, v.step, v.checkpoint, v.key, v.slot) for v in check_continuity(rank)}
    assert found == {("kv", kv["step"] + 1, "L3.attn.kv_written", "k0", kv["slot"]),
                     ("state", state["step"] + 1, "L1.gdn.state_before", "k1", state["slot"])}
    (kv_found,) = [v for v in check_continuity(rank) if v.kind == "kv"]
    assert kv_found.position == kv["position"]


def test_armed_and_disarmed_tokens_are_identical(runs) -> None:
    report = _report(runs)
    assert report["same"]["s0"] == report["same"]["s1"] == report["same"]["s3"]
    assert {k: report["again"][k + "-again"] for k in report["same"]} == report["same"]
    # the fault changed f1's tokens only: it is a real divergence, not noise
    assert report["row"]["f0"] != report["row"]["f1"]


def test_tap_run_engine_sglang_and_diff_against_the_builtin_engine(runs, tmp_path) -> None:
    from enginetap.tap.analysis.diff import diff_runs
    from enginetap.tap.analysis.files import load_run
    from enginetap.tap.analysis.pairs import find_pairs
    from enginetap.jobs.tap import load_prompts, record_run

    run = load_run(runs["cli"])
    rank = run.rank(0)
    prompts = load_prompts("builtin:pairs")
    assert {row["key"] for step in rank.steps for row in step.rows} == {
        f"p{i}" for i in range(len(prompts))}
    assert all(p.first_step is None for p in find_pairs(rank)), "identical prompts split"
    record_run("builtin:llama", prompts, tmp_path / "builtin", max_new_tokens=4)
    diffs = diff_runs(run, load_run(tmp_path / "builtin"))
    assert diffs and diffs[0].rows_compared > 0  # aligned by request key and position
