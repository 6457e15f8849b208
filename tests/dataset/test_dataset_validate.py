"""validate_dataset finds every planted problem, each on its own line; summaries count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from enginetap.dataset import Dataset, summarize_dataset, validate_dataset
from enginetap.errors import DatasetError
from tests.dataset.dataset_helpers import HIDDEN, copy_definition

JSONL = "workloads/tiny_copy/tiny_copy_float32_h4.jsonl"


def _build(dataset: Dataset, receipt, copy_inputs) -> list:
    definition = copy_definition(constraints=("batch <= 16",))
    first = copy_inputs(batch=2)
    lines = [dataset.add_workload(definition, first, outputs={"y": first["x"] * 2},
                                  receipt=receipt)]
    lines += [dataset.add_workload(definition, copy_inputs(batch=b), receipt=receipt)
              for b in (3, 2)]
    dataset.write_definition(copy_definition("bfloat16"))
    return lines


def test_a_fresh_dataset_is_valid(dataset, receipt, copy_inputs):
    _build(dataset, receipt, copy_inputs)
    assert validate_dataset(dataset.root) == []


def test_planted_problems_are_each_reported_once(dataset, receipt, copy_inputs, gen):
    root = dataset.root
    w1, w2, w3 = _build(dataset, receipt, copy_inputs)
    (root / w2.workload.inputs["x"].path).unlink()  # missing blob
    w3_blob = root / w3.workload.inputs["x"].path  # wrong shape: batch 5 where axes say 2
    w3_blob.unlink()
    safetensors.torch.save_file({"x": torch.randn(5, HIDDEN, generator=gen)}, w3_blob)
    ghost = w1.model_copy(deep=True)
    ghost.definition, ghost.workload.uuid = "ghost", "ghost-uuid"
    with open(root / JSONL, "a") as f:
        f.write(ghost.model_dump_json() + "\n")  # line 4: unknown definition
        f.write('{"definition": "tiny_copy_float32_h4", "workload": \n')  # line 5: malformed
        f.write(w1.model_dump_json() + "\n")  # line 6: duplicate uuid
    (root / "blob/workloads/tiny_copy/stray.safetensors").write_bytes(b"orphan")
    moved = root / "definitions/elsewhere/tiny_copy_bfloat16_h4.json"
    moved.parent.mkdir()
    (root / "definitions/tiny_copy/tiny_copy_bfloat16_h4.json").rename(moved)
    (root / "definitions/tiny_copy/broken.json").write_text('{"name": ')

    problems = validate_dataset(root)
    expected = [
        "definitions/elsewhere/tiny_copy_bfloat16_h4.json: definition 'tiny_copy_bfloat16_h4' "
        "of op_type 'tiny_copy' belongs at definitions/tiny_copy/tiny_copy_bfloat16_h4.json",
        "definitions/tiny_copy/broken.json: malformed JSON",
        f"{JSONL}:2: input 'x': blob {w2.workload.inputs['x'].path} is missing",
        f"{JSONL}:3: input 'x': expected shape [2, 4], blob",
        f"{JSONL}:4: unknown definition 'ghost'",
        f"{JSONL}:5: malformed JSON",
        f"{JSONL}:6: duplicate uuid '{w1.workload.uuid}' (first at {JSONL}:1)",
        "blob/workloads/tiny_copy/stray.safetensors: orphan blob",
    ]
    for fragment in expected:
        assert sum(p.startswith(fragment) for p in problems) == 1, (fragment, problems)
    assert len(problems) == len(expected), problems


def test_line_contents_are_checked_against_the_definition(dataset, receipt, copy_inputs):
    root = dataset.root
    [w1, *_] = _build(dataset, receipt, copy_inputs)
    record = json.loads(w1.model_dump_json())
    variants = {
        "no axes": ("workload.axes", {}),
        "extra axis": ("workload.axes", {"batch": 2, "hidden": 4}),
        "constraint": ("workload.axes", {"batch": 17}),
        "scalar as float": ("workload.inputs.n", {"type": "scalar", "value": 1.5}),
        "output key": ("enginetap.outputs.tensors.y.tensor_key", "nope"),
        "unsafe path": ("workload.inputs.x.path", "../outside.safetensors"),
    }
    with open(root / JSONL, "a") as f:
        for uuid, (where, value) in variants.items():
            changed = json.loads(json.dumps(record))
            *parents, leaf = where.split(".")
            node = changed
            for key in parents:
                node = node[key]
            node[leaf] = value
            changed["workload"]["uuid"] = uuid
            f.write(json.dumps(changed) + "\n")
    found = validate_dataset(root)
    # One line per variant, except that batch=17 also contradicts both tensors' shapes.
    assert len(found) == len(variants) + 2, found
    problems = "\n".join(found)
    assert f"{JSONL}:4: axes lack the definition's var axes ['batch']" in problems
    assert f"{JSONL}:5: axes ['hidden'] are not var axes" in problems
    assert f"{JSONL}:6: constraint 'batch <= 16' is false for batch=17" in problems
    assert f"{JSONL}:6: input 'x': expected shape [17, 4]" in problems
    assert f"{JSONL}:6: engine output 'y': expected shape [17, 4]" in problems
    assert f"{JSONL}:7: input 'n': 1.5 is not a scalar of dtype int32" in problems
    assert f"{JSONL}:8: engine output 'y': blob {w1.workload.inputs['x'].path} has no tensor " \
        "'nope'" in problems
    assert f"{JSONL}:9: input 'x': refusing dataset path '../outside.safetensors'" in problems


def test_validate_and_summarize_need_an_existing_root(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        validate_dataset(tmp_path / "missing")
    with pytest.raises(DatasetError, match="does not exist"):
        summarize_dataset(tmp_path / "missing")


def test_summary_counts_workloads_variants_outputs_and_bytes(dataset, receipt, copy_inputs):
    _build(dataset, receipt, copy_inputs)
    summaries = {s.name: s for s in summarize_dataset(dataset.root)}
    assert set(summaries) == {"tiny_copy_float32_h4", "tiny_copy_bfloat16_h4"}
    used = summaries["tiny_copy_float32_h4"]
    assert (used.op_type, used.workloads, used.variants, used.with_outputs) == \
        ("tiny_copy", 3, 2, 1)
    parts = [dataset.root / "definitions/tiny_copy/tiny_copy_float32_h4.json",
             dataset.root / JSONL,
             *(dataset.root / "blob/workloads/tiny_copy/tiny_copy_float32_h4").iterdir()]
    assert used.bytes == sum(Path(p).stat().st_size for p in parts)
    empty = summaries["tiny_copy_bfloat16_h4"]
    assert (empty.workloads, empty.variants, empty.with_outputs) == (0, 0, 0)
