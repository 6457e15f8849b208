"""Where a profile comes from: ``FILE``, ``builtin:NAME``, ``mooncake:FILE``, ``agentx:FILE``.

The one resolver of profile arguments, shared by ``enginetap traffic`` and capture.
Built-in profiles are derived from a 60-line slice of the Mooncake conversation trace
shipped in the package (Apache-2.0; see ``data/NOTICE.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

from enginetap.errors import TrafficError
from enginetap.traffic.derive import derive_mooncake
from enginetap.traffic.loaders import MooncakeTrace, load_agentx, load_mooncake
from enginetap.traffic.profile import TrafficProfile, load_profile
from enginetap.traffic.scaling import fit_to_context

__all__ = ["BUILTIN_PROFILES", "builtin_profile", "packaged_trace", "resolve_profile"]

SLICE = "mooncake_conversation_slice.jsonl"


def packaged_trace() -> MooncakeTrace:
    """The Mooncake slice shipped with enginetap."""
    with resources.as_file(resources.files("enginetap.traffic").joinpath("data", SLICE)) as p:
        return load_mooncake(Path(p))


def _mooncake_tiny(max_context: int | None) -> TrafficProfile:
    # Fits the built-in tiny models (2048 positions) with room for 32 output tokens.
    return derive_mooncake(packaged_trace(), name="mooncake-tiny",
                           max_context=max_context or 2048, max_output_tokens=32,
                           group_size=4, replay_count=6)


BUILTIN_PROFILES: dict[str, Callable[[int | None], TrafficProfile]] = {
    "mooncake-tiny": _mooncake_tiny,
}
"""Built-in profile names → builders taking an optional ``max_context``."""


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
    else:
        profile = load_agentx(rest) if kind == "agentx" and rest else load_profile(spec)
        if max_context is not None:
            profile = fit_to_context(profile, max_context, max_output_tokens)
    return profile if seed is None else profile.model_copy(update={"seed": seed})
