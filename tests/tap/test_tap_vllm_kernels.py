"""Tap on vLLM CPU at kernel level (tiny qwen3_next: gated delta rule, full attention, MoE).

Four engine runs: TP=1 with faults injected by test code (``vllm_tap_run.py``, see its
docstring for the phases), ``enginetap tap run --engine vllm`` at TP=1 and TP=2 on the
built-in prompt pairs, and the tiny Llama's offline run armed by
``ENGINETAP_CAPABILITIES=tap`` alone. The checks: the KV row written this step, the
gated-delta/convolution state around it and the sampler are recorded and continuous; a
corrupted row is named by the pair analysis at the layer and sublayer it was corrupted;
an overwritten KV row and an overwritten state slot are named by continuity (layer,
slot, request, position); identical requests never split; armed and disarmed tokens are
identical; TP=1 vs TP=2 diffs end to end after merging ranks, and TP=2's replicated
checkpoints agree rank to rank. vLLM's compiled mode: ``test_tap_vllm_compiled.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from enginetap.cli.main import app
from enginetap.tap.analysis.continuity import check_continuity, check_metadata, metadata_checked
from enginetap.tap.analysis.crossrank import compare_ranks
from enginetap.tap.analysis.files import TapRun, load_run
from enginetap.tap.analysis.pairs import find_pairs
from tests.pairwise import side_by_side

HERE = Path(__file__).parent
VLLM_TESTS = HERE.parent / "engines" / "vllm"
SAME = ("s0", "s1", "s3")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(vllm_lock: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(VLLM_TESTS))
    from vllm_harness import OFFLINE, child_env, run_script

    from enginetap.models import build_model

    out = tmp_path_factory.mktemp("tap-vllm")
    model, llama = str(build_model("qwen3_next")), str(build_model("llama"))
    # every row of the prefill step is tapped (143 rows), not only the last 64
    config = {"enabled": True, "capabilities": ["tap"], "out_dir": str(out / "tp1"),
              "options": {"tap": {"max_rows": 256}}}
    (out / "arming.json").write_text(json.dumps(config))

    def cli(tp: int) -> str:
        return run_script(["-m", "enginetap.cli.main", "tap", "run", "--engine", "vllm",
                           "--model", model, "--prompts", "builtin:pairs", "--max-new-tokens",
                           "4", "--tp", str(tp), "--out", str(out / f"cli{tp}")], child_env(),
                          out / f"cli{tp}.log")

    # the three TP=1 runs two at a time, then the TP=2 run alone
    side_by_side([
        lambda: run_script([str(HERE / "vllm_tap_run.py"), model, str(out / "tp1.json"),
                            "--faults"],
                           child_env({"ENGINETAP_CONFIG": str(out / "arming.json")}),
                           out / "tp1.log"),
        lambda: cli(1),
        lambda: run_script([str(OFFLINE), llama, str(out / "offline.json")],
                           child_env({"ENGINETAP": "1", "ENGINETAP_CAPABILITIES": "tap",
                                      "ENGINETAP_OUT": str(out / "offline")}),
                           out / "offline.log")])
    cli(2)
    return {"root": out, "tp1": out / "tp1", "cli1": out / "cli1", "cli2": out / "cli2",
            "offline": out / "offline"}


def _report(runs: dict[str, Path], tp: int) -> dict:
    return json.loads((runs["root"] / f"tp{tp}.json").read_text())


def test_kernel_points_are_recorded_and_continuous(runs) -> None:
    run = load_run(runs["tp1"])
    rank = run.rank(0)
    names = set(rank.steps[1].checkpoints)
    assert {"L3.attn.kv_written", "L3.attn.kv_prev", "L3.attn.core.out", "L1.gdn.state_before",
            "L1.gdn.state_after", "L1.gdn.conv_before", "L1.gdn.conv_after"} <= names
    assert run.header["cache_groups"]["L1.gdn"] != run.header["cache_groups"]["L3.attn"]
    # only the injected overwrites break continuity (checked exactly below)
    assert {v.key for v in check_continuity(rank)} == {"k0", "k1"}
    assert check_metadata(rank) == []
    rows = sum(len(s.rows) for s in rank.steps)
    assert metadata_checked(rank) == {"counters": rows, "lengths": rows}
    for step in rank.steps:  # greedy: the sampled token is the top logit (or tied with it)
        last = {row["key"]: i for i, row in enumerate(step.rows)}
        assert len(step.sampler) == len(step.rows)
        for key, i in last.items():
            top = step.sampler[i]
            assert step.sampled[key] == top["argmax"] or (
                top["gap"] == 0 and step.sampled[key] == top["runner_up"]), (step.step, key, top)


def test_a_corrupted_row_is_named_by_the_pair_analysis(runs) -> None:
    rank = load_run(runs["tp1"]).rank(0)
    fault = _report(runs, 1)["written"]["row"]
    pair = next(p for p in find_pairs(rank) if p.keys == ("f0", "f1"))
    assert (pair.first_step, pair.position, pair.checkpoint) == (fault["step"],
                                                                fault["position"], "L1.moe.out")
    step = next(s for s in rank.steps if s.step == fault["step"])
    # the checkpoint just before it (its input side) still agreed
    assert pair.agreeing_input == step.checkpoints[step.checkpoints.index("L1.moe.out") - 1]


def test_an_overwritten_kv_row_and_state_slot_are_named(runs) -> None:
    rank = load_run(runs["tp1"]).rank(0)
    written = _report(runs, 1)["written"]
    kv, state = written["kv"], written["state"]
    found = {(v.kind, v.step, v.checkpoint, v.key, v.slot) for v in check_continuity(rank)}
    assert found == {("kv", kv["step"] + 1, "L3.attn.kv_written", "k0", kv["slot"]),
                     ("state", state["step"] + 1, "L1.gdn.state_before", "k1", state["slot"])}
    (kv_found,) = [v for v in check_continuity(rank) if v.kind == "kv"]
    assert kv_found.position == kv["position"]


def test_identical_requests_never_split_and_tapping_changes_no_token(runs) -> None:
    rank = load_run(runs["tp1"]).rank(0)
    pairs = {p.keys: p for p in find_pairs(rank)}
    for keys in (("s0", "s1"), ("s0", "s3"), ("s1", "s3")):
        assert pairs[keys].rows_compared >= 40 + 4 and not pairs[keys].split, pairs[keys]
    report = _report(runs, 1)
    assert report["same"]["s0"] == report["same"]["s1"] == report["same"]["s3"]
    assert {k: v for k, v in report["again"].items()} == {
        f"{k}-again": v for k, v in report["same"].items()}


def test_tp1_vs_tp2_diff_runs_end_to_end_after_merging_ranks(runs) -> None:
    tp2 = load_run(runs["cli2"])
    assert sorted(tp2.ranks) == [0, 1] and tp2.header["tp_size"] == 2
    html = runs["root"] / "diff.html"
    done = CliRunner().invoke(app, ["tap", "diff", str(runs["cli1"]), str(runs["cli2"]),
                                    "--html", str(html)])
    assert done.exit_code in (0, 1), done.output
    assert done.output.startswith("ranks merged (A 1, B 2;")
    done_json = CliRunner().invoke(app, ["tap", "diff", str(runs["cli1"]), str(runs["cli2"]),
                                         "--json"])
    (result,) = json.loads(done_json.output)
    assert result["merged"] == [1, 2] and result["rows_compared"] > 0
    assert (done.exit_code == 1) == bool(result["rows_diverged"] or result["rows_token_diverged"])
    if result["first"] is not None:  # what it found is named, and is a whole checkpoint
        assert f"first divergence: step {result['first']['step_a']}" in done.output
        assert not result["first"]["checkpoint"].endswith(("core.out", "kv_written", "_before",
                                                           "_after", "shared.out"))
    assert "Where rows first diverge" in html.read_text()


def test_tp2_replicated_checkpoints_agree_rank_to_rank(runs) -> None:
    tp2: TapRun = load_run(runs["cli2"])
    ranks = [tp2.rank(r) for r in (0, 1)]
    assert [[(r["key"], r["pos"]) for s in k.steps for r in s.rows] for k in ranks][0] == \
        [(r["key"], r["pos"]) for s in ranks[1].steps for r in s.rows]
    # all-reduced outputs are whole on each rank and must be bitwise equal
    assert compare_ranks(tp2) == []
    done = CliRunner().invoke(app, ["tap", "report", str(runs["cli2"])])
    assert done.exit_code == 0, done.output
    assert "cross-rank: 0 replicated checkpoint(s) differ between ranks" in done.output


def test_tap_records_inside_a_vllm_worker(runs) -> None:
    # the tiny Llama's offline run (chunked prefill, a request arriving mid-way, a repeated
    # prompt) armed by the capability alone: vLLM's sublayers under the built-in engine's
    # short names, and the analyses read the file
    from enginetap.tap.analysis.diff import diff_runs
    from enginetap.tap.analysis.report import analyse, summary

    log = (runs["root"] / "offline.log").read_text()
    assert "tap (up to 64 rows per step" in log
    report = json.loads((runs["root"] / "offline.json").read_text())
    run = load_run(runs["offline"])
    rank = run.rank(0)
    assert run.header["world_size"] == 1 and rank.steps
    names = rank.steps[0].checkpoints
    # the kernel layer inside self_attn is named apart from it (no "#2" duplicates)
    assert {"L0.in", "L0.attn.core.out", "L0.attn.out", "L0.mlp.out", "L1.out"} <= set(names)
    assert not [n for n in names if "#" in n]
    assert names.index("L0.in") < names.index("L0.attn.core.out") < names.index("L0.attn.out") \
        < names.index("L1.in")
    keys = {row["key"] for step in rank.steps for row in step.rows}
    assert set(report["requests"]) <= keys
    assert {s.mode for s in rank.steps} == {"prefill", "decode", "mixed"}
    assert check_continuity(rank) == []
    (self_diff,) = diff_runs(run, run)
    assert self_diff.rows_compared > 0 and not self_diff.diverged
    assert summary(analyse(run))[1].startswith("rank 0:")
