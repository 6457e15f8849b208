"""Derived profiles: a few telling requests picked out of a Mooncake trace.

Mooncake records carry lengths, hash blocks and arrival times only; they say nothing of
agents. Each label below is therefore defined by what the trace does have:

- ``context_p10/p50/p90/p99``: the request whose input length is nearest the percentile
  of all input lengths (linear interpolation, numpy's default; the first on ties).
- ``subagent_typical``: a request that shares only the common first block (the system
  prompt every request starts with) with any other request — a fresh conversation on
  the shared system prompt, which is what a spawned subagent looks like from the
  cache's side; the median-length one of them.
- ``auxiliary_typical``: a short call — input and output both at or below the trace's
  25th percentiles (a title, a summary, a classification); the median-length one.
- ``fully_reused``: a request whose earlier predecessor's blocks, all but its last (a
  partial block in a conversation's previous turn), are the request's own prefix — a
  next conversation turn; at least two blocks (more than the system prompt). The
  predecessor warms the cache first; the pair with the largest reused share wins.
- ``long_output``: the request with the most output tokens.
- ``overlap``: requests that arrived at the same timestamp (the largest such set, at most
  ``group_size``), submitted together.
- ``arrival``: the first request of each of the first ``replay_count`` distinct arrival
  times (the trace logs arrivals in bursts at equal timestamps; one a burst keeps the
  replay short while spanning real gaps), submitted at their offsets times ``time_scale``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from enginetap.traffic.loaders import MOONCAKE_BLOCK, MooncakeTrace
from enginetap.traffic.profile import (
    ArrivalReplay, CachePredecessor, OverlapGroup, RequestProfile, TrafficProfile)
from enginetap.traffic.scaling import fit_to_context

__all__ = ["PERCENTILES", "derive_mooncake", "percentile"]

PERCENTILES = (10, 50, 90, 99)


def percentile(values: list[int], q: float) -> float:
    """The ``q``-th percentile of ``values`` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _nearest(values: list[int], target: float) -> int:
    return min(range(len(values)), key=lambda i: (abs(values[i] - target), i))


