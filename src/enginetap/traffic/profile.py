"""The traffic profile format: requests as hash blocks, overlap groups, arrival replays.

A request carries no text: its prompt is a list of hash blocks (``hash_ids``), each
``block_size`` tokens, the last one possibly partial. Equal block ids (within a session)
mean equal tokens, which is what makes prefix caches hit; :mod:`enginetap.traffic.prompts`
rebuilds the tokens. A profile is data: it is saved beside what it produced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from enginetap.core.files import NotRegular, read_capped
from enginetap.core.untrusted_json import BadJson, loads_bounded
from enginetap.errors import TrafficError, describe_validation

__all__ = ["MAX_TOKENS", "MAX_TRACE_BYTES", "ArrivalReplay", "CachePredecessor", "OverlapGroup",
           "RequestProfile", "TrafficProfile", "blocks_needed", "load_profile", "read_trace_file",
           "save_profile"]

MAX_TRACE_BYTES = 256 << 20
"""Largest trace or profile file read (the public Mooncake traces are a few MB)."""

MAX_TOKENS = 1 << 24
"""Most tokens a request's prompt or output (or a block) may have: 16,777,216, far beyond
any model's context; a count above it is a corrupt or hostile trace."""


def blocks_needed(input_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` tile ``input_tokens`` (the last may be partial)."""
    return -(-input_tokens // block_size)


def _check_tiling(hash_ids: list[int], input_tokens: int, block_size: int, where: str) -> None:
    need = blocks_needed(input_tokens, block_size)
    if len(hash_ids) != need:
        raise ValueError(f"{where}hash_ids has {len(hash_ids)} blocks but input_tokens="
                         f"{input_tokens} with block_size={block_size} needs {need} "
                         f"(ceil(input_tokens / block_size))")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class CachePredecessor(_Model):
    """An earlier request whose prompt warms the prefix cache before the request runs.

    It shares the request's ``block_size`` and ``session``; it is sent with one output token.
    """

    input_tokens: int = Field(ge=1, le=MAX_TOKENS)
    """Prompt length of the predecessor, in tokens."""
    hash_ids: list[int] = Field(min_length=1)
    """The predecessor's hash blocks; ids it shares with the request give cache hits."""
    locator: str | None = None
    """Where the predecessor came from (trace line, upstream request id), for provenance."""


class RequestProfile(_Model):
    """One request: prompt as hash blocks, how many tokens to generate, and its label."""

    label: str = Field(min_length=1)
    """Name of the request within its profile (e.g. ``context_p50``)."""
    input_tokens: int = Field(ge=1, le=MAX_TOKENS)
    """Exact prompt length in tokens."""
    output_tokens: int = Field(ge=1, le=MAX_TOKENS)
    """Tokens to generate (EOS ignored where the engine allows)."""
    hash_ids: list[int] = Field(min_length=1)
    """Prompt blocks in order; ``len == ceil(input_tokens / block_size)``."""
    block_size: int = Field(ge=1, le=MAX_TOKENS)
    """Tokens per hash block (the last block may be partial)."""
    session: str | None = None
    """Namespace of the block ids (AgentX sessions); None: ids are global (Mooncake)."""
    cache_predecessor: CachePredecessor | None = None
    """A prompt sent first (one output token) to warm the prefix cache."""
    arrival_s: float | None = Field(default=None, ge=0)
    """Arrival offset in seconds within an arrival replay (already time-scaled)."""
    source: str | None = None
    """Where the request came from (``file:line``), for provenance."""

    @model_validator(mode="after")
    def _validate_blocks(self) -> RequestProfile:
        _check_tiling(self.hash_ids, self.input_tokens, self.block_size, "")
        if any(h < 0 for h in self.hash_ids):
            raise ValueError("hash_ids must be ≥ 0")
        pred = self.cache_predecessor
        if pred is not None:
            _check_tiling(pred.hash_ids, pred.input_tokens, self.block_size,
                          "cache_predecessor.")
        return self


def _check_unique(labels: list[str], what: str) -> None:
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise ValueError(f"{what} label {label!r} is used twice; labels must be unique")
        seen.add(label)


class OverlapGroup(_Model):
    """Requests submitted together, so the engine batches them (observed as overlapping)."""

    label: str = Field(min_length=1)
    """Name of the group."""
    members: list[RequestProfile] = Field(min_length=2)
    """The requests, submitted at once (no predecessors: the group starts cold)."""

    @model_validator(mode="after")
    def _validate_members(self) -> OverlapGroup:
        _check_unique([m.label for m in self.members], "members:")
        return self


class ArrivalReplay(_Model):
    """Requests submitted at their (time-scaled) arrival offsets."""

    label: str = Field(min_length=1)
    """Name of the replay."""
    time_scale: float = Field(gt=0)
    """Factor applied to the trace's arrival gaps (0.01: 100x faster than recorded)."""
    members: list[RequestProfile] = Field(min_length=1)
    """The requests; each has ``arrival_s`` and members are sorted by it."""

    @model_validator(mode="after")
    def _validate_arrivals(self) -> ArrivalReplay:
        _check_unique([m.label for m in self.members], "members:")
        times = [m.arrival_s for m in self.members]
        if any(t is None for t in times):
            raise ValueError("members: every member of an arrival replay needs arrival_s")
        if times != sorted(times):  # type: ignore[type-var]
            raise ValueError("members: must be sorted by arrival_s")
        return self


class TrafficProfile(_Model):
    """A named set of requests, overlap groups and arrival replays, with provenance."""

    name: str = Field(min_length=1)
    """Profile name (recorded with every request it drives)."""
    source: str
    """What it was made from: ``mooncake:FILE sha256=...``, an AgentX dataset, or by hand."""
    seed: int = 0
    """Seed of the prompt rebuilding (same seed and block id → same tokens)."""
    scale: float = Field(default=1.0, gt=0, le=1)
    """Block-size scale from the source to this profile (1: unscaled)."""
    requests: list[RequestProfile] = Field(default_factory=list)
    """Single requests, each run alone after a prefix-cache reset."""
    overlap_groups: list[OverlapGroup] = Field(default_factory=list)
    """Groups of requests submitted together."""
    replays: list[ArrivalReplay] = Field(default_factory=list)
    """Arrival replays by timestamp."""
    notes: list[str] = Field(default_factory=list)
    """How the profile was derived and what each label means."""

    @model_validator(mode="after")
    def _validate_labels(self) -> TrafficProfile:
        _check_unique([r.label for r in self.requests] + [g.label for g in self.overlap_groups]
                      + [r.label for r in self.replays], "request/group/replay")
        if not (self.requests or self.overlap_groups or self.replays):
            raise ValueError("requests: a profile needs at least one request, group or replay")
        return self


def read_trace_file(path: Path, kind: str) -> bytes:
    """The bytes of ``path``, a regular file of at most :data:`MAX_TRACE_BYTES`.

    Raises:
        TrafficError: missing, not a regular file (a FIFO, a device, a directory), too
            large or unreadable.
    """
    try:
        return read_capped(path, MAX_TRACE_BYTES)
    except NotRegular as exc:
        raise TrafficError(f"cannot read {kind} {path}", f"it {exc}",
                           "pass a regular file") from None
    except OSError as exc:
        raise TrafficError(f"cannot read {kind} {path}", exc.strerror or str(exc),
                           "check the path") from None


def load_profile(path: str | Path) -> TrafficProfile:
    """Read a profile saved by :func:`save_profile`.

    Raises:
        TrafficError: the file is unreadable, not JSON (with line and column), or a field
            is invalid (named by its path, e.g. ``requests.2.hash_ids``).
    """
    path = Path(path)
    text = read_trace_file(path, "traffic profile").decode("utf-8", errors="replace")
    try:
        data: Any = loads_bounded(text)
    except BadJson as exc:
        if exc.line is None:
            raise TrafficError(f"traffic profile {path} is invalid", str(exc),
                               "load a profile `enginetap traffic derive` wrote") from None
        raise TrafficError(f"traffic profile {path} line {exc.line} column {exc.column} is "
                           "not valid JSON", exc.msg, "fix the JSON syntax there") from None
    try:
        return TrafficProfile.model_validate(data)
    except ValidationError as exc:
        raise TrafficError(f"traffic profile {path} is invalid", describe_validation(exc),
                           "fix the named fields") from None


def save_profile(profile: TrafficProfile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON (atomically: a partial file is never left).

    Raises:
        TrafficError: the file cannot be written.
    """
    from enginetap.dataset.atomic import replace_text

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, profile.model_dump_json(indent=2, exclude_none=True) + "\n")
    except OSError as exc:
        raise TrafficError(f"cannot write traffic profile {path}", exc.strerror or str(exc),
                           "choose a writable output path") from None
    return path
