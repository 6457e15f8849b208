"""Derived profiles on the real sample and the packaged slice; fitting to a context."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from enginetap.errors import TrafficError
from enginetap.traffic import (
    PromptBuilder, RequestProfile, TrafficProfile, derive_mooncake, fit_to_context,
    load_mooncake)
from enginetap.traffic.derive import PERCENTILES, percentile
from enginetap.traffic.scaling import all_requests
from enginetap.traffic.sources import packaged_trace


def _line(req: RequestProfile) -> int:
    return int((req.source or "").rsplit(":", 1)[1])


def _by_label(profile: TrafficProfile) -> dict[str, RequestProfile]:
    return {r.label: r for r in profile.requests}


def _check_percentiles(trace, profile: TrafficProfile) -> None:
    lengths = np.array([r.input_length for r in trace.records])
    picked = _by_label(profile)
    for q in PERCENTILES:
        target = float(np.percentile(lengths, q))
        assert percentile(lengths.tolist(), q) == pytest.approx(target)
        chosen = picked[f"context_p{q}"]
        assert abs(chosen.input_tokens - target) == np.abs(lengths - target).min()


def test_percentiles_match_numpy_on_the_real_sample(real_trace_path: Path) -> None:
    trace = load_mooncake(real_trace_path)
    _check_percentiles(trace, derive_mooncake(trace))


def test_percentiles_match_numpy_on_the_slice() -> None:
    trace = packaged_trace()
    _check_percentiles(trace, derive_mooncake(trace))


def test_labels_have_the_properties_their_docstrings_promise() -> None:
    trace = packaged_trace()
    picked = _by_label(derive_mooncake(trace))
    recs = {line: rec for line, rec in zip(trace.lines, trace.records)}
    uses = Counter(b for r in trace.records for b in set(r.hash_ids))
    sub = recs[_line(picked["subagent_typical"])]
    assert uses[sub.hash_ids[0]] == len(trace.records)
    assert all(uses[b] == 1 for b in sub.hash_ids[1:])
    aux = recs[_line(picked["auxiliary_typical"])]
    assert aux.input_length <= np.percentile([r.input_length for r in trace.records], 25)
    assert aux.output_length <= np.percentile([r.output_length for r in trace.records], 25)
    assert picked["long_output"].output_tokens == max(r.output_length for r in trace.records)
    reused = picked["fully_reused"]
    pred = reused.cache_predecessor
    assert pred is not None and pred.hash_ids[:-1] == reused.hash_ids[:len(pred.hash_ids) - 1]
    assert int(pred.locator.rsplit(":", 1)[1]) < _line(reused)


def test_overlap_group_and_arrival_replay_follow_the_timestamps() -> None:
    trace = packaged_trace()
    profile = derive_mooncake(trace, group_size=3, replay_count=4, time_scale=0.5)
    stamps = {line: rec.timestamp for line, rec in zip(trace.lines, trace.records)}
    (group,) = profile.overlap_groups
    assert len(group.members) == 3 and len({stamps[_line(m)] for m in group.members}) == 1
    (replay,) = profile.replays
    first = min(stamps.values())
    distinct = sorted(set(stamps.values()))[:4]
    assert [stamps[_line(m)] for m in replay.members] == distinct
    assert [m.arrival_s for m in replay.members] == [
        pytest.approx((t - first) / 1000 * 0.5) for t in distinct]


def test_fitting_keeps_block_sharing_and_records_the_scale() -> None:
    raw = derive_mooncake(packaged_trace())
    fitted = fit_to_context(raw, 2048, max_output_tokens=32)
    block = next(all_requests(fitted)).block_size
    assert fitted.scale == block / 512 < 1
    for before, after in zip(all_requests(raw), all_requests(fitted)):
        assert after.hash_ids == before.hash_ids and after.block_size == block
        assert after.input_tokens + after.output_tokens <= 2048
        assert after.output_tokens == min(before.output_tokens, 32)
    reused = _by_label(fitted)["fully_reused"]
    pred = reused.cache_predecessor
    builder = PromptBuilder(0, vocab_size=512)
    a, b = builder.predecessor(reused), builder.request(reused)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared == (len(pred.hash_ids) - 1) * block  # every full shared block, scaled


def test_a_profile_that_fits_is_left_unscaled_and_an_impossible_one_is_refused() -> None:
    small = TrafficProfile(name="s", source="test", requests=[RequestProfile(
        label="r", input_tokens=20, output_tokens=4, hash_ids=[0, 1, 2], block_size=8)])
    assert fit_to_context(small, 2048).scale == 1.0
    with pytest.raises(TrafficError, match="cannot fit a 5-token context"):
        fit_to_context(small, 5, max_output_tokens=4)
    with pytest.raises(TrafficError, match="cannot fit a 2048-token context"):
        derive_mooncake(packaged_trace(), max_context=2048, max_output_tokens=2000)
