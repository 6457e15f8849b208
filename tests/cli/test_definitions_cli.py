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
    row = next(line for line in out.splitlines() if "rmsnorm_h128" in line)
    assert "rmsnorm" in row and "transformers" in row


def test_show_prints_the_definition_with_overrides(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(monkeypatch, capsys, "show", "rmsnorm", "--set", "hidden_size=256",
                        "--set", "dtype=float16")
    assert code == 0
    data = json.loads(out)
    assert data["name"] == "rmsnorm_h256" and data["axes"]["hidden_size"]["value"] == 256
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
    assert "rmsnorm: wrote rmsnorm_h64 with 3 workload(s)" in out
    dataset = Dataset(root)
    assert sorted(dataset.definitions()) == ["fused_add_rmsnorm_h64", "rmsnorm_h64"]
    lines = dataset.workloads("rmsnorm_h64")
    assert [line.enginetap.receipt.seed for line in lines] == [7, 8, 9]
    assert {line.enginetap.receipt.source for line in lines} == {"synthetic:rmsnorm"}
    first, second = (dataset.load_inputs(line)["hidden_states"] for line in lines[:2])
    assert not first.equal(second)  # each workload has its own seed
    assert validate_dataset(root) == []
    report = replay_dataset(root, warmup=0, repeats=0)
    assert report.ok and report.counts["PASS"] == 3 + 6  # rmsnorm 1 output, fused 2 outputs
