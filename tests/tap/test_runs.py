"""Without faults: identical requests never split, tapping changes no token, a run diffed
against itself is clean, and batch 1 vs 8 diffs end to end through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from enginetap.cli.main import app
from enginetap.engines.hf import HFEngine
from enginetap.tap.continuity import check_continuity, check_metadata
from enginetap.tap.diff import diff_runs
from enginetap.tap.files import load_run
from enginetap.tap.pairs import find_pairs
from enginetap.tap.report import analyse, html_page, summary

from .conftest import Recorder, requests

PROMPTS = ["the cache holds every key", "kernels and caches", "the cache holds every key",
           "decode", "the cache holds every key"]


# qwen3_next is left out: on CPU its shared-expert gate (a Linear to one output) gives
# identical rows different bits at the batch's tail rows, a real split the tap reports
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_identical_requests_never_split_and_nothing_is_discontinuous(record: Recorder,
                                                                      model: str) -> None:
    _, run = record(model, requests(PROMPTS))
    rank = run.rank(0)
    identical = {("r0", "r2"), ("r0", "r4"), ("r2", "r4")}
    pairs = {p.keys: p for p in find_pairs(rank)}
    assert identical <= pairs.keys()
    for keys in identical:
        assert pairs[keys].rows_compared >= len(rank.steps)
        assert not pairs[keys].split, pairs[keys]
    assert check_continuity(rank) == [] and check_metadata(rank) == []
    names = rank.steps[1].checkpoints
    assert {"L0.in", "L0.out", "L1.moe.gate.out", "norm.out"} <= set(names)
    assert names.index("L0.in") < names.index("L0.out") < names.index("L1.in")
    last = rank.steps[-1]
    assert all(s["argmax"] == last.sampled[last.rows[i]["request_id"]]
               for i, s in enumerate(last.sampler))


@pytest.mark.parametrize("depth", ["sublayers", "layers"])
def test_armed_and_disarmed_tokens_are_identical(record: Recorder, depth: str) -> None:
    reqs = requests(PROMPTS, max_new_tokens=6)
    armed, run = record("qwen3_next", reqs, dtype=torch.bfloat16, max_rows=3, depth=depth)
    assert all(len(s.rows) <= 3 for s in run.rank(0).steps)
    assert check_continuity(run.rank(0)) == []
    engine = HFEngine.from_builtin("qwen3_next", dtype=torch.bfloat16, prefix_cache_size=0)
    assert [c.output_ids for c in engine.generate(reqs)] == armed


def test_a_run_diffed_against_itself_reports_nothing(record: Recorder) -> None:
    _, run = record("llama", requests(PROMPTS), request_filter="r")
    (result,) = diff_runs(run, run)
    assert result.rows_compared == sum(len(s.rows) for s in run.rank(0).steps)
    assert not result.diverged and result.first is None


def test_batch_1_vs_8_runs_end_to_end(tmp_path: Path) -> None:
    cli = CliRunner()
    for batch in (1, 8):
        done = cli.invoke(app, ["tap", "run", "--model", "builtin:llama", "--prompts",
                                "builtin:pairs", "--batch-size", str(batch), "--max-new-tokens",
                                "4", "--out", str(tmp_path / f"b{batch}")])
        assert done.exit_code == 0, done.output
    diff_html = tmp_path / "diff.html"
    done = cli.invoke(app, ["tap", "diff", str(tmp_path / "b1"), str(tmp_path / "b8"),
                            "--html", str(diff_html)])
    assert done.exit_code in (0, 1), done.output
    assert "Where rows first diverge" in diff_html.read_text()
    assert "aligned rows compared" in done.output
    a, b = load_run(tmp_path / "b1"), load_run(tmp_path / "b8")
    (result,) = diff_runs(a, b)
    assert result.rows_compared > 0
    assert (done.exit_code == 1) == result.diverged
    if result.first is not None:
        assert result.first.checkpoint in a.rank(0).steps[0].checkpoints
        assert result.first.key in result.per_request
    page = tmp_path / "b8.html"
    done = cli.invoke(app, ["tap", "report", str(tmp_path / "b8"), "--html", str(page)])
    assert done.exit_code == 0, done.output
    assert "same-prefix row pair(s)" in done.output and page.is_file()


def test_report_names_a_split_in_text_and_html(record: Recorder) -> None:
    # left padding in front of the shorter prompt changes the gated-delta chunking, so
    # rows at position 0 of different-length prompts are compared and may split
    _, run = record("qwen3_next", requests(PROMPTS))
    analysis = analyse(run)
    lines = summary(analysis)
    assert lines[1].startswith("rank 0:")
    page = html_page(analysis)
    assert page.count("<table>") >= 1 and "Where pairs split" in page
    assert "<div class='finding'>" in page  # each split is a finding with its next commands
    for split in analysis.ranks[0].pairs.splits[:20]:
        assert any(split.checkpoint in line and split.describe() in line for line in lines)


def test_the_request_filter_and_row_cap_narrow_the_tapped_rows(record: Recorder) -> None:
    _, run = record("llama", requests(PROMPTS), request_filter="r3", max_rows=2)
    steps = run.rank(0).steps
    assert steps and all({r["key"] for r in s.rows} == {"r3"} for s in steps)
    prompt_length = steps[1].rows[0]["pos"]  # the first decode row follows the prompt
    assert [r["pos"] for r in steps[0].rows] == [prompt_length - 2, prompt_length - 1]
    assert all(len(s.rows) == 1 for s in steps[1:])
    assert run.header["options"]["request_filter"] == "r3"


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_tap_wrapper_is_reported_once_and_the_engine_call_goes_on(
        record: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        where: str) -> None:
    """The sublayer wrapper contains its own errors (it runs without the patch layer's
    containment): a checkpoint that raises, at a layer's input (before the call) or a
    sublayer's output (after it), costs no token and no second call of the module."""
    import logging

    from enginetap.tap.record import TapRecorder

    broken = "L1.in" if where == "before" else "L1.mlp.out"
    take = TapRecorder.take
    failed: list[TapRecorder] = []

    def faulty(self: TapRecorder, name: str, tensor: object) -> None:
        if name == broken:
            failed.append(self)
            raise RuntimeError(f"injected fault at {name}")
        take(self, name, tensor)

    monkeypatch.setattr(TapRecorder, "take", faulty)
    reqs = requests(PROMPTS[:3], max_new_tokens=4)
    with caplog.at_level(logging.ERROR, logger="enginetap.tap"):
        armed, run = record("llama", reqs)
    engine = HFEngine.from_builtin("llama", prefix_cache_size=0)
    assert [c.output_ids for c in engine.generate(reqs)] == armed
    assert len(failed) == 4 and failed[0].failures == 4  # one per step, each contained
    logged = [r for r in caplog.records if "tap wrapper failed" in r.getMessage()]
    assert len(logged) == 1 and "injected fault" in logged[0].getMessage()
    steps = run.rank(0).steps
    assert len(steps) == 4 and all(broken not in s.checkpoints for s in steps)
    assert all({"L0.out", "norm.out"} <= set(s.checkpoints) for s in steps)  # the rest


