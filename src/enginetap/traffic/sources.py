"""Where a profile comes from: ``FILE``, ``builtin:NAME``, ``mooncake:FILE``, ``agentx:FILE``.

The one resolver of profile arguments, shared by ``enginetap traffic`` and capture.
Built-in profiles are derived from a 60-line slice of the Mooncake conversation trace
shipped in the package (Apache-2.0; see ``data/NOTICE.md``; ``enginetap traffic list``
prints its path).
"""

from __future__ import annotations

import os

from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path

from enginetap.errors import TrafficError
from enginetap.traffic.derive import derive_mooncake, percentile
from enginetap.traffic.loaders import MooncakeTrace, load_agentx, load_mooncake
from enginetap.traffic.profile import TrafficProfile, load_profile
from enginetap.traffic.scaling import fit_to_context

__all__ = ["BUILTIN_PROFILES", "PROFILE_ABOUT", "builtin_profile", "packaged_trace",
           "packaged_trace_path", "resolve_profile"]

SLICE = "mooncake_conversation_slice.jsonl"


def packaged_trace_path() -> Path:
    """Where the shipped Mooncake slice lies (a file inside the installed package)."""
    return Path(str(resources.files("enginetap.traffic").joinpath("data", SLICE)))


def packaged_trace() -> MooncakeTrace:
    """The Mooncake slice shipped with enginetap."""
    with resources.as_file(resources.files("enginetap.traffic").joinpath("data", SLICE)) as p:
        return load_mooncake(Path(p))


def _half(trace: MooncakeTrace, shorter: bool) -> MooncakeTrace:
    """The requests of ``trace`` whose input is at or below (``shorter``) or at or above
    the median input length; line numbers stay those of the file."""
    median = percentile([r.input_length for r in trace.records], 50)
    keep = [i for i, r in enumerate(trace.records)
            if (r.input_length <= median if shorter else r.input_length >= median)]
    return replace(trace, records=[trace.records[i] for i in keep],
                   lines=[trace.lines[i] for i in keep])


def _mooncake_tiny(max_context: int | None) -> TrafficProfile:
    # Fits the built-in tiny models (2048 positions) with room for 32 output tokens.
    return derive_mooncake(packaged_trace(), name="mooncake-tiny",
                           max_context=max_context or 2048, max_output_tokens=32,
                           group_size=4, replay_count=6)


def _chat_short(max_context: int | None) -> TrafficProfile:
    # Quick chat turns: at most 512 positions, 16 output tokens.
    return derive_mooncake(_half(packaged_trace(), shorter=True), name="chat-short",
                           max_context=min(max_context or 512, 512), max_output_tokens=16,
                           group_size=8, replay_count=8)


def _agentic_long(max_context: int | None) -> TrafficProfile:
    # Long agentic contexts: the whole context of the model, 64 output tokens.
    return derive_mooncake(_half(packaged_trace(), shorter=False), name="agentic-long",
                           max_context=max_context or 2048, max_output_tokens=64,
                           group_size=8, replay_count=8)


BUILTIN_PROFILES: dict[str, Callable[[int | None], TrafficProfile]] = {
    "mooncake-tiny": _mooncake_tiny,
    "chat-short": _chat_short,
    "agentic-long": _agentic_long,
}
"""Built-in profile names → builders taking an optional ``max_context``."""

PROFILE_ABOUT: dict[str, str] = {
    "mooncake-tiny": "every derived label of the whole sample (context p10/p50/p90/p99, a "
                     "subagent, an auxiliary call, a reused prefix warmed by its predecessor, "
                     "an overlapping group of 4, 6 arrivals), fit to 2048 positions, 32 "
                     "output tokens",
    "chat-short": "short chat turns: the sample's shorter half (input at or below the "
                  "median), fit to 512 positions, 16 output tokens, an overlapping group "
                  "of 7 and 6 arrivals: a quick run",
    "agentic-long": "long agentic contexts: the sample's longer half (input at or above the "
                    "median), with a reused prefix warmed by its predecessor and an "
                    "overlapping group of 8, fit to the model's whole context (2048 "
                    "positions on the built-in models), 64 output tokens",
}
"""What each built-in profile is (``enginetap traffic list``)."""


def builtin_profile(name: str, max_context: int | None = None) -> TrafficProfile:
    """Built-in profile ``name``.

    Raises:
        TrafficError: no built-in profile has that name.
    """
    if name not in BUILTIN_PROFILES:
        raise TrafficError(f"no built-in traffic profile {name!r}",
                           f"built-ins are {', '.join(sorted(BUILTIN_PROFILES))}",
                           "pick one of those, or pass a profile file")
    return BUILTIN_PROFILES[name](max_context)


def resolve_profile(spec: str, *, max_context: int | None = None,
                    max_output_tokens: int = 128, seed: int | None = None) -> TrafficProfile:
    """The profile ``spec`` names, fit to ``max_context`` when given.

    ``FILE`` (a saved profile), ``builtin:NAME``, ``mooncake:FILE`` (derived, see
    :func:`~enginetap.traffic.derive.derive_mooncake`) or ``agentx:FILE``. ``seed``
    replaces the profile's prompt seed (None keeps it; derived profiles default to 0).

    Raises:
        TrafficError: unknown built-in, unreadable or invalid file, or a profile that
            cannot fit ``max_context``.
    """
    kind, _, rest = spec.partition(":")
    if kind == "builtin" and rest:
        profile = builtin_profile(rest, max_context)
    elif kind == "mooncake" and rest:
        profile = derive_mooncake(load_mooncake(rest), max_context=max_context,
                                  max_output_tokens=max_output_tokens)
    elif kind == "agentx" and rest:
        profile = load_agentx(rest)
        if max_context is not None:
            profile = fit_to_context(profile, max_context, max_output_tokens)
    else:
        profile = _saved_profile(spec)
        if max_context is not None:
            profile = fit_to_context(profile, max_context, max_output_tokens)
    return profile if seed is None else profile.model_copy(update={"seed": seed})


def _saved_profile(spec: str) -> TrafficProfile:
    """A saved profile; a trace passed without its ``mooncake:``/``agentx:`` prefix is
    named as such instead of failing as an invalid profile."""
    try:
        return load_profile(spec)
    except TrafficError:
        kind = _trace_kind(Path(spec))
        if kind is None:
            raise
        what = "a Mooncake trace" if kind == "mooncake" else "an AgentX shapes file"
        raise TrafficError(f"{spec} is {what}, not a saved profile",
                           "traces are read by the loader their prefix names",
                           f"pass {kind}:{spec}") from None


def _trace_kind(path: Path) -> str | None:
    """``mooncake`` when the file's first line is a Mooncake record, ``agentx`` when the
    file is an AgentX shapes document, else None (only a regular file is opened, only its
    first 16 MiB are read, and the JSON is parsed with the untrusted-input bounds)."""
    from enginetap.core.files import open_regular
    from enginetap.core.untrusted_json import BadJson, loads_bounded

    try:
        with open_regular(path) as fd, os.fdopen(os.dup(fd), "rb") as handle:
            text = handle.read(16 << 20).decode("utf-8", errors="replace")
    except OSError:
        return None
    for candidate, kind in ((next(iter(text.splitlines()), ""), "mooncake"), (text, "agentx")):
        try:
            found = loads_bounded(candidate)
        except (BadJson, ValueError):
            continue
        if not isinstance(found, dict):
            continue
        if kind == "mooncake" and {"hash_ids", "input_length"} <= found.keys():
            return kind
        if kind == "agentx" and {"profiles", "overlap_profiles"} <= found.keys():
            return kind
    return None
