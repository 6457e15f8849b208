"""Replay with built-in and several solutions: SKIPPED reasons, containment, the summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from enginetap.cli.main import main
from enginetap.dataset import Dataset
from enginetap.definitions.registry import get_template
from enginetap.replay import replay_dataset
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import CANDIDATES, Built


def _cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int | str | None:
    monkeypatch.setattr(sys, "argv", ["enginetap", "replay", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code


@pytest.fixture
def attention_dataset(tmp_path: Path) -> Path:
    """gqa_paged_decode and gdn_decode examples, two synthetic workloads each."""
    dataset = Dataset(tmp_path / "attn", create=True)
    for family in ("gqa_paged_decode", "gdn_decode"):
        synthesize(dataset, get_template(family), workloads=2, seed=7)
    return dataset.root


def test_builtins_pass_or_skip_with_reasons(attention_dataset: Path) -> None:
    report = replay_dataset(attention_dataset, solution=["torch:sdpa", "fla:gdn"],
                            warmup=0, repeats=1)
    rows = {(r.definition.split("_h")[0].split("_qk")[0], r.solution): r for r in report.summary}
    assert rows["gqa_paged_decode", "torch:sdpa"].status == "PASS"
    assert rows["gqa_paged_decode", "torch:sdpa"].counts == {"PASS": 2}
    assert rows["gqa_paged_decode", "torch:sdpa"].candidate_ms > 0
    assert rows["gqa_paged_decode", "fla:gdn"].reason.startswith("no adapter for gqa_paged_decode")
    skipped = rows["gdn_decode", "fla:gdn"]
    assert skipped.status == "SKIPPED" and skipped.candidate_ms is None
    assert skipped.reason == "fla:gdn runs on cuda only; this replay runs on cpu"
    assert rows["gdn_decode", "torch:sdpa"].status == "SKIPPED"
    # Skipped checks never read as a pass; the engine checks still ran and passed.
    assert report.ok and report.counts["SKIPPED"] == 6 and report.counts["FAIL"] == 0


def test_crashing_and_nan_candidates_are_contained(rmsnorm_dataset: Built) -> None:
    names = [f"{CANDIDATES}:{n}" for n in ("exiting", "one_nan", "correct")]
    report = replay_dataset(rmsnorm_dataset.root, solution=names, warmup=0, repeats=1)
    by_solution = {r.solution: r for r in report.summary}
    exiting, nan, correct = (by_solution[n] for n in names)
    assert exiting.status == "ERROR" and exiting.counts == {"ERROR": 2}
    assert "exit" in exiting.reason  # the child ended: said so, and the next workload ran
    assert nan.status == "FAIL" and nan.nonfinite == 2
    assert "(1 NaN where none expected); first at [0, 3]: expected" in nan.reason
    assert correct.status == "PASS" and correct.counts == {"PASS": 2}
    assert not report.ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_fault_is_contained(rmsnorm_dataset: Built) -> None:
    # A device-side assert poisons the CUDA context of the child it happened in; the
    # workload after it and the solution after it still run, and pass.
    names = [f"{CANDIDATES}:{n}" for n in ("cuda_device_assert", "into")]
    report = replay_dataset(rmsnorm_dataset.root, solution=names, device="cuda", warmup=0,
                            repeats=1)
    by_solution = {r.solution: r for r in report.summary}
    faulty, good = (by_solution[n] for n in names)
    assert faulty.status in ("ERROR", "FAIL") and "PASS" not in faulty.counts, faulty
    assert sum(faulty.counts.values()) == 2  # both workloads were tried, each in a new child
    assert good.status == "PASS" and good.counts == {"PASS": 2}, good


def test_a_hanging_candidate_is_killed_after_the_timeout(rmsnorm_dataset: Built) -> None:
    names = [f"{CANDIDATES}:{n}" for n in ("hanging", "correct")]
    report = replay_dataset(rmsnorm_dataset.root, solution=names, warmup=0, repeats=1,
                            timeout=2)
    by_solution = {r.solution: r for r in report.summary}
    hanging, correct = (by_solution[n] for n in names)
    assert hanging.status == "ERROR" and hanging.counts == {"ERROR": 2}
    messages = {c.message for w in report.definitions[0].workloads for c in w.checks
                if c.solution == names[0]}
    assert messages == {"candidate failed: no reply within 2 s (a hang, or too slow for "
                        "--timeout): its process was killed"}
    assert correct.status == "PASS" and correct.counts == {"PASS": 2}


def test_a_timeout_must_be_positive(rmsnorm_dataset: Built) -> None:
    from enginetap.errors import ConfigError

    with pytest.raises(ConfigError, match="bad timeout"):
        replay_dataset(rmsnorm_dataset.root, timeout=-1)


def test_a_failed_call_gets_a_fresh_process_for_the_next_workload(rmsnorm_dataset: Built
                                                                   ) -> None:
    name = f"{CANDIDATES}:poisons_its_process"
    report = replay_dataset(rmsnorm_dataset.root, solution=name, warmup=0, repeats=1)
    messages = [c.message for w in report.definitions[0].workloads for c in w.checks
                if c.check == "candidate"]
    # Each workload met a new process: both saw the first failure, not the sticky one.
    assert messages == ["candidate failed: RuntimeError: CUDA error: an illegal memory "
                        "access was encountered (first)"] * 2


def test_cli_lists_solutions_and_replays_a_builtin(attention_dataset: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert _cli(monkeypatch, "--list-solutions") == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("fla:gdn", "liger:rmsnorm", "torch:sdpa",
                                           "torch:flex"))
    out = tmp_path / "r.json"
    code = _cli(monkeypatch, str(attention_dataset), "--solution", "torch:flex", "--repeats",
                "1", "--warmup", "0", "--json", str(out), "-d",
                "gqa_paged_decode_h4_kv2_d32_ps16_bfloat16")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "definition x solution" in printed and "torch:flex" in printed
    summary = json.loads(out.read_text())["summary"]
    assert [(r["solution"], r["status"]) for r in summary] == [("torch:flex", "PASS")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_builtin_on_cuda_passes_or_says_what_is_missing(tmp_path: Path) -> None:
    from enginetap.replay.builtin import BUILTINS

    dataset = Dataset(tmp_path / "gpu", create=True)
    for family in dict.fromkeys(f for b in BUILTINS for f in b.adapters):
        synthesize(dataset, get_template(family), workloads=2, seed=5)
    report = replay_dataset(dataset.root, solution=[b.name for b in BUILTINS], device="cuda",
                            warmup=1, repeats=3)
    for row in report.summary:
        if row.status == "SKIPPED":
            assert row.reason.startswith("no adapter for") or "not installed" in row.reason
        else:
            assert row.status == "PASS", row