def test_a_layers_only_run_diffs_cleanly_against_a_sublayers_run(tmp_path: Path) -> None:
    """``--depth layers`` records decoder layers only; the same prompts recorded with
    every sublayer agree with it on every checkpoint both have."""
    cli = CliRunner()
    for depth in ("layers", "sublayers"):
        done = cli.invoke(app, ["tap", "run", "--model", "builtin:llama", "--prompts",
                                "builtin:pairs", "--max-new-tokens", "3", "--depth", depth,
                                "--out", str(tmp_path / depth)])
        assert done.exit_code == 0, done.output
    layers, sublayers = load_run(tmp_path / "layers"), load_run(tmp_path / "sublayers")
    only = set(layers.rank(0).steps[0].checkpoints)
    every = set(sublayers.rank(0).steps[0].checkpoints)
    assert {"L0.in", "L0.out", "L1.out"} <= only < every and "L0.mlp.out" in every - only
    (result,) = diff_runs(layers, sublayers)
    assert result.rows_compared > 0 and not result.diverged


def test_the_tap_alone_names_modules_without_the_scopes_wrappers(tmp_path: Path) -> None:
    """The tap reads the scope's module names, never the running sublayer: armed without
    capture, the scope installs no wrapper (each would be one more call per sublayer
    call); armed by itself, the scope wraps as always."""
    from enginetap.config import ArmConfig
    from enginetap.core.jsonl import close_all
    from enginetap.core.scope import current_names
    from enginetap.engines.hf.arming import disarm

    seen: list[object] = []
    for capabilities in (["tap"], ["scope"]):
        config = ArmConfig(enabled=True, capabilities=capabilities,
                           out_dir=tmp_path / capabilities[0],
                           options={"step": {"record": False}})
        try:
            engine = HFEngine.from_builtin("llama", prefix_cache_size=0, arm=config)
            mlp = type(engine.model.model.layers[0].mlp)
            forward = mlp.forward
            mlp.forward = lambda self, x, _f=forward: (seen.append(current_names()), _f(self, x))[1]
            try:
                engine.generate(requests(PROMPTS[:2], max_new_tokens=3))
            finally:
                mlp.forward = forward
            patches = engine.arming.context.notes["scope"].gate._patches
            assert (patches == []) == (capabilities == ["tap"]), capabilities
            assert engine.arming.context.running_scope == (capabilities == ["scope"])
        finally:
            disarm()
            close_all()
        if capabilities == ["tap"]:
            steps = load_run(tmp_path / "tap").rank(0).steps
            assert len(steps) == 3 and all({"L0.in", "L0.mlp.out", "L1.attn.out"}
                                           <= set(s.checkpoints) for s in steps)
            assert set(seen) == {None}  # nothing tracks the running sublayer
            seen.clear()
    assert seen and all(names is not None for names in seen)  # the scope alone does
