"""replay_dataset on real datasets: engine checks, trust, candidates, poison, bad data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from enginetap.definitions.base import compile_reference
from enginetap.definitions.registry import get_template
from enginetap.errors import ConfigError
from enginetap.replay import replay_dataset
from enginetap.replay.results import ReplayReport
from tests.replay.replay_helpers import CANDIDATES, Built, receipt


def _replay(built: Built, candidate: str | None = None, **options) -> ReplayReport:
    solution = f"{CANDIDATES}:{candidate}" if candidate else None
    return replay_dataset(built.root, solution=solution, warmup=0, repeats=1, **options)


def _checks(report: ReplayReport, kind: str) -> list:
    return [c for d in report.definitions for w in d.workloads for c in w.checks
            if c.check == kind]


def test_synthetic_dataset_replays_clean(rmsnorm_dataset: Built) -> None:
    report = replay_dataset(rmsnorm_dataset.root, warmup=1, repeats=2)
    assert report.ok and report.problems == []
    (result,) = report.definitions
    assert result.name == "rmsnorm_h128_bfloat16_round_twice" and result.reference == "enginetap"
    assert [w.status for w in result.workloads] == ["PASS", "PASS"]
    engine = _checks(report, "engine")
    assert len(engine) == 2 and all(c.comparison.max_abs_error == 0.0 for c in engine)
    assert all(w.reference_ms is not None and w.reference_ms > 0 for w in result.workloads)
    assert report.counts == {"PASS": 2, "SKIPPED": 0, "FAIL": 0, "ERROR": 0, "REFUSED": 0}


def test_planted_wrong_engine_output_fails_with_its_numbers(rmsnorm_dataset: Built) -> None:
    built = rmsnorm_dataset
    line = built.dataset.workloads(built.definition.name)[0]
    inputs = built.dataset.load_inputs(line)
    good = compile_reference(built.definition.reference)(*inputs.values())
    planted = good.clone()
    planted[1, 10] += 0.5
    planted[2, 20] = -planted[2, 20]
    built.dataset.add_workload(built.definition, inputs, outputs={"output": planted},
                               receipt=receipt(), uuid="planted")
    report = _replay(built)
    assert not report.ok
    (bad,) = [w for w in report.definitions[0].workloads if w.status != "PASS"]
    assert bad.uuid == "planted" and bad.status == "FAIL"
    comparison = bad.checks[0].comparison
    moved = (planted.double() - good.double()).abs()
    assert comparison.max_abs_error == pytest.approx(float(moved.max()))
    assert comparison.matched == good.numel() - 2 and comparison.total == good.numel()
    rule = get_template("rmsnorm").rule("output")  # the family's documented engine spread
    assert (comparison.atol, comparison.rtol) == (rule.atol, rule.rtol)
    assert comparison.reason.startswith(f"2 of {good.numel()} elements differ; first at [1, 10]")


def test_candidate_correct_alternative_passes_and_is_timed(rmsnorm_dataset: Built) -> None:
    report = _replay(rmsnorm_dataset, "correct")
    assert report.ok, report.model_dump_json(indent=1)
    candidate = _checks(report, "candidate")
    assert len(candidate) == 2 and all(c.vs_engine is not None for c in candidate)
    name = f"{CANDIDATES}:correct"
    assert all(c.solution == name for c in candidate)
    for w in report.definitions[0].workloads:
        ms = w.candidate_ms[name]
        assert ms > 0 and w.speedup[name] == pytest.approx(w.reference_ms / ms)


def test_candidate_wrong_numerics_fails(rmsnorm_dataset: Built) -> None:
    report = _replay(rmsnorm_dataset, "no_weight")
    candidate = _checks(report, "candidate")
    assert [c.status for c in candidate] == ["FAIL", "FAIL"]
    assert candidate[0].comparison.matched_ratio < 0.5
    assert [c.status for c in _checks(report, "engine")] == ["PASS", "PASS"]
    assert not report.ok


def test_candidate_nan_where_reference_has_none_fails(rmsnorm_dataset: Built) -> None:
    report = _replay(rmsnorm_dataset, "one_nan")
    candidate = _checks(report, "candidate")
    assert all(c.status == "FAIL" and c.comparison.unexpected_nan == 1 for c in candidate)


def test_raising_candidate_is_an_error_row_and_replay_goes_on(rmsnorm_dataset: Built) -> None:
    report = _replay(rmsnorm_dataset, "raising")
    workloads = report.definitions[0].workloads
    assert len(workloads) == 2 and all(w.status == "ERROR" for w in workloads)
    (error,) = [c for c in workloads[1].checks if c.check == "candidate"]
    assert error.message == "candidate failed: ValueError: kernel not built for this shape"
    assert [c.status for c in _checks(report, "engine")] == ["PASS", "PASS"]


def test_candidate_mutating_its_inputs_cannot_corrupt_later_runs(rmsnorm_dataset: Built) -> None:
    report = replay_dataset(rmsnorm_dataset.root, solution=f"{CANDIDATES}:mutating",
                            warmup=1, repeats=2)
    assert report.ok, report.model_dump_json(indent=1)


def test_destination_passing_candidate_is_poisoned(rmsnorm_dataset: Built) -> None:
    assert _replay(rmsnorm_dataset, "into").ok
    report = _replay(rmsnorm_dataset, "into_all_but_last_row")
    candidate = _checks(report, "candidate")
    assert [c.status for c in candidate] == ["FAIL", "FAIL"]
    # The example workloads have var axis batch_size; one row of 128 stays unwritten.
    assert all(c.message == "128 element(s) never written (still poison)" for c in candidate)
    assert all(c.comparison.unexpected_nan == 128 for c in candidate)


def test_bad_solution_spec_is_a_config_error(rmsnorm_dataset: Built) -> None:
    with pytest.raises(ConfigError, match="no callable 'missing'"):
        _replay(rmsnorm_dataset, "missing")
    with pytest.raises(ConfigError, match="expected 'module:function'"):
        replay_dataset(rmsnorm_dataset.root, solution="no_colon")


def test_foreign_reference_refused_without_trust_and_run_with_it(foreign_dataset: Built,
                                                                  tmp_path: Path) -> None:
    marker = tmp_path / "reference-ran"
    refused = _replay(foreign_dataset)
    (result,) = refused.definitions
    assert result.status == "REFUSED" and "--trust-dataset-code" in result.message
    assert not marker.exists()  # the dataset's code never ran
    assert not refused.ok and refused.counts["REFUSED"] == 1
    trusted = _replay(foreign_dataset, trust_dataset_code=True)
    assert trusted.ok and trusted.definitions[0].reference == "dataset"
    assert marker.exists()
    rules = {c.comparison.kind for c in _checks(trusted, "engine")}
    assert rules == {"float"}  # no family: float32 output falls back to tolerance


def test_edited_reference_of_a_known_family_is_refused(rmsnorm_dataset: Built,
                                                       tmp_path: Path) -> None:
    from enginetap.dataset import Dataset

    built = rmsnorm_dataset
    edited = built.definition.model_copy(
        update={"reference": built.definition.reference + "\n# edited\n"})
    other = Dataset(tmp_path / "edited", create=True)
    line = built.dataset.workloads(built.definition.name)[0]
    other.add_workload(edited, built.dataset.load_inputs(line), receipt=receipt())
    report = replay_dataset(other.root, warmup=0, repeats=0)
    assert report.definitions[0].status == "REFUSED"


def test_bad_dataset_lines_are_problems_and_the_rest_still_replays(rmsnorm_dataset: Built) -> None:
    built = rmsnorm_dataset
    first, second = built.dataset.workloads(built.definition.name)
    blob = built.root / first.workload.inputs["hidden_states"].path
    blob.unlink()
    jsonl = next((built.root / "workloads").rglob("*.jsonl"))
    with jsonl.open("a") as f:
        f.write('{"definition": "rmsnorm_h128_bfloat16_round_twice", "workload": \n')
    report = _replay(built)
    assert not report.ok
    assert any("malformed JSON" in p for p in report.problems)
    assert any(first.workload.uuid in p for p in report.problems)  # the missing blob
    statuses = {w.uuid: w for w in report.definitions[0].workloads}
    assert statuses[first.workload.uuid].status == "ERROR"
    assert "cannot load" in statuses[first.workload.uuid].message
    assert statuses[second.workload.uuid].status == "PASS"


def test_wrong_shape_in_a_blob_is_an_error_row(rmsnorm_dataset: Built) -> None:
    built = rmsnorm_dataset
    line = built.dataset.workloads(built.definition.name)[0]
    blob = built.root / line.workload.inputs["hidden_states"].path
    tensors = safetensors.torch.load_file(str(blob))
    tensors["hidden_states"] = tensors["hidden_states"][:, :64].contiguous()
    blob.unlink()
    safetensors.torch.save_file(tensors, str(blob))
    report = _replay(built)
    (bad,) = [w for w in report.definitions[0].workloads if w.status != "PASS"]
    assert bad.status == "ERROR" and "does not fit" in bad.message
    assert report.problems  # validate_dataset saw it as well


def test_report_round_trips_through_json(rmsnorm_dataset: Built) -> None:
    report = _replay(rmsnorm_dataset, "correct")
    data = json.loads(report.model_dump_json())
    assert data["options"]["solutions"][0].endswith("replay_candidates.py:correct")
    assert data["options"]["repeats"] == 1 and data["ok"] is True
    assert ReplayReport.model_validate(data).definitions == report.definitions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replay_poisons_and_times_on_the_device(rmsnorm_dataset: Built) -> None:
    good = replay_dataset(rmsnorm_dataset.root, solution=f"{CANDIDATES}:into", device="cuda",
                          warmup=1, repeats=3)
    assert good.ok, good.model_dump_json(indent=1)
    assert all(w.candidate_ms[f"{CANDIDATES}:into"] > 0 for w in good.definitions[0].workloads)
    bad = _replay(rmsnorm_dataset, "into_all_but_last_row", device="cuda")
    assert all(c.message == "128 element(s) never written (still poison)"
               for c in _checks(bad, "candidate"))


def test_router_ids_that_tie_on_their_logits_pass_and_others_fail(tmp_path: Path) -> None:
    from enginetap.dataset import Dataset
    from enginetap.definitions.registry import get_template

    template = get_template("moe_topk_softmax")
    definition = template.example_definition()
    dataset = Dataset(tmp_path / "router", create=True)
    logits = template.synthetic_inputs(definition, template.example_axes, seed=11)["router_logits"]
    ranked = logits[0].float().argsort(descending=True)
    second, third, last = (int(i) for i in ranked[[1, 2, -1]])
    logits[0, third] = logits[0, second]  # the 2nd and 3rd best experts now tie exactly
    weights, ids = compile_reference(definition.reference)(logits.clone())
    chosen = min(second, third)  # the reference keeps the lower id among equal logits
    for uuid, other in (("tie", max(second, third)), ("worse", last)):
        planted = ids.clone()
        planted[0][planted[0] == chosen] = other
        dataset.add_workload(definition, {"router_logits": logits},
                             outputs={"topk_weights": weights, "topk_ids": planted},
                             receipt=receipt(), uuid=uuid)
    report = replay_dataset(dataset.root, warmup=0, repeats=0)
    by_uuid = {w.uuid: {c.output: c for c in w.checks} for w in report.definitions[0].workloads}
    assert by_uuid["tie"]["topk_ids"].status == "PASS"
    assert by_uuid["tie"]["topk_ids"].comparison.ties == 1
    assert by_uuid["worse"]["topk_ids"].status == "FAIL"
    assert by_uuid["worse"]["topk_ids"].comparison.matched == ids.shape[0] - 1