def _median_of(indices: list[int], values: list[int]) -> int | None:
    if not indices:
        return None
    ordered = sorted(indices, key=lambda i: (values[i], i))
    return ordered[(len(ordered) - 1) // 2]


def _request(trace: MooncakeTrace, i: int, label: str) -> RequestProfile:
    rec = trace.records[i]
    return RequestProfile(label=label, input_tokens=rec.input_length,
                          output_tokens=rec.output_length, hash_ids=rec.hash_ids,
                          block_size=MOONCAKE_BLOCK, source=trace.locator(i))


def _subagent(trace: MooncakeTrace) -> int | None:
    uses = Counter(b for r in trace.records for b in set(r.hash_ids))
    common = uses.most_common(1)[0][0]
    alone = [i for i, r in enumerate(trace.records)
             if r.hash_ids[0] == common and len(r.hash_ids) > 1
             and all(uses[b] == 1 for b in r.hash_ids[1:])]
    return _median_of(alone, [r.input_length for r in trace.records])


def _auxiliary(trace: MooncakeTrace) -> int | None:
    ins = [r.input_length for r in trace.records]
    outs = [r.output_length for r in trace.records]
    cut_in, cut_out = percentile(ins, 25), percentile(outs, 25)
    short = [i for i in range(len(ins)) if ins[i] <= cut_in and outs[i] <= cut_out]
    return _median_of(short, ins)


def _fully_reused(trace: MooncakeTrace) -> tuple[int, int] | None:
    """(request, predecessor): an earlier request whose blocks but its last (≥ 2 of them)
    are the request's prefix; the largest reused share of the request wins.

    A trie of earlier requests' block paths (all but the last block) is walked along each
    request: O(total blocks), so the 12k-request traces derive in seconds.
    """
    trie: dict = {}
    best: tuple[float, int, int, int] | None = None
    for i, rec in enumerate(trace.records):
        node, ids = trie, rec.hash_ids
        for m, block in enumerate(ids, 1):
            node = node.get(block)
            if node is None:
                break
            for j in node.get(None, ()) if m >= 2 else ():
                last = trace.records[j].hash_ids[-1]
                k = m + (1 if m < len(ids) and ids[m] == last else 0)
                key = (-k / len(ids), rec.input_length, i, j)
                best = key if best is None or key < best else best
        _insert(trie, ids[:-1], i)
    return None if best is None else (best[2], best[3])


def _insert(trie: dict, path: list[int], index: int) -> None:
    node = trie
    for block in path:
        node = node.setdefault(block, {})
    node.setdefault(None, []).append(index)


def _overlap(trace: MooncakeTrace, group_size: int) -> list[int]:
    by_time: dict[int, list[int]] = defaultdict(list)
    for i, rec in enumerate(trace.records):
        by_time[rec.timestamp].append(i)
    members = max(by_time.values(), key=lambda ids: (len(ids), -ids[0]))
    return members[:group_size] if len(members) >= 2 else []


def _singles(trace: MooncakeTrace) -> list[RequestProfile]:
    ins = [r.input_length for r in trace.records]
    out = [_request(trace, _nearest(ins, percentile(ins, q)), f"context_p{q}")
           for q in PERCENTILES]
    for label, pick in (("subagent_typical", _subagent(trace)),
                        ("auxiliary_typical", _auxiliary(trace))):
        if pick is not None:
            out.append(_request(trace, pick, label))
    pair = _fully_reused(trace)
    if pair is not None:
        i, j = pair
        pred = trace.records[j]
        out.append(_request(trace, i, "fully_reused").model_copy(update={
            "cache_predecessor": CachePredecessor(input_tokens=pred.input_length,
                                                  hash_ids=pred.hash_ids,
                                                  locator=trace.locator(j))}))
    outs = [r.output_length for r in trace.records]
    out.append(_request(trace, max(range(len(outs)), key=lambda i: (outs[i], -i)),
                        "long_output"))
    return out


def _replay(trace: MooncakeTrace, count: int, time_scale: float) -> ArrivalReplay:
    first_at: dict[int, int] = {}
    for i, rec in enumerate(trace.records):
        first_at.setdefault(rec.timestamp, i)
    picked = [first_at[t] for t in sorted(first_at)[:count]]
    start = trace.records[picked[0]].timestamp
    members = [_request(trace, i, f"arrival_line{trace.lines[i]}").model_copy(update={
        "arrival_s": (trace.records[i].timestamp - start) / 1000 * time_scale})
        for i in picked]
    return ArrivalReplay(label="arrival", time_scale=time_scale, members=members)


def derive_mooncake(trace: MooncakeTrace, *, name: str | None = None, seed: int = 0,
                    max_context: int | None = None, max_output_tokens: int = 128,
                    group_size: int = 4, replay_count: int = 8,
                    time_scale: float = 0.01) -> TrafficProfile:
    """The derived profile of ``trace`` (see the module doc), fit to ``max_context`` if given.

    Raises:
        TrafficError: the trace cannot fit ``max_context`` (see :func:`fit_to_context`).
    """
    group = _overlap(trace, group_size)
    profile = TrafficProfile(
        name=name or f"mooncake-{trace.path.stem}",
        source=f"mooncake:{trace.path.name} sha256={trace.sha256}", seed=seed,
        requests=_singles(trace),
        overlap_groups=[OverlapGroup(label="overlap", members=[
            _request(trace, i, f"overlap_line{trace.lines[i]}") for i in group])]
        if group else [],
        replays=[_replay(trace, replay_count, time_scale)] if replay_count > 0 else [],
        notes=[" ".join(item.replace("``", "").split())
               for item in (__doc__ or "").split("\n- ")[1:]])
    if max_context is None:
        return profile
    return fit_to_context(profile, max_context, max_output_tokens)
