"""Fit a profile to a model's context by scaling block sizes, keeping block sharing.

One factor ``f`` applies to every request of a profile, so relative lengths (the
percentiles) survive and two requests that shared ``k`` blocks still share ``k`` blocks:
block ids are kept, only each block shrinks from ``B`` to ``max(1, floor(B * f))``
tokens. A partial last block of ``r`` tokens becomes ``ceil(r * b / B)`` tokens. Output
tokens are capped, not scaled. The factor is recorded in :attr:`TrafficProfile.scale`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from enginetap.errors import TrafficError
from enginetap.traffic.profile import (
    ArrivalReplay, CachePredecessor, OverlapGroup, RequestProfile, TrafficProfile)

__all__ = ["all_requests", "check_fits", "fit_to_context", "scaled_length"]


def all_requests(profile: TrafficProfile) -> Iterator[RequestProfile]:
    """Every request of ``profile``: singles, group members, replay members."""
    yield from profile.requests
    for group in profile.overlap_groups:
        yield from group.members
    for replay in profile.replays:
        yield from replay.members


def scaled_length(input_tokens: int, blocks: int, block_size: int, new_block: int) -> int:
    """Length of ``blocks`` blocks once each shrinks from ``block_size`` to ``new_block``."""
    last = input_tokens - (blocks - 1) * block_size
    return (blocks - 1) * new_block + max(1, math.ceil(last * new_block / block_size))


def _factor(profile: TrafficProfile, max_context: int, max_output: int) -> float:
    factor = 1.0
    for req in all_requests(profile):
        out = min(req.output_tokens, max_output)
        room = max_context - out
        pred = req.cache_predecessor
        longest = max(req.input_tokens, pred.input_tokens if pred else 0)
        blocks = max(len(req.hash_ids), len(pred.hash_ids) if pred else 0)
        if room < blocks:
            raise TrafficError(
                f"request {req.label!r} cannot fit a {max_context}-token context",
                f"{blocks} hash blocks need ≥ {blocks} tokens and {out} output tokens are "
                "reserved", "raise --max-context or lower the output cap")
        if longest > room:
            # Blocks of floor(B * f) tokens, the last possibly full: n * B * f ≤ room.
            factor = min(factor, room / (blocks * req.block_size))
    return factor


def _scale_request(req: RequestProfile, factor: float, max_output: int) -> RequestProfile:
    new_block = max(1, math.floor(req.block_size * factor + 1e-9))
    pred = req.cache_predecessor
    if pred is not None:
        pred = CachePredecessor(
            input_tokens=scaled_length(pred.input_tokens, len(pred.hash_ids), req.block_size,
                                       new_block),
            hash_ids=pred.hash_ids, locator=pred.locator)
    return req.model_copy(update={
        "input_tokens": scaled_length(req.input_tokens, len(req.hash_ids), req.block_size,
                                      new_block),
        "output_tokens": min(req.output_tokens, max_output),
        "block_size": new_block, "cache_predecessor": pred})


def fit_to_context(profile: TrafficProfile, max_context: int,
                   max_output_tokens: int = 128) -> TrafficProfile:
    """``profile`` scaled so each prompt plus its (capped) output fits ``max_context``.

    Raises:
        TrafficError: a request has more blocks than the context has room for (one token
            a block is the floor), or the arguments are not positive.
    """
    if max_context < 2 or max_output_tokens < 1:
        raise TrafficError("cannot fit a profile", f"max_context={max_context}, "
                           f"max_output_tokens={max_output_tokens}",
                           "use a context ≥ 2 and an output cap ≥ 1")
    factor = _factor(profile, max_context, max_output_tokens)
    sizes = {r.block_size for r in all_requests(profile)}
    if len(sizes) == 1 and factor < 1:
        # One source block size: record the exact ratio of the block sizes used.
        (size,) = sizes
        factor = max(1, math.floor(size * factor + 1e-9)) / size

    def scale(req: RequestProfile) -> RequestProfile:
        return _scale_request(req, factor, max_output_tokens)

    scaled = profile.model_copy(update={
        "requests": [scale(r) for r in profile.requests],
        "overlap_groups": [OverlapGroup(label=g.label, members=[scale(m) for m in g.members])
                           for g in profile.overlap_groups],
        "replays": [ArrivalReplay(label=r.label, time_scale=r.time_scale,
                                  members=[scale(m) for m in r.members])
                    for r in profile.replays],
        "scale": profile.scale * factor,
        "notes": [*profile.notes, f"fit to a {max_context}-token context: block sizes × "
                  f"{factor:.6g} (ids and sharing kept), outputs capped at {max_output_tokens}"],
    })
    return TrafficProfile.model_validate(scaled.model_dump())


def check_fits(profile: TrafficProfile, max_context: int) -> None:
    """Check that every prompt plus its output fits ``max_context`` positions.

    Raises:
        TrafficError: the first request that does not fit, by label.
    """
    for req in all_requests(profile):
        pred = req.cache_predecessor
        for what, need in (("", req.input_tokens + req.output_tokens),
                           ("cache predecessor of ", pred.input_tokens + 1 if pred else 0)):
            if need > max_context:
                raise TrafficError(
                    f"{what}request {req.label!r} of profile {profile.name!r} does not fit",
                    f"it needs {need} positions, the model has {max_context}",
                    "fit the profile to the model (--max-context, or fit_to_context)")
