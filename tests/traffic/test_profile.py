"""The profile format: cross-field rules name the field; JSON round trips; load errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from enginetap.errors import TrafficError
from enginetap.traffic import (
    ArrivalReplay, OverlapGroup, RequestProfile, TrafficProfile, load_profile, save_profile)


def _req(label: str = "r", n: int = 20, ids: list[int] | None = None, **kw) -> RequestProfile:
    return RequestProfile(label=label, input_tokens=n, output_tokens=3,
                          hash_ids=ids if ids is not None else [0, 1, 2], block_size=8, **kw)


def test_hash_blocks_must_tile_the_input_with_a_partial_last_block() -> None:
    assert _req(n=17).input_tokens == 17  # 8 + 8 + 1
    assert _req(n=24).input_tokens == 24  # three full blocks
    with pytest.raises(ValidationError, match=r"hash_ids has 3 blocks but input_tokens=25"):
        _req(n=25)
    with pytest.raises(ValidationError, match=r"needs 2"):
        _req(n=16)


def test_predecessor_tiling_is_checked_with_the_request_block_size() -> None:
    with pytest.raises(ValidationError, match=r"cache_predecessor\.hash_ids has 1 blocks"):
        _req(cache_predecessor={"input_tokens": 12, "hash_ids": [0]})
    ok = _req(cache_predecessor={"input_tokens": 12, "hash_ids": [0, 1], "locator": "x:1"})
    assert ok.cache_predecessor is not None and ok.cache_predecessor.locator == "x:1"


def test_unknown_fields_and_duplicate_labels_are_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        RequestProfile.model_validate({**_req().model_dump(), "colour": "red"})
    with pytest.raises(ValidationError, match="'a' is used twice"):
        TrafficProfile(name="p", source="test", requests=[_req("a"), _req("a")])
    with pytest.raises(ValidationError, match="members: label 'm' is used twice"):
        OverlapGroup(label="g", members=[_req("m"), _req("m")])
    with pytest.raises(ValidationError, match="at least one request"):
        TrafficProfile(name="p", source="test")


def test_arrival_replay_members_need_sorted_arrivals() -> None:
    with pytest.raises(ValidationError, match="arrival_s"):
        ArrivalReplay(label="a", time_scale=1, members=[_req("x")])
    with pytest.raises(ValidationError, match="sorted"):
        ArrivalReplay(label="a", time_scale=1, members=[_req("x", arrival_s=1.0),
                                                        _req("y", arrival_s=0.5)])


def _profile() -> TrafficProfile:
    return TrafficProfile(
        name="p", source="test", seed=7, scale=0.5, notes=["made by hand"],
        requests=[_req("a", cache_predecessor={"input_tokens": 9, "hash_ids": [0, 1]})],
        overlap_groups=[OverlapGroup(label="g", members=[_req("m0"), _req("m1", n=3,
                                                                        ids=[4])])],
        replays=[ArrivalReplay(label="arr", time_scale=0.1,
                               members=[_req("x", arrival_s=0.0), _req("y", arrival_s=0.3)])])


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    profile = _profile()
    path = save_profile(profile, tmp_path / "sub" / "p.json")
    assert load_profile(path) == profile
    assert not list(path.parent.glob(".*.tmp"))


def test_load_errors_name_the_line_or_the_field(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "name": "p",\n  "source": oops\n}\n')
    with pytest.raises(TrafficError, match=r"line 3 column 13 is not valid JSON"):
        load_profile(bad_json)
    data = json.loads(_profile().model_dump_json())
    data["overlap_groups"][0]["members"][1]["block_size"] = 0
    bad_field = tmp_path / "field.json"
    bad_field.write_text(json.dumps(data))
    with pytest.raises(TrafficError, match=r"overlap_groups\.0\.members\.1\.block_size"):
        load_profile(bad_field)
    with pytest.raises(TrafficError, match="cannot read traffic profile"):
        load_profile(tmp_path / "missing.json")
