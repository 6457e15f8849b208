"""`enginetap definitions list|show|synth`, run through the console entry point."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from enginetap.cli.main import main
from enginetap.dataset import Dataset, validate_dataset
from enginetap.replay import replay_dataset


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["enginetap", "definitions", *args])
    try:
        main()
        code = 0  # commands that succeed return without sys.exit
    except SystemExit as exited:
        code = exited.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_names_families_and_their_examples(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(monkeypatch, capsys, "list")
    assert code == 0
    row = next(line for line in out.splitlines() if line.split()[:1] == ["rmsnorm"])
    assert "rmsnorm" in row and "transformers" in row


def test_show_prints_the_definition_with_overrides(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(monkeypatch, capsys, "show", "rmsnorm", "--set", "hidden_size=256",
                        "--set", "dtype=float16")
    assert code == 0
    data = json.loads(out)
    assert data["name"] == "rmsnorm_h256_float16_round_twice"
    assert data["axes"]["hidden_size"]["value"] == 256
    assert data["inputs"]["hidden_states"]["dtype"] == "float16"
    assert "hidden_size = 256" in data["reference"]


@pytest.mark.parametrize(("args", "message"), [
    (["show", "rmsnorm", "--set", "hidden_size=wide"], "'wide' does not parse as int"),
    (["show", "rmsnorm", "--set", "hidden_size"], "expected name=value"),
    (["show", "rmsnorm", "--set", "heads=4"], "unknown names ['heads']"),
    (["show", "no_such_family"], "unknown definition family 'no_such_family'"),
    (["synth", "ignored-dir"], "pass --family F (repeatable) or --all"),
])
def test_bad_requests_exit_two_with_one_message(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str],
                                                args: list[str], message: str) -> None:
    code, _, err = _cli(monkeypatch, capsys, *args)
    assert code == 2 and message in " ".join(err.split())


def test_synth_writes_replayable_workloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "synthetic"
    code, out, _ = _cli(monkeypatch, capsys, "synth", str(root), "--family", "rmsnorm",
                        "--family", "fused_add_rmsnorm", "--workloads", "3", "--seed", "7",
                        "--set", "hidden_size=64")
    assert code == 0
    assert "rmsnorm: wrote rmsnorm_h64_bfloat16_round_twice with 3 workload(s)" in out
    dataset = Dataset(root)
    assert sorted(dataset.definitions()) == ["fused_add_rmsnorm_h64_bfloat16_round_twice",
                                             "rmsnorm_h64_bfloat16_round_twice"]
    lines = dataset.workloads("rmsnorm_h64_bfloat16_round_twice")
    assert [line.enginetap.receipt.seed for line in lines] == [7, 8, 9]
    assert {line.enginetap.receipt.source for line in lines} == {"synthetic:rmsnorm"}
    first, second = (dataset.load_inputs(line)["hidden_states"] for line in lines[:2])
    assert first.shape != second.shape  # workloads vary their token counts, not only values
    assert validate_dataset(root) == []
    report = replay_dataset(root, warmup=0, repeats=0)
    assert report.ok and report.counts["PASS"] == 3 + 6  # rmsnorm 1 output, fused 2 outputs


@pytest.mark.parametrize(("setting", "message"), [
    ("dtype=evil", "dtype='evil' is not one of"),
    ("dtype=float4_e2m1", "dtype='float4_e2m1' is not one of"),
    ("rounding=thrice", "rounding='thrice' is not one of"),
    ("hidden_size=0", "must be positive integers"),
    ("hidden_size=1000000000000", "budget"),
])
def test_synth_refuses_bad_set_values_one_line_each(tmp_path: Path, setting: str, message: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ds"
    code, out, err = _cli(monkeypatch, capsys, "synth", str(root), "--family", "rmsnorm",
                          "--family", "fused_add_rmsnorm", "--set", setting)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 2 and all(message in " ".join(err.split()) for _ in lines)
    assert "Traceback" not in err
    assert not list((root / "definitions").rglob("*.json"))  # nothing left behind


def test_non_finite_float_params_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(monkeypatch, capsys, "synth", str(tmp_path / "ds"), "--family",
                        "moe_topk_grouped_sigmoid", "--set", "routed_scaling_factor=nan")
    assert code == 1 and "is not a finite number" in err and "Traceback" not in err


@pytest.mark.parametrize(("family", "setting"), [
    ("sparse_gqa_paged_decode", "num_kv_heads=4"), ("sparse_gqa_paged_decode", "num_kv_heads=1"),
    ("moe_grouped_gemm_fp8_fp4", "num_experts=3"),
])
def test_legal_const_axes_synthesize(tmp_path: Path, family: str, setting: str,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ds"
    code, out, err = _cli(monkeypatch, capsys, "synth", str(root), "--family", family,
                          "--set", setting, "--workloads", "2")
    assert code == 0, err
    assert validate_dataset(root) == []
    assert replay_dataset(root, warmup=0, repeats=0).ok


def test_a_failing_family_leaves_nothing_and_the_others_still_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ds"
    # num_qo_heads=3 breaks no const-only rule of its own but num_kv_heads=2 must divide it.
    code, out, err = _cli(monkeypatch, capsys, "synth", str(root), "--family",
                          "gqa_paged_decode", "--family", "rmsnorm", "--set", "num_qo_heads=3")
    assert code == 1
    assert "error: gqa_paged_decode:" in err and "error: rmsnorm:" in err  # unknown name
    code, out, err = _cli(monkeypatch, capsys, "synth", str(root), "--family",
                          "gqa_paged_decode", "--family", "rmsnorm")
    assert code == 0 and "rmsnorm: wrote" in out


def test_a_write_that_fails_midway_removes_the_definition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ds"
    Dataset(root, create=True)
    name = "rmsnorm_h128_bfloat16_round_twice"
    # A file where the definition's blob directory must go: the definition is written,
    # then its first workload fails.
    (root / "blob" / "workloads" / "rmsnorm").mkdir(parents=True)
    (root / "blob" / "workloads" / "rmsnorm" / name).write_text("in the way")
    code, out, err = _cli(monkeypatch, capsys, "synth", str(root), "--family", "rmsnorm",
                          "--family", "gqa_paged_decode")
    assert code == 1 and "error: rmsnorm:" in err and "Traceback" not in err
    assert "gqa_paged_decode: wrote" in out
    assert name not in Dataset(root).definitions()
    assert not (root / "definitions" / "rmsnorm" / f"{name}.json").exists()
    (root / "blob" / "workloads" / "rmsnorm" / name).unlink()  # the obstacle we planted
    assert validate_dataset(root) == []
