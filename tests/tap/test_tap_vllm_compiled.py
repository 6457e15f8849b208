"""Tap on vLLM CPU in its compiled mode (not ``enforce_eager``: one dynamo trace, inductor).

Five engine runs, each with its own vLLM cache folder (no compiled artifact is shared
between runs): tiny qwen3_next (gated delta rule, full attention, MoE) compiled and
armed, with faults injected by test code (``vllm_tap_compiled_run.py``) and disarmed
after its phases; the same compiled and disarmed; the same eager and armed; and the tiny
Llama through ``enginetap tap run --engine vllm`` with ``--mode compile`` and eager. The
checks: the compiled run records every checkpoint the eager run does, by the same names
in the same order, and says it ran compiled with nothing unplaced; ``tap diff`` against
the eager run names where and says why; a corrupted row, an overwritten KV row and an
overwritten state slot are named exactly; identical requests never split; a disarmed
compiled engine goes on serving.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from enginetap.cli.main import app
from enginetap.tap.analysis.continuity import check_continuity, check_metadata
from enginetap.tap.analysis.files import load_run
from enginetap.tap.analysis.pairs import find_pairs
from tests.pairwise import side_by_side

HERE = Path(__file__).parent
VLLM_TESTS = HERE.parent / "engines" / "vllm"
COMPILED = "DYNAMO_TRACE_ONCE"  # vLLM CPU's compiled mode (VLLM_COMPILE becomes it)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(vllm_lock: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(VLLM_TESTS))
    from vllm_harness import child_env, run_script

    from enginetap.models import build_model

    out = tmp_path_factory.mktemp("tap-vllm-compiled")
    model, llama = str(build_model("qwen3_next")), str(build_model("llama"))
    script = str(HERE / "vllm_tap_compiled_run.py")

    def env(name: str, armed: bool) -> dict[str, str]:
        extra = {"VLLM_CACHE_ROOT": str(out / f"cache-{name}")}
        if armed:
            (out / f"{name}.arming.json").write_text(json.dumps(
                {"enabled": True, "capabilities": ["tap"], "out_dir": str(out / name),
                 "options": {"tap": {"max_rows": 256}}}))  # every prefill row
            extra["ENGINETAP_CONFIG"] = str(out / f"{name}.arming.json")
        return child_env(extra)

    def child(name: str, *args: str, armed: bool = True) -> str:
        return run_script([script, model, str(out / f"{name}.json"), *args],
                          env(name, armed), out / f"{name}.log", timeout=900)

    def cli(name: str, *mode: str) -> str:
        return run_script(["-m", "enginetap.cli.main", "tap", "run", "--engine", "vllm",
                           "--model", llama, "--prompts", "builtin:pairs",
                           "--max-new-tokens", "3", "--out", str(out / name), *mode],
                          env(name, armed=False), out / f"{name}.log", timeout=900)

    side_by_side([
        lambda: child("compiled", "--faults", "--phases", "same,row,kv", "--again"),
        lambda: child("eager", "--eager"),
        lambda: child("disarmed", "--faults", armed=False),
        lambda: cli("llama-compiled", "--mode", "compile"),
        lambda: cli("llama-eager")])
    return {"root": out, **{n: out / n for n in ("compiled", "eager", "llama-compiled",
                                                 "llama-eager")}}


def _report(runs: dict[str, Path], name: str) -> dict:
    return json.loads((runs["root"] / f"{name}.json").read_text())


def _same_phase(rank, keys=("s0", "s1", "s2", "s3")) -> list:
    return [s for s in rank.steps if {r["key"] for r in s.rows} <= set(keys)]


def test_compiled_run_records_every_checkpoint_of_the_eager_run(runs) -> None:
    compiled, eager = load_run(runs["compiled"]), load_run(runs["eager"])
    assert compiled.header["compiled"] == COMPILED and compiled.header["not_placed"] == []
    assert eager.header["compiled"] is False
    assert "are not recorded (torch.compile" not in (runs["root"] / "compiled.log").read_text()
    steps = _same_phase(compiled.rank(0)), _same_phase(eager.rank(0))
    assert len(steps[0]) == len(steps[1]) == 5  # one prefill step, four decode steps
    for c, e in zip(*steps):  # same names (sublayers, KV rows, GDN state), same order
        assert c.checkpoints == e.checkpoints, (c.step, c.checkpoints, e.checkpoints)
        assert len(c.sampler) == len(c.rows)
    assert {"L0.in", "L0.gdn.state_before", "L0.gdn.conv_after", "L0.gdn.norm.out",
            "L0.moe.shared.out", "L1.moe.out", "L3.attn.kv_written", "L3.attn.kv_prev",
            "L3.attn.core.out", "L3.out1"} <= set(steps[0][0].checkpoints)
    llama = [load_run(runs[n]).rank(0).steps for n in ("llama-compiled", "llama-eager")]
    assert load_run(runs["llama-compiled"]).header["compiled"] == COMPILED
    # (their tokens, hence their steps, may differ: each kind of step's names agree)
    assert {tuple(s.checkpoints) for s in llama[0]} == {tuple(s.checkpoints) for s in llama[1]}
    assert {"L0.in", "L0.attn.core.out", "L0.mlp.out", "L1.attn.kv_written"} <= \
        set(llama[0][0].checkpoints)


def test_diff_against_the_eager_run_says_where_and_why(runs) -> None:
    done = CliRunner().invoke(app, ["tap", "diff", str(runs["eager"]), str(runs["compiled"]),
                                    "--json"])
    assert done.exit_code in (0, 1), done.output
    (result,) = json.loads(done.stdout)
    assert result["rows_compared"] > 0 and result["checkpoints_compared"] >= 40
    first = result["first"]
    if first is not None:  # where vLLM's CPU kernels (eager) and inductor's code differ
        # the prefill's inputs are the same token ids: a divergence starts inside a step
        # whose layer input agreed, at a sublayer output, never at an input checkpoint
        assert not first["checkpoint"].endswith(".in"), first
    text = CliRunner().invoke(app, ["tap", "diff", str(runs["eager"]), str(runs["compiled"])])
    assert f"B ran compiled ({COMPILED})" in text.output, text.output


def test_a_corrupted_row_is_named_in_compiled_mode(runs) -> None:
    rank = load_run(runs["compiled"]).rank(0)
    fault = _report(runs, "compiled")["written"]["row"]
    pair = next(p for p in find_pairs(rank) if p.keys == ("f0", "f1"))
    assert (pair.first_step, pair.position, pair.checkpoint) == (fault["step"],
                                                                fault["position"], "L1.moe.out")
    step = next(s for s in rank.steps if s.step == fault["step"])
    assert pair.agreeing_input == step.checkpoints[step.checkpoints.index("L1.moe.out") - 1]


def test_an_overwritten_kv_row_and_state_slot_are_named_in_compiled_mode(runs) -> None:
    rank = load_run(runs["compiled"]).rank(0)
    written = _report(runs, "compiled")["written"]
    kv, state = written["kv"], written["state"]
    found = {(v.kind, v.step, v.checkpoint, v.key, v.slot) for v in check_continuity(rank)}
    assert found == {("kv", kv["step"] + 1, "L3.attn.kv_written", "k0", kv["slot"]),
                     ("state", state["step"] + 1, "L1.gdn.state_before", "k1", state["slot"])}
    assert check_metadata(rank) == []


def test_identical_requests_never_split_and_a_disarmed_compiled_engine_serves_on(runs) -> None:
    rank = load_run(runs["compiled"]).rank(0)
    pairs = {p.keys: p for p in find_pairs(rank)}
    for keys in (("s0", "s1"), ("s0", "s3"), ("s1", "s3")):
        assert pairs[keys].rows_compared >= 40 + 4 and not pairs[keys].split, pairs[keys]
    report = _report(runs, "compiled")
    assert report["compilation"] == COMPILED
    # disarmed, the compiled graph still runs the tap's op (vLLM never retraces it)
    assert report["again"] == {f"{k}-again": v for k, v in report["same"].items()}


def test_armed_and_disarmed_compiled_runs_sample_the_same_tokens(runs) -> None:
    assert _report(runs, "compiled")["same"] == _report(runs, "disarmed")["same"]
