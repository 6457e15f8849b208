"""Loaders: the real Mooncake sample, the packaged slice, our AgentX fixture, bad records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginetap.errors import TrafficError
from enginetap.traffic import load_agentx, load_mooncake
from enginetap.traffic.loaders import MOONCAKE_BLOCK
from enginetap.traffic.sources import packaged_trace


def test_real_mooncake_sample_loads_every_request(real_trace_path: Path) -> None:
    trace = load_mooncake(real_trace_path)
    raw = [json.loads(line) for line in real_trace_path.read_text().splitlines()]
    assert len(trace.records) == len(raw) == 500
    assert [r.input_length for r in trace.records] == [r["input_length"] for r in raw]
    assert [r.hash_ids for r in trace.records] == [r["hash_ids"] for r in raw]
    assert min(r.input_length for r in trace.records) == 892
    assert max(r.input_length for r in trace.records) == 121298
    assert trace.locator(0) == "mooncake_conversation_500.jsonl:1"


def test_packaged_slice_is_sixty_real_lines(real_trace_path: Path) -> None:
    trace = packaged_trace()
    assert len(trace.records) == 60
    real = real_trace_path.read_text().splitlines()
    assert [json.loads(line) for line in real[380:440]] == [
        r.model_dump() for r in trace.records]


def test_slice_records_tile_their_inputs() -> None:
    for rec in packaged_trace().records:
        assert len(rec.hash_ids) == -(-rec.input_length // MOONCAKE_BLOCK)
        assert rec.hash_ids[0] == 0  # the common system prompt block


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 0, "input_length": 600', "not JSON"),
    ('[1, 2]', "a JSON list, not an object"),
    ('{"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}', "output_length: Field required"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
     "timestamp: Input should be greater than or equal to 0"),
    ('{"timestamp": 0, "input_length": "many", "output_length": 5, "hash_ids": [0, 1]}',
     "input_length: Input should be a valid integer"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]}',
     "hash_ids has 2 blocks but input_length=1100 needs 3 blocks of 512"),
])
def test_bad_mooncake_records_name_the_line_and_field(tmp_path: Path, line: str,
                                                      message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(TrafficError, match="bad record at .*trace.jsonl:4") as info:
        load_mooncake(path)
    assert message in str(info.value)


def test_empty_or_missing_mooncake_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TrafficError, match="has no records"):
        load_mooncake(tmp_path / "empty.jsonl")
    with pytest.raises(TrafficError, match="cannot read Mooncake trace"):
        load_mooncake(tmp_path / "absent.jsonl")


def test_agentx_fixture_becomes_a_profile(agentx_path: Path) -> None:
    profile = load_agentx(agentx_path, seed=5)
    assert profile.seed == 5 and profile.source.startswith(
        "agentx:enginetap-test/agentx-shapes@test-0001 sha256=")
    labels = [r.label for r in profile.requests]
    assert labels == ["cold_main", "fully_reused", "subagent_typical"]
    reused = profile.requests[1]
    assert reused.session == "s-main" and reused.cache_predecessor is not None
    assert reused.cache_predecessor.locator == "s-main/turn-1"
    (group,) = profile.overlap_groups
    assert [m.label for m in group.members] == ["fan_a", "fan_b", "tool_fanout_2"]
    assert {m.session for m in group.members} == {"s-fan"}


def _broken_agentx(tmp_path: Path, agentx_path: Path, edit) -> Path:
    data = json.loads(agentx_path.read_text())
    edit(data)
    path = tmp_path / "agentx.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def test_bad_agentx_records_name_the_record_line_and_field(tmp_path: Path,
                                                          agentx_path: Path) -> None:
    def drop_output(data):
        del data["profiles"][2]["output_tokens"]

    path = _broken_agentx(tmp_path, agentx_path, drop_output)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
                if '"subagent_typical"' in text)
    with pytest.raises(TrafficError, match=rf"profiles\[2\] \(label 'subagent_typical'\) at "
                                           rf".*agentx.json:{line}: output_tokens"):
        load_agentx(path)

    def bad_tiling(data):
        data["overlap_profiles"][0]["requests"][1]["input_tokens"] = 30

    with pytest.raises(TrafficError, match=r"overlap_profiles\[0\].*hash_ids has 3 blocks"):
        load_agentx(_broken_agentx(tmp_path, agentx_path, bad_tiling))

    def no_revision(data):
        del data["revision"]

    with pytest.raises(TrafficError, match="revision: Field required"):
        load_agentx(_broken_agentx(tmp_path, agentx_path, no_revision))


def test_agentx_syntax_errors_give_the_line(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('{\n  "dataset": "x",\n  "revision": \n}\n')
    with pytest.raises(TrafficError, match="line 4 column 1 is not valid JSON"):
        load_agentx(path)
